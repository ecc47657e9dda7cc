"""A sandbox's changed files as one tar stream, both ways (``/v1/changes``): the host's
calls for snapshots where it cannot reach a sandbox's writable layer (Kubernetes).

`download_changes` reads what the sandbox changed since its daemon started into a file
on the host; `apply_changes` sends such a file to the daemon of a new sandbox of the
same image. Not a sandbox's vocabulary (`DaemonClient`): only the provider makes them.

The stream comes from inside a sandbox, so it is hostile. It is never unpacked on the
host: `ChangesChecker` parses it (the few tar forms the daemon writes, and nothing
else) and writes a stream of its own, header by header, from the fields it checked.
So what a later daemon applies is exactly what was checked here, whatever the tar
reader on either side would have made of an odd header. What it refuses
(`UnsafeArchive`, and nothing of the file is kept):

- a name that is absolute, holds NUL or a ``..`` component, or is longer than PATH_MAX;
- a name under ``proc``, ``sys``, ``dev`` or ``.sandman`` (the runtime's and the
  daemon's, never the sandbox's files), but the ``.sandman/prune`` listings;
- devices, fifos, sparse files, GNU long-name headers, any global header but the one
  that carries the daemon's own failure (`DaemonError`, code ``changes_failed``);
- a hard link to anything but a regular file sent before it; a name sent twice;
- a listing whose names are not single path components, or of unknown kinds;
- more than ``max_bytes`` of bodies or ``max_entries`` entries (`FileTooLarge`);
- a stream that ends before its end-of-archive marker (`DaemonError`).

Symlinks are kept as they are, absolute targets too: they are applied inside a sandbox,
whose root is the whole tree, by a daemon that never writes through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sandman import errors
from sandman.daemon.client import _MAX_ERROR, DaemonClient, _map_transport_errors, _read_capped
from sandman.daemon.untar import _number, _parse_pax, _parts

__all__ = [
    "CHANGES",
    "PRUNE",
    "AppliedChanges",
    "ChangesChecker",
    "ChangesSummary",
    "apply_changes",
    "download_changes",
]

CHANGES = "/v1/changes"
PRUNE = ".sandman/prune"
"""The name of a changed directory's listing in the stream (daemon/PROTOCOL.md)."""

_BLOCK = 512
_END = bytes(2 * _BLOCK)
_PIECE = 1024 * 1024
# One PAX header: a long name, a long link target and a few numbers.
_MAX_META = 1024 * 1024
# One listing: the daemon's own bound (archive/prune.go).
_MAX_LISTING = 64 * 1024 * 1024
_PATH_MAX = 4096
_NAME_MAX = 255
_NOT_FILES = frozenset({"proc", "sys", "dev", ".sandman"})
_KINDS = frozenset(b"dflo")
_REGULAR = frozenset(b"07\0")
_DIRECTORY, _SYMLINK, _HARDLINK = ord("5"), ord("2"), ord("1")
_PAX_MTIME = re.compile(r"^\d{1,12}(\.\d{1,9})?$")
_ID_LIMIT = 2**32
_ERROR_RECORD = "SANDMAN.error"

# Parser states.
_HEADER, _META, _DATA, _LISTING, _SKIP, _DONE = range(6)


@dataclass(frozen=True, slots=True)
class ChangesSummary:
    """What a checked stream held: entries (listings included), file bytes, listings."""

    entries: int
    bytes: int
    listings: int


@dataclass(frozen=True, slots=True)
class AppliedChanges:
    """What a daemon applied: files written, their bytes, names removed by listings."""

    files: int
    bytes: int
    removed: int


def _unsafe(message: str) -> errors.UnsafeArchive:
    return errors.UnsafeArchive(message)


class ChangesChecker:
    """Checks a stream of changes fed in pieces and writes its own, canonical copy to
    ``sink``; see the module docstring. ``feed`` the bytes as they arrive, then
    ``close()``. After an exception, what went to ``sink`` is to be thrown away."""

    def __init__(
        self, sink: BinaryIO, *, max_bytes: int, max_entries: int, source: str = "the stream"
    ) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise errors.ConfigError("max_bytes and max_entries must not be negative")
        self._sink = sink
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._source = source
        self._state = _HEADER
        self._head = bytearray()
        self._meta = bytearray()
        self._meta_global = False
        self._pax: dict[str, str] = {}
        self._need = 0
        self._pad = 0
        self._listing = bytearray()
        self._listing_info = tarfile.TarInfo()
        self._file_size = 0
        self._seen: set[tuple[str, ...]] = set()
        self._files: set[tuple[str, ...]] = set()
        self._entries = 0
        self._bytes = 0
        self._file_bytes = 0
        self._listings = 0

    @property
    def done(self) -> bool:
        """Whether the end-of-archive marker was seen (later bytes are ignored)."""
        return self._state == _DONE

    def feed(self, data: bytes) -> None:
        """Consume the next piece of the stream."""
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end and self._state != _DONE:
            take = min(self._need, end - pos) if self._state != _HEADER else 0
            if self._state == _DATA:
                self._sink.write(view[pos : pos + take])
            elif self._state == _META:
                self._meta += view[pos : pos + take]
            elif self._state == _LISTING:
                self._listing += view[pos : pos + take]
            elif self._state == _HEADER:
                take = min(_BLOCK - len(self._head), end - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) == _BLOCK:
                    block = bytes(self._head)
                    self._head.clear()
                    self._header(block)
                continue
            pos += take
            self._need -= take
            if self._need == 0:
                self._finish()

    def close(self) -> ChangesSummary:
        """Check the stream ended with its marker; end the copy with one."""
        if self._state != _DONE:
            raise errors.DaemonError(
                f"{self._source} ended before its end-of-archive marker (cut short)",
                code="invalid_archive",
            )
        return ChangesSummary(self._entries, self._file_bytes, self._listings)

    # -- the tar format --------------------------------------------------------------

    def _finish(self) -> None:
        state = self._state
        if state == _META:
            self._finish_meta()
        elif state == _LISTING:
            self._finish_listing()
        elif state == _DATA:
            self._sink.write(bytes(-self._file_size % _BLOCK))
            self._skip(self._pad)
        else:  # _SKIP
            self._state = _HEADER

    def _skip(self, count: int) -> None:
        self._need = count
        self._state = _SKIP if count else _HEADER

    def _header(self, block: bytes) -> None:
        if block == bytes(_BLOCK):
            self._sink.write(_END)
            self._state = _DONE
            return
        try:
            stored = _number(block[148:156], "checksum")
        except errors.UnsafeArchive:
            stored = -1
        blank = block[:148] + b" " * 8 + block[156:]
        if stored not in (sum(blank), sum(b - 256 if b > 127 else b for b in blank)):
            raise _unsafe(f"{self._source} is not a tar stream (bad header checksum)")
        kind = block[156]
        size = _number(block[124:136], "size")
        if kind in (ord("x"), ord("g")):
            if self._pax and kind == ord("x"):
                raise _unsafe(f"{self._source}: two extended headers before one entry")
            if size > _MAX_META:
                raise _unsafe(f"a tar extended header of {size} bytes (at most {_MAX_META})")
            self._meta_global = kind == ord("g")
            self._meta.clear()
            self._need, self._pad, self._state = size, -size % _BLOCK, _META
            if size == 0:
                self._finish_meta()
            return
        if kind in (ord("L"), ord("K")):
            raise _unsafe(f"{self._source} has GNU long-name headers (the daemon writes PAX)")
        pax, self._pax = self._pax, {}
        if any(key.startswith("GNU.sparse.") for key in pax):
            raise _unsafe(f"{self._source} has a sparse file")
        name = os.fsdecode(block[0:100].split(b"\0", 1)[0])
        if block[257:263] == b"ustar\0":
            prefix = os.fsdecode(block[345:500].split(b"\0", 1)[0])
            if prefix:
                name = f"{prefix}/{name}"
        name = pax.get("path", name)
        link = pax.get("linkpath", os.fsdecode(block[157:257].split(b"\0", 1)[0]))
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise _unsafe(f"entry {name!r} has a bad PAX size") from None
        if size < 0:
            raise _unsafe(f"entry {name!r} has a negative size")
        self._entries += 1
        if self._entries > self._max_entries:
            raise errors.FileTooLarge(
                f"{self._source} has more than {self._max_entries} entries (the snapshot's limit)"
            )
        if self._bytes + size > self._max_bytes:
            raise errors.FileTooLarge(
                f"{self._source} holds more than {self._max_bytes} bytes "
                f"(at {name!r}; the snapshot's limit, KubernetesConfig.snapshot_max_bytes)"
            )
        self._bytes += size
        info = tarfile.TarInfo()
        info.mode = _number(block[100:108], "mode") & 0o7777
        info.uid = self._id(pax.get("uid"), block[108:116], "uid", name)
        info.gid = self._id(pax.get("gid"), block[116:124], "gid", name)
        info.mtime = min(max(_number(block[136:148], "mtime"), 0), 2**33)
        info.uname = info.gname = ""
        mtime = pax.get("mtime")
        if mtime is not None and _PAX_MTIME.match(mtime):
            info.pax_headers = {"mtime": mtime}  # to the nanosecond
            info.mtime = int(mtime.split(".")[0])
        parts = tuple(_parts(name, "entry name"))
        if parts == (".sandman", "prune") and kind in _REGULAR:
            self._start_listing(info, size)
            return
        if parts and parts[0] in _NOT_FILES:
            raise _unsafe(
                f"entry {name!r} is under /{parts[0]}: the runtime's or the daemon's, "
                "not the sandbox's files"
            )
        if parts in self._seen and parts:
            raise _unsafe(f"entry {name!r} is sent twice")
        self._seen.add(parts)
        info.name = "/".join(parts) if parts else "."
        if kind in _REGULAR:
            if not parts:
                raise _unsafe("a file entry without a name")
            self._files.add(parts)
            info.type, info.size = tarfile.REGTYPE, size
            self._emit(info)
            self._file_size = size
            self._file_bytes += size
            self._need, self._pad, self._state = size, -size % _BLOCK, _DATA
            if size == 0:
                self._finish()
            return
        if kind == _DIRECTORY:
            info.type = tarfile.DIRTYPE
        elif kind == _SYMLINK:
            if not parts or not link or "\0" in link or len(link) > _PATH_MAX:
                raise _unsafe(f"symlink {name!r} has a bad name or target")
            info.type, info.linkname = tarfile.SYMTYPE, link
        elif kind == _HARDLINK:
            target = tuple(_parts(link, "hard link target"))
            if not parts or target not in self._files:
                raise _unsafe(
                    f"hard link {name!r} -> {link!r}: only a file sent before it may be linked"
                )
            info.type, info.linkname = tarfile.LNKTYPE, "/".join(target)
        else:
            raise _unsafe(f"entry {name!r} has a type the daemon does not send ({chr(kind)!r})")
        self._emit(info)
        self._skip(size + (-size % _BLOCK))

    def _id(self, given: str | None, field: bytes, what: str, name: str) -> int:
        try:
            value = int(given) if given is not None else _number(field, what)
        except ValueError:
            raise _unsafe(f"entry {name!r} has a bad {what}") from None
        if not 0 <= value < _ID_LIMIT:
            raise _unsafe(f"entry {name!r} has {what} {value}")
        return value

    def _emit(self, info: tarfile.TarInfo) -> None:
        self._sink.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))

    def _finish_meta(self) -> None:
        records = _parse_pax(bytes(self._meta))
        self._meta.clear()
        if self._meta_global:
            if _ERROR_RECORD in records:
                raise errors.DaemonError(
                    f"{self._source}: the daemon failed: {records[_ERROR_RECORD][:1000]}",
                    code="changes_failed",
                )
            raise _unsafe(f"{self._source} has a global header (the daemon writes none)")
        self._pax = records
        self._skip(self._pad)

    # -- listings --------------------------------------------------------------------

    def _start_listing(self, info: tarfile.TarInfo, size: int) -> None:
        if size > _MAX_LISTING:
            raise _unsafe(f"a directory listing of {size} bytes (at most {_MAX_LISTING})")
        self._listing = bytearray()
        self._listing_info = info
        self._need, self._pad, self._state = size, -size % _BLOCK, _LISTING
        if size == 0:
            self._finish_listing()

    def _finish_listing(self) -> None:
        body = bytes(self._listing)
        self._listing = bytearray()
        fields = body.split(b"\0")
        if len(fields) < 2 or fields[-1] != b"":
            raise _unsafe("a directory listing does not end with NUL")
        directory = _parts(os.fsdecode(fields[0]), "listed directory")
        if directory and directory[0] in _NOT_FILES:
            raise _unsafe(f"a listing of /{'/'.join(directory)}: not the sandbox's files")
        for field in fields[1:-1]:
            name = field[1:]
            if (
                len(field) < 2
                or field[0] not in _KINDS
                or len(name) > _NAME_MAX
                or name in (b".", b"..")
                or b"/" in name
            ):
                raise _unsafe(f"a listing of {fields[0]!r} names {field[:300]!r}")
        info = self._listing_info
        info.name, info.type, info.size = PRUNE, tarfile.REGTYPE, len(body)
        self._emit(info)
        self._sink.write(body + bytes(-len(body) % _BLOCK))
        self._listings += 1
        self._skip(self._pad)


async def download_changes(
    client: DaemonClient,
    dest: Path,
    *,
    max_bytes: int,
    max_entries: int,
    timeout: float,
    source: str = "the sandbox's changes",
) -> ChangesSummary:
    """Read what the sandbox changed since its daemon started, checked (`ChangesChecker`),
    into file ``dest`` (made; removed again on any error). More than ``timeout`` seconds
    in all: `SandboxTimeout`."""
    sink = await asyncio.to_thread(_create, dest)
    checker = ChangesChecker(sink, max_bytes=max_bytes, max_entries=max_entries, source=source)
    try:
        try:
            async with asyncio.timeout(timeout):
                await _read_changes(client, checker)
        except TimeoutError:
            raise errors.SandboxTimeout(
                f"{source} did not come within {timeout} s (KubernetesConfig.snapshot_timeout)"
            ) from None
        summary = checker.close()
        await asyncio.to_thread(_finish_file, sink)
    except BaseException:
        sink.close()
        with contextlib.suppress(OSError):
            os.unlink(dest)  # at once, even when cancelled: a small file's name
        raise
    return summary


def _create(dest: Path) -> BinaryIO:
    return dest.open("xb")


def _finish_file(sink: BinaryIO) -> None:
    sink.flush()
    os.fsync(sink.fileno())
    sink.close()


async def _read_changes(client: DaemonClient, checker: ChangesChecker) -> None:
    transport = client._transport  # the client's own connection, auth and peer checks
    with _map_transport_errors(client._address):
        async with transport.stream("GET", CHANGES) as response:
            if response.status >= 400:
                raise client._error(response.status, await _read_capped(response, _MAX_ERROR))
            batch: list[bytes] = []
            size = 0
            async for piece in response.iter_bytes():
                batch.append(piece)
                size += len(piece)
                if size >= _PIECE:
                    await asyncio.to_thread(checker.feed, b"".join(batch))
                    batch, size = [], 0
                    if checker.done:
                        return  # what follows the end marker is not read
            if batch:
                await asyncio.to_thread(checker.feed, b"".join(batch))


async def apply_changes(client: DaemonClient, source: Path, *, timeout: float) -> AppliedChanges:
    """Send the checked changes in file ``source`` to the daemon, which applies them
    under its root. More than ``timeout`` seconds: `SandboxTimeout`."""
    try:
        async with asyncio.timeout(timeout):
            with _map_transport_errors(client._address):
                async with client._transport.stream(
                    "PUT", CHANGES, body=_pieces(source), content_type="application/x-tar"
                ) as response:
                    body = await _read_capped(response, _MAX_ERROR)
    except TimeoutError:
        raise errors.SandboxTimeout(
            f"applying {source.name} took more than {timeout} s (KubernetesConfig.snapshot_timeout)"
        ) from None
    if response.status >= 400:
        raise client._error(response.status, body)
    try:
        answer = json.loads(body)
        return AppliedChanges(int(answer["files"]), int(answer["bytes"]), int(answer["removed"]))
    except (ValueError, KeyError, TypeError):
        raise errors.DaemonError(
            f"sandmand at {client._address} answered PUT {CHANGES} with {body[:200]!r}"
        ) from None


async def _pieces(path: Path) -> AsyncIterator[bytes]:
    handle = await asyncio.to_thread(path.open, "rb")
    try:
        while piece := await asyncio.to_thread(handle.read, _PIECE):
            yield piece
    finally:
        handle.close()
