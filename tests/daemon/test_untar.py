"""Host-side extraction of hostile archives (what a sandbox may send back)."""

from __future__ import annotations

import io
import os
import stat
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sandman import errors
from sandman.daemon.untar import TarExtractor, extract_tar

Entry = Callable[[tarfile.TarFile], None]


def _tar(*entries: Entry, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for entry in entries:
            entry(tar)
    return buffer.getvalue()


def reg(name: str, data: bytes = b"data", mode: int = 0o644) -> Entry:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))

    return add


def pax_named(name: str) -> Entry:
    """A file whose PAX ``path`` may hold what a ustar name field cannot (NUL)."""

    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("plain")
        info.pax_headers = {"path": name}
        tar.addfile(info)

    return add


def special(name: str, kind: bytes, link: str = "", mode: int = 0o755) -> Entry:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, link, mode
        tar.addfile(info)

    return add


def d(name: str, mode: int = 0o755) -> Entry:
    return special(name, tarfile.DIRTYPE, mode=mode)


def sym(name: str, target: str) -> Entry:
    return special(name, tarfile.SYMTYPE, target)


def hard(name: str, target: str) -> Entry:
    return special(name, tarfile.LNKTYPE, target)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host file beside the destination that no extraction may touch."""
    victim = tmp_path / "outside" / "victim"
    victim.parent.mkdir()
    victim.write_text("original\n")
    return victim


def _untouched(outside: Path) -> None:
    assert outside.read_text() == "original\n"
    assert sorted(p.name for p in outside.parent.iterdir()) == ["victim"]


def cve_2025_4517(target: str) -> bytes:
    """The published CVE-2025-4517 shape: a symlink chain whose expansion passes
    PATH_MAX (so ``os.path.realpath`` gives up and the stdlib filter is fooled),
    an ``escape`` symlink through it, a hard link through that, then a file
    entry of the hard link's name that overwrites the outside file."""
    comp = "d" * 247
    steps = "abcdefghijklmnop"
    entries: list[Entry] = []
    path = ""
    for step in steps:
        entries += [d(os.path.join(path, comp)), sym(os.path.join(path, step), comp)]
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    entries += [
        sym(linkpath, "../" * len(steps)),
        sym("escape", f"{linkpath}/../{Path(target).parent}"),
        hard("flaglink", f"escape/{Path(target).name}"),
        reg("flaglink", b"pwned\n"),
    ]
    return _tar(*entries)


@pytest.mark.skipif(
    sys.version_info >= (3, 11, 13), reason="the stdlib filter is fixed in this Python"
)
def test_the_cve_shape_fools_the_stdlib_filter_on_this_python(
    tmp_path: Path, outside: Path
) -> None:
    """Proves the archive below is the real attack: ``filter="data"`` lets it out."""
    archive = cve_2025_4517("outside/victim")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path / "dest", filter="data")
    assert outside.read_text() == "pwned\n"


def test_the_cve_shape_is_refused_and_leaves_nothing(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "dest"
    with pytest.raises(errors.UnsafeArchive, match="symlink"):
        extract_tar(io.BytesIO(cve_2025_4517("outside/victim")), dest)
    _untouched(outside)
    assert not dest.exists()


HOSTILE: dict[str, tuple[list[Entry], type[Exception], str]] = {
    "dotdot": ([reg("../outside/victim")], errors.UnsafeArchive, r"'\.\.' component"),
    "dotdot-inside": ([reg("a/../../outside/victim")], errors.UnsafeArchive, r"'\.\.'"),
    "absolute": ([reg(str(Path("/x/outside/victim")))], errors.UnsafeArchive, "absolute"),
    "nul": ([pax_named("a\0b")], errors.UnsafeArchive, "NUL"),
    "file-through-symlink-inside": (
        [sym("l", "."), reg("l/x")],
        errors.UnsafeArchive,
        "through symlink 'l'",
    ),
    "file-through-symlink-outside": (
        [sym("l", "../outside"), reg("l/victim")],
        errors.UnsafeArchive,
        "outside",
    ),
    "symlink-absolute": ([sym("l", "/etc")], errors.UnsafeArchive, "absolute target"),
    "symlink-chain": ([sym("d", "."), sym("a", "d/..")], errors.UnsafeArchive, "resolves outside"),
    "symlink-chain-made-by-a-later-entry": (
        [sym("a", "d/../outside/victim"), sym("d", ".")],
        errors.UnsafeArchive,
        "once the whole archive is unpacked",
    ),
    "symlink-loop": ([sym("a", "b"), sym("b", "a")], errors.UnsafeArchive, "resolves outside"),
    "hardlink-etc-passwd": ([hard("p", "/etc/passwd")], errors.UnsafeArchive, "absolute"),
    "hardlink-outside": ([hard("p", "../outside/victim")], errors.UnsafeArchive, r"'\.\.'"),
    "hardlink-not-extracted": ([hard("p", "q")], errors.UnsafeArchive, "unpacked before"),
    "hardlink-through-symlink": (
        [reg("f"), sym("l", "."), hard("p", "l/f")],
        errors.UnsafeArchive,
        "unpacked before",
    ),
    "char-device": ([special("null", tarfile.CHRTYPE)], errors.UnsafeArchive, "character"),
    "block-device": ([special("sda", tarfile.BLKTYPE)], errors.UnsafeArchive, "block device"),
    "fifo": ([special("p", tarfile.FIFOTYPE)], errors.UnsafeArchive, "fifo"),
    "directory-over-file": ([reg("x"), d("x")], errors.NotADirectory, "file stands"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_and_leave_nothing(
    case: str, tmp_path: Path, outside: Path
) -> None:
    entries, error, message = HOSTILE[case]
    dest = tmp_path / "dest"
    with pytest.raises(error, match=message):
        extract_tar(io.BytesIO(_tar(*[reg("first"), *entries])), dest)
    _untouched(outside)
    assert not dest.exists(), list(dest.rglob("*"))


def test_symlinks_already_in_the_destination_are_never_followed(
    tmp_path: Path, outside: Path
) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "pre").symlink_to(outside.parent)
    with pytest.raises(errors.UnsafeArchive, match="through symlink 'pre'"):
        extract_tar(io.BytesIO(_tar(reg("pre/victim", b"pwned\n"))), dest)
    # A file at the entry's name (here a hard link to the outside file) is
    # replaced, never written through.
    os.link(outside, dest / "f")
    extract_tar(io.BytesIO(_tar(reg("f", b"new"))), dest)
    assert (dest / "f").read_bytes() == b"new"
    _untouched(outside)
    assert os.readlink(dest / "pre") == str(outside.parent)


def test_a_tar_bomb_is_refused_by_its_header_before_any_byte_is_written(
    tmp_path: Path,
) -> None:
    info = tarfile.TarInfo("bomb")
    info.size = 64 * 1024**3
    header = info.tobuf(tarfile.PAX_FORMAT)
    extractor = TarExtractor(tmp_path / "dest", max_bytes=1024**3)
    with pytest.raises(errors.FileTooLarge, match=r"more than 1073741824 bytes .*'bomb'"):
        extractor.feed(header)
    extractor.abort()
    assert not (tmp_path / "dest").exists()


def test_byte_and_entry_caps(tmp_path: Path) -> None:
    archive = _tar(reg("a", b"x" * 600), reg("b", b"x" * 600))
    with pytest.raises(errors.FileTooLarge, match="more than 1000 bytes"):
        extract_tar(io.BytesIO(archive), tmp_path / "one", max_bytes=1000)
    assert not (tmp_path / "one").exists()
    many = _tar(*[reg(f"f{i}", b"") for i in range(11)])
    with pytest.raises(errors.FileTooLarge, match="more than 10 entries"):
        extract_tar(io.BytesIO(many), tmp_path / "two", max_entries=10)
    assert not (tmp_path / "two").exists()
    assert extract_tar(io.BytesIO(many), tmp_path / "three", max_entries=11).entries == 11


def test_pax_headers_cannot_make_us_buffer(tmp_path: Path) -> None:
    info = tarfile.TarInfo("x" * 10)
    info.pax_headers = {"comment": "y" * (2 * 1024 * 1024)}
    archive = _tar(lambda tar: tar.addfile(info))
    with pytest.raises(errors.UnsafeArchive, match="extended header"):
        extract_tar(io.BytesIO(archive), tmp_path / "dest")


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_an_honest_archive_round_trips_without_privileged_modes(fmt: int, tmp_path: Path) -> None:
    deep = "/".join(["sub"] * 3) if fmt == tarfile.USTAR_FORMAT else "n" * 150 + "/" + "m" * 120
    archive = _tar(
        d("bin", 0o2775),
        reg("bin/tool", b"#!/bin/sh\n", 0o4777),
        reg("bin/sticky", b"", 0o1666),
        reg(f"{deep}/leaf.txt", b"leaf"),
        sym("bin/up", "../bin/tool"),
        sym("dangling", "nowhere/../x"),
        hard("bin/again", "bin/tool"),
        d("ro", 0o555),
        reg("ro/inside", b"r"),
        fmt=fmt,
    )
    dest = tmp_path / "dest"
    result = extract_tar(io.BytesIO(archive), dest)
    assert result.bytes == len(b"#!/bin/sh\n") + 4 + 1
    assert (dest / deep / "leaf.txt").read_bytes() == b"leaf"
    assert (dest / "bin" / "up").read_bytes() == b"#!/bin/sh\n"
    assert os.readlink(dest / "dangling") == "nowhere/../x"
    assert (dest / "bin" / "again").stat().st_ino == (dest / "bin" / "tool").stat().st_ino
    assert stat.S_IMODE((dest / "bin" / "tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "bin" / "sticky").stat().st_mode) == 0o644
    assert stat.S_IMODE((dest / "bin").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "ro").stat().st_mode) == 0o755 & 0o555 | 0o700


def test_a_truncated_or_garbled_stream_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    archive = _tar(reg("a", b"x" * 2000))
    with pytest.raises(errors.DaemonError, match="ended before"):
        extract_tar(io.BytesIO(archive[:1500]), tmp_path / "cut")
    assert not (tmp_path / "cut").exists()
    with pytest.raises(errors.UnsafeArchive, match="not a tar stream"):
        extract_tar(io.BytesIO(b"garbage!" * 200), tmp_path / "junk")
    assert not (tmp_path / "junk").exists()


def test_fed_in_odd_pieces(tmp_path: Path) -> None:
    archive = _tar(reg("a", b"x" * 1000), d("b"), reg("b/c", b"y" * 513))
    extractor = TarExtractor(tmp_path / "dest")
    for start in range(0, len(archive), 7):
        extractor.feed(archive[start : start + 7])
    assert extractor.close().entries == 3
    assert (tmp_path / "dest" / "b" / "c").read_bytes() == b"y" * 513
