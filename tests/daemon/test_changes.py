"""``/v1/changes``: a sandbox's changed files, taken from one real daemon (PID 1 of a
rootfs), checked on the host and applied by another daemon of the same rootfs; and a
hostile daemon's streams, refused on the host with nothing kept."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from sandman import errors
from sandman._transport import HTTPTransport
from sandman.daemon import DaemonClient
from sandman.daemon.changes import (
    PRUNE,
    ChangesChecker,
    apply_changes,
    download_changes,
)
from tests.daemon.rootfs import TOKEN, make_rootfs, needs_unshare, run_pid1
from tests.daemon.test_spec import RecordingTransport, check_exchange
from tests.providers.kubernetes.conftest import loopback
from tests.support import until

pytestmark = pytest.mark.anyio


def _image(root: Path) -> None:
    """What both sandboxes' image holds beyond busybox."""
    make_rootfs(root)
    (root / "etc").mkdir()
    (root / "etc" / "conf").write_text("a=1\n")
    (root / "data" / "old").mkdir(parents=True)
    (root / "data" / "old" / "x").write_text("x")
    (root / "data" / "keep").write_text("keep")


def _past_the_margin(tmp_path: Path) -> None:
    """Wait until the ctime clock is well past what exists: the daemon counts what changed
    from 50 ms before its start (a runtime's files, made just before, it would take for
    the sandbox's; a rootfs is not a container: its /dev is no mount)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    made = probe.stat().st_ctime_ns
    until("the ctime clock to pass 100 ms", lambda: _ctime_after(probe, made + 100_000_000))


def _ctime_after(probe: Path, at: int) -> bool:
    probe.write_bytes(b"")
    return probe.stat().st_ctime_ns > at


@pytest.fixture
def two_sandboxes(tmp_path: Path) -> Iterator[tuple[Path, Path, str, str]]:
    """Two daemons as PID 1 of two copies of one image: (root, root, socket, socket)."""
    a, b = tmp_path / "a", tmp_path / "b"
    _image(a)
    _image(b)
    _past_the_margin(tmp_path)
    with run_pid1(a, tmp_path / "a.log") as first, run_pid1(b, tmp_path / "b.log") as second:
        yield a, b, first.sock, second.sock


@needs_unshare
async def test_changes_taken_from_one_sandbox_make_another_the_same(
    two_sandboxes: tuple[Path, Path, str, str], tmp_path: Path
) -> None:
    a, b, sock_a, sock_b = two_sandboxes
    recorder = RecordingTransport(
        HTTPTransport(uds=sock_a, default_headers={"Authorization": f"Bearer {TOKEN}"})
    )
    async with DaemonClient(uds=sock_a, token=TOKEN) as sandbox:
        script = (
            "echo changed > /etc/conf && rm -rf /data/old && mkdir -p /work/src && "
            "echo 'print(1)' > /work/src/main.py && chmod 4750 /work/src/main.py && "
            "ln -s /etc/conf /work/abs && ln -s ../etc/conf /work/rel && "
            "ln /work/src/main.py /work/hard && mkdir /work/empty && chmod 700 /work/empty"
        )
        result = await sandbox.exec(["sh", "-c", script])
        assert result.exit_code == 0, result.stderr
    kept = tmp_path / "snapshot.tar"
    recording = DaemonClient(transport=recorder)
    try:
        summary = await download_changes(
            recording, kept, max_bytes=2**30, max_entries=100_000, timeout=60
        )
    finally:
        await recording.aclose()
    assert summary.listings >= 3  # /, /etc, /data, /work... each changed directory
    with tarfile.open(kept) as tar:
        names = tar.getnames()
    assert {"etc/conf", "work/src/main.py", "work/abs", "work/hard", PRUNE} <= set(names)
    assert not any(n.startswith(("proc", ".sandman/sandmand")) for n in names)

    recorder_b = RecordingTransport(
        HTTPTransport(uds=sock_b, default_headers={"Authorization": f"Bearer {TOKEN}"})
    )
    other = DaemonClient(transport=recorder_b)
    try:
        applied = await apply_changes(other, kept, timeout=60)
    finally:
        await other.aclose()
    assert applied.removed == 1  # /data/old, with what it held
    assert applied.files >= 4
    for exchange in [*recorder.exchanges, *recorder_b.exchanges]:
        check_exchange(exchange)

    assert (b / "etc" / "conf").read_text() == "changed\n"
    assert not (b / "data" / "old").exists()
    assert (b / "data" / "keep").read_text() == "keep"
    main = b / "work" / "src" / "main.py"
    assert main.read_text() == "print(1)\n"
    assert stat.S_IMODE(main.stat().st_mode) == 0o4750
    assert main.stat().st_mtime_ns == (a / "work" / "src" / "main.py").stat().st_mtime_ns
    assert os.readlink(b / "work" / "abs") == "/etc/conf"
    assert os.readlink(b / "work" / "rel") == "../etc/conf"
    assert (b / "work" / "hard").stat().st_ino == main.stat().st_ino
    assert stat.S_IMODE((b / "work" / "empty").stat().st_mode) == 0o700
    assert (b / ".sandman" / "sandmand").stat().st_size == (
        a / ".sandman" / "sandmand"
    ).stat().st_size


# -- a hostile daemon -----------------------------------------------------------------


def _tar(*entries: tarfile.TarInfo, bodies: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info in entries:
            body = (bodies or {}).get(info.name)
            if body is not None:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return buf.getvalue()


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def _listing(directory: str, *names: str) -> bytes:
    return directory.encode() + b"\0" + b"".join(n.encode() + b"\0" for n in names)


HOSTILE: dict[str, tuple[bytes, type[errors.SandboxError], str]] = {
    "dotdot": (_tar(_entry("../../escape"), bodies={"../../escape": b"x"}), errors.UnsafeArchive, ".."),
    "absolute": (_tar(_entry("/etc/passwd"), bodies={"/etc/passwd": b"x"}), errors.UnsafeArchive, "absolute"),
    "under proc": (_tar(_entry("proc/sys/kernel/core_pattern"), bodies={"proc/sys/kernel/core_pattern": b"|x"}), errors.UnsafeArchive, "not the sandbox's files"),
    "the daemon's": (_tar(_entry(".sandman/sandmand"), bodies={".sandman/sandmand": b"x"}), errors.UnsafeArchive, "not the sandbox's files"),
    "a device": (_tar(_entry("dev-null", tarfile.CHRTYPE)), errors.UnsafeArchive, "type"),
    "a fifo": (_tar(_entry("fifo", tarfile.FIFOTYPE)), errors.UnsafeArchive, "type"),
    "a hard link out": (_tar(_entry("h", tarfile.LNKTYPE, "../../etc/shadow")), errors.UnsafeArchive, ".."),
    "a hard link to nothing sent": (_tar(_entry("h", tarfile.LNKTYPE, "etc/shadow")), errors.UnsafeArchive, "only a file sent"),
    "a symlink through dotdot name": (_tar(_entry("../l", tarfile.SYMTYPE, "/")), errors.UnsafeArchive, ".."),
    "a listing that climbs": (_tar(_entry(PRUNE), bodies={PRUNE: _listing("../..", "fx")}), errors.UnsafeArchive, ".."),
    "a listing name with a slash": (_tar(_entry(PRUNE), bodies={PRUNE: _listing("", "fa/b")}), errors.UnsafeArchive, "names"),
    "a listing name dotdot": (_tar(_entry(PRUNE), bodies={PRUNE: _listing("", "d..")}), errors.UnsafeArchive, "names"),
    "a listing of proc": (_tar(_entry(PRUNE), bodies={PRUNE: _listing("proc", "fx")}), errors.UnsafeArchive, "not the sandbox's files"),
    "twice": (_tar(_entry("a"), _entry("a"), bodies={"a": b"1"}), errors.UnsafeArchive, "twice"),
    "oversize": (_tar(_entry("big"), bodies={"big": b"x" * 5000}), errors.FileTooLarge, "more than 4096 bytes"),
    "not a tar": (b"HTTP/1.1 200 OK\r\n" * 64, errors.UnsafeArchive, "not a tar stream"),
    "cut short": (_tar(_entry("a"), bodies={"a": b"1" * 100})[:1024], errors.DaemonError, "cut short"),
    "the daemon's failure": (b"", errors.DaemonError, "permission denied"),
}  # fmt: skip


def _failure() -> bytes:
    """What the daemon sends when it fails mid-stream: an entry, then a global header
    saying why, and no end-of-archive marker."""
    record = "SANDMAN.error=cannot read /x: permission denied\n"
    length = len(record) + 3
    body = f"{length} {record}".encode()
    assert len(body) == length
    header = tarfile.TarInfo("pax_global_header")
    header.type, header.size = tarfile.XGLTYPE, len(body)
    entry = _entry("ok").tobuf(tarfile.PAX_FORMAT)
    return entry + header.tobuf(tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, bytes]]]:
    """A daemon that answers GET /v1/changes with whatever the test puts in ``answer``."""
    answer: dict[str, bytes] = {}
    done = asyncio.Event()

    async def changes(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-tar"})
        await response.prepare(request)
        await response.write(answer["body"])
        if answer.get("stall"):
            await done.wait()  # sends nothing more until the test is over
        return response

    async with loopback({"/v1/changes": changes}) as url:
        try:
            yield url, answer
        finally:
            done.set()


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_a_hostile_stream_is_refused_and_nothing_is_kept(
    case: str, hostile: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    url, answer = hostile
    body, error, says = HOSTILE[case]
    answer["body"] = _failure() if case == "the daemon's failure" else body
    store = tmp_path / "store"
    store.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    host, port = url.removeprefix("http://").split(":")
    async with DaemonClient(host=host, port=int(port), token="t") as client:
        with pytest.raises(error, match=says):
            await download_changes(
                client, store / "files.tar", max_bytes=4096, max_entries=100, timeout=30
            )
    assert list(store.iterdir()) == []  # the partial file is gone
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "escape").exists()


async def test_a_daemon_that_stalls_is_given_up_on(
    hostile: tuple[str, dict[str, bytes]], tmp_path: Path
) -> None:
    url, answer = hostile
    answer["body"] = _tar(_entry("a"), bodies={"a": b"1"})[:700]
    answer["stall"] = b"and then nothing, until the test is over"
    host, port = url.removeprefix("http://").split(":")
    async with DaemonClient(host=host, port=int(port), token="t") as client:
        with pytest.raises(errors.SandboxTimeout, match="did not come within"):
            await download_changes(
                client, tmp_path / "files.tar", max_bytes=4096, max_entries=100, timeout=0.5
            )
    assert not (tmp_path / "files.tar").exists()


def test_what_is_kept_is_the_checkers_own_writing() -> None:
    # An odd but harmless header (a uname, a PAX comment) is not passed on: the copy
    # is written from the checked fields only.
    odd = _entry("a")
    odd.uname, odd.pax_headers = "root", {"comment": "x" * 100, "mtime": "1700000000.5"}
    sink = io.BytesIO()
    checker = ChangesChecker(sink, max_bytes=100, max_entries=10)
    checker.feed(_tar(odd, bodies={"a": b"data"}) + b"trailing bytes are not read")
    summary = checker.close()
    assert (summary.entries, summary.bytes, summary.listings) == (1, 4, 0)
    kept = sink.getvalue()
    assert b"comment" not in kept and b"root" not in kept
    with tarfile.open(fileobj=io.BytesIO(kept)) as tar:
        (member,) = tar.getmembers()
        assert (member.name, member.size, member.mtime) == ("a", 4, 1700000000.5)
