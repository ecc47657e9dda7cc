"""File operations, archives, and persistence across calls."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import sandman
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio


async def test_write_then_read_in_another_call(client: DaemonClient, tmp_path: Path) -> None:
    path = str(tmp_path / "sub" / "dir" / "f.txt")
    stat = await client.write_file(path, "hello", mode=0o600)
    assert (stat.type, stat.size, stat.mode, stat.name) == ("file", 5, "600", "f.txt")
    assert await client.read_file(path) == b"hello"
    assert (await client.exec(["cat", path])).stdout == "hello"
    await client.write_file(path, b"\x00\xff binary")
    assert await client.read_file(path) == b"\x00\xff binary"
    assert (await client.stat(path)).mode == "600"  # the existing mode is kept


async def test_written_by_command_read_by_api(client: DaemonClient, tmp_path: Path) -> None:
    await client.exec(f"echo from-shell > {tmp_path}/x")
    assert await client.read_file(str(tmp_path / "x")) == b"from-shell\n"


async def test_stat_list_mkdir_move_remove(client: DaemonClient, tmp_path: Path) -> None:
    base = tmp_path / "tree"
    made = await client.mkdir(str(base / "a" / "b"))
    assert made.type == "directory"
    await client.write_file(str(base / "a" / "f"), "x")
    (base / "link").symlink_to("a/f")
    entries = await client.list_dir(str(base))
    assert [(e.name, e.type) for e in entries] == [("a", "directory"), ("link", "symlink")]
    assert entries[1].link_target == "a/f"

    moved = await client.move(str(base / "a" / "f"), str(base / "g"))
    assert moved.path == str(base / "g")
    assert not await client.exists(str(base / "a" / "f"))
    await client.write_file(str(base / "h"), "y")
    with pytest.raises(sandman.PathExists):
        await client.move(str(base / "g"), str(base / "h"))
    await client.move(str(base / "g"), str(base / "h"), overwrite=True)
    assert await client.read_file(str(base / "h")) == b"x"

    with pytest.raises(sandman.DirectoryNotEmpty):
        await client.remove(str(base / "a"))
    await client.remove(str(base / "a"), recursive=True)
    await client.remove(str(base / "h"))
    assert [e.name for e in await client.list_dir(str(base))] == ["link"]


async def test_file_errors(client: DaemonClient, tmp_path: Path) -> None:
    with pytest.raises(sandman.PathNotFound) as missing:
        await client.read_file(str(tmp_path / "missing"))
    assert isinstance(missing.value, FileNotFoundError)
    assert missing.value.code == "not_found" and missing.value.status == 404
    with pytest.raises(sandman.IsADirectory):
        await client.read_file(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(sandman.NotADirectory):
        await client.list_dir(str(tmp_path / "file"))
    with pytest.raises(sandman.IsADirectory):
        await client.write_file(str(tmp_path), "x")
    with pytest.raises(sandman.PathNotFound):
        await client.write_file(str(tmp_path / "no" / "f"), "x", parents=False)
    with pytest.raises(sandman.PathNotFound):
        await client.remove(str(tmp_path / "missing"))
    with pytest.raises(sandman.InvalidRequest):
        await client.read_file("")


def _tar(entries: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info in entries:
            content = (data or {}).get(info.name)
            if content is not None:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _file(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    return info


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


async def test_archive_round_trip(client: DaemonClient, tmp_path: Path) -> None:
    tar = _tar(
        [_dir("pkg"), _file("pkg/a.py"), _symlink("pkg/link", "a.py"), _file("top.txt")],
        {"pkg/a.py": b"print(1)\n", "top.txt": b"top"},
    )
    dest = tmp_path / "dest"
    result = await client.upload_archive(str(dest), tar)
    assert result.files >= 2 and result.bytes == len(b"print(1)\n") + 3
    assert (dest / "pkg" / "a.py").read_bytes() == b"print(1)\n"
    assert (dest / "pkg" / "link").readlink() == Path("a.py")

    await client.upload_archive(str(tmp_path / "gz"), gzip.compress(tar))
    assert (tmp_path / "gz" / "top.txt").read_bytes() == b"top"

    for compressed in (False, True):
        raw = await client.download_archive(str(dest), gzip=compressed)
        with tarfile.open(fileobj=io.BytesIO(raw)) as back:
            names = {m.name.removeprefix("./") for m in back.getmembers()}
            assert {"pkg/a.py", "pkg/link", "top.txt"} <= names
            member = back.extractfile("pkg/a.py") or back.extractfile("./pkg/a.py")
            assert member is not None and member.read() == b"print(1)\n"

    raw = await client.download_archive(str(dest / "top.txt"))
    with tarfile.open(fileobj=io.BytesIO(raw)) as back:
        assert back.getnames() == ["top.txt"]


@pytest.mark.parametrize(
    "entries",
    [
        [_file("ok.txt"), _file("../escape.txt")],
        [_file("ok.txt"), _file("/abs/escape.txt")],
        [_file("ok.txt"), _symlink("out", "../../")],
        [_file("ok.txt"), _symlink("out", "/etc")],
        [_symlink("d", "."), _symlink("d/e", "/tmp"), _file("d/e/x")],
    ],
    ids=["dotdot", "absolute", "symlink-relative", "symlink-absolute", "through-symlink"],
)
async def test_unsafe_archives_are_refused_and_leave_nothing(
    client: DaemonClient, tmp_path: Path, entries: list[tarfile.TarInfo]
) -> None:
    dest = tmp_path / "target" / "dest"
    with pytest.raises(sandman.UnsafeArchive):
        await client.upload_archive(str(dest), _tar(entries))
    assert not (tmp_path / "target" / "escape.txt").exists()
    assert not (tmp_path / "escape.txt").exists()
    assert not dest.exists() or list(dest.iterdir()) == []


async def test_garbage_archive(client: DaemonClient, tmp_path: Path) -> None:
    with pytest.raises(sandman.InvalidRequest):
        await client.upload_archive(str(tmp_path / "d"), b"this is not a tar archive" * 40)


async def test_streamed_upload(client: DaemonClient, tmp_path: Path) -> None:
    tar = _tar([_file("f")], {"f": b"x" * 100_000})

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(tar), 7000):
            yield tar[i : i + 7000]

    await client.upload_archive(str(tmp_path / "s"), pieces())
    assert (tmp_path / "s" / "f").read_bytes() == b"x" * 100_000


async def test_proc_files_that_claim_size_zero_are_read_whole(client: DaemonClient) -> None:
    assert (await client.read_file("/proc/self/status")).startswith(b"Name:")
