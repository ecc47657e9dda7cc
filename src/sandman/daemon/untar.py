"""Unpacking, on the host, a tar stream that a sandbox produced.

(About 600 lines, one piece: the parser and the descriptor-relative writer
are one defence; split, a path could pass between them unchecked.)

A sandbox is hostile: its daemon may answer a download with any bytes it
likes. `tarfile`'s ``filter="data"`` is not a defence to lean on: on the
Python versions this package supports, CVE-2025-4517 defeats it (a chain of
symlinks longer than PATH_MAX stops ``os.path.realpath`` resolving, the check
passes and the write lands outside the destination), and its header parser
backtracks badly on crafted PAX headers (CVE-2024-6232). So this module uses
neither: it parses the few tar formats it needs itself, and it never hands a
path to the kernel to resolve. Every entry is reached from the destination's
directory descriptor one component at a time with ``O_NOFOLLOW``, so no
symlink, whether from the archive or already on disk, is ever followed while
writing. What it does with each kind of entry:

- names must be relative, without NUL or a ``..`` component;
- regular files are created ``O_CREAT | O_EXCL | O_NOFOLLOW`` after removing
  whatever non-directory stood at their name; their mode loses the setuid,
  setgid and sticky bits and group/other write, and gains owner read/write;
- directories are created (an existing one is reused; a symlink or file at
  its name is refused);
- symlinks are created but never followed; a target must be relative and
  resolve inside the destination, following any chain of symlinks already in
  the tree as the kernel would; every symlink is checked again after the last
  entry, since a later entry can change what an earlier one resolves to;
- hard links may only name a regular file that this extraction created;
- devices, fifos, sparse files and unknown entry types are refused;
- the sum of file sizes and the number of entries are capped (`FileTooLarge`).

On any refusal, everything this extraction created is removed again; only a
file that an entry replaced stays replaced.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sandman import errors

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_UNPACKED",
    "TarExtractor",
    "UnpackResult",
    "extract_tar",
]

DEFAULT_MAX_UNPACKED = 4 * 1024**3
"""Default cap on the bytes of regular files one download may unpack."""
DEFAULT_MAX_ENTRIES = 200_000
"""Default cap on the entries (files, directories, links) of one download."""

_BLOCK = 512
# A PAX or GNU long-name header holds names and a few numbers; anything this
# size is an attempt to make us buffer.
_MAX_META = 1024 * 1024
_MAX_METAS = 4
# The kernel's own limits: longer names or link targets cannot be legitimate.
_PATH_MAX = 4096
# Components a symlink check may walk through (the kernel stops at 40 links;
# no honest tree needs this many steps).
_MAX_RESOLVE_STEPS = 4096
_MAX_LINKS = 40

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

# Parser states.
_HEADER = 0  # collecting a 512-byte header block
_META = 1  # collecting a PAX / GNU long-name body
_DATA = 2  # a regular file's bytes, written as they come
_SKIP = 3  # padding, or the body of an entry that has none on disk
_END = 4  # the end-of-archive block was seen

_REGULAR = frozenset(b"07\0")
_REFUSED_KINDS = {
    ord("3"): "a character device",
    ord("4"): "a block device",
    ord("6"): "a fifo",
    ord("S"): "a sparse file",
}


@dataclass(frozen=True, slots=True)
class UnpackResult:
    """What an extraction wrote: entries (of any kind) and the bytes of regular files."""

    entries: int
    bytes: int


def _unsafe(message: str) -> errors.UnsafeArchive:
    return errors.UnsafeArchive(message)


def _number(field: bytes, what: str) -> int:
    """A tar numeric field: octal text, or GNU base-256 when the high bit is set."""
    if field and field[0] & 0x80:
        if field[0] & 0x40:
            raise _unsafe(f"negative {what} in a tar header")
        value = field[0] & 0x3F
        for byte in field[1:]:
            value = value << 8 | byte
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise _unsafe(f"bad {what} {bytes(text)!r} in a tar header") from None


def _parse_pax(body: bytes) -> dict[str, str]:
    """PAX records: ``"<length> <key>=<value>\\n"`` each."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        space = body.find(b" ", pos, pos + 20)
        try:
            length = int(body[pos:space]) if space > pos else 0
        except ValueError:
            length = 0
        end = pos + length
        if length <= 0 or end > len(body) or body[end - 1 : end] != b"\n":
            raise _unsafe("malformed PAX header")
        key, sep, value = body[space + 1 : end - 1].partition(b"=")
        if not sep:
            raise _unsafe("malformed PAX record")
        records[key.decode("utf-8", "surrogateescape")] = os.fsdecode(value)
        pos = end
    return records


def _parts(name: str, what: str) -> list[str]:
    """The components of a relative archive name; refuses what could escape."""
    if "\0" in name:
        raise _unsafe(f"{what} {name!r} contains NUL")
    if len(name) > _PATH_MAX:
        raise _unsafe(f"{what} of {len(name)} characters is longer than PATH_MAX")
    if name.startswith("/"):
        raise _unsafe(f"{what} {name!r} is absolute")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _unsafe(f"{what} {name!r} has a '..' component")
    return parts


class TarExtractor:
    """Unpacks a tar stream fed in pieces under ``dest``; see the module docstring.

    ``feed`` the bytes as they arrive, then ``close()`` (which checks the
    archive ended properly and returns what was written). On any exception
    from either, or when the caller gives up, call ``abort()``: it removes
    what was created. ``source`` names the archive in error messages.
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_UNPACKED,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        source: str = "the archive",
    ) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise errors.ConfigError("max_bytes and max_entries must not be negative")
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._source = source
        self._dest = Path(dest)
        # The destination is the caller's choice: it is made and opened as
        # given (following symlinks in it); nothing below it is followed.
        self._made_dest: list[Path] = []
        missing = self._dest
        while not missing.exists() and not missing.is_symlink():
            self._made_dest.append(missing)
            missing = missing.parent
        self._dest.mkdir(parents=True, exist_ok=True)
        self._root = os.open(self._dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._state = _HEADER
        self._head = bytearray()
        self._meta = bytearray()
        self._meta_kind = 0
        self._metas = 0  # extended headers since the last entry
        self._need = 0
        self._pad = 0
        self._pax: dict[str, str] = {}
        self._long_name: str | None = None
        self._long_link: str | None = None
        self._fd: int | None = None  # the regular file being written
        self._fd_mtime = 0
        self._parent: tuple[tuple[str, ...], int] | None = None  # last parent opened
        self._created: list[tuple[str, ...]] = []
        self._dirs: list[tuple[tuple[str, ...], int]] = []  # created dirs and their modes
        self._files: dict[tuple[str, ...], tuple[int, int]] = {}  # (dev, ino) of files made
        self._links: list[tuple[tuple[str, ...], str]] = []
        self._entries = 0
        self._bytes = 0
        self._closed = False

    # -- feeding -----------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Consume the next piece of the stream (bytes after the end are ignored)."""
        view = memoryview(data)
        pos, end = 0, len(view)
        while pos < end and self._state != _END:
            state = self._state
            if state == _DATA:
                take = min(self._need, end - pos)
                self._write(view[pos : pos + take])
                pos += take
                self._need -= take
                if self._need == 0:
                    self._finish_file()
            elif state == _SKIP:
                take = min(self._need, end - pos)
                pos += take
                self._need -= take
                if self._need == 0:
                    self._state = _HEADER
            elif state == _META:
                take = min(self._need, end - pos)
                self._meta += view[pos : pos + take]
                pos += take
                self._need -= take
                if self._need == 0:
                    self._finish_meta()
            else:
                take = min(_BLOCK - len(self._head), end - pos)
                self._head += view[pos : pos + take]
                pos += take
                if len(self._head) == _BLOCK:
                    block = bytes(self._head)
                    self._head.clear()
                    self._header(block)

    @property
    def done(self) -> bool:
        """Whether the end-of-archive marker has been seen (later bytes are ignored)."""
        return self._state == _END

    def close(self) -> UnpackResult:
        """Check the archive ended and every symlink stays inside; set directory modes."""
        if self._state != _END:
            raise errors.DaemonError(
                f"{self._source} ended before its end-of-archive marker", code="invalid_archive"
            )
        for parts, target in self._links:
            if self._escapes(parts, target):
                raise _unsafe(
                    f"symlink {'/'.join(parts)!r} -> {target!r} resolves outside the "
                    "destination once the whole archive is unpacked"
                )
        # Deepest first, so a directory made read-only does not block its children.
        for parts, mode in sorted(self._dirs, key=lambda item: -len(item[0])):
            fd = self._open_dir(parts, create=False)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
        self._release()
        self._closed = True
        return UnpackResult(self._entries, self._bytes)

    def abort(self) -> None:
        """Remove everything this extraction created (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._drop_parent()
        for parts in reversed(self._created):
            try:
                fd = self._open_dir(parts[:-1], create=False)
            except (OSError, errors.SandboxError):
                continue
            try:
                if stat.S_ISDIR(os.stat(parts[-1], dir_fd=fd, follow_symlinks=False).st_mode):
                    os.rmdir(parts[-1], dir_fd=fd)
                else:
                    os.unlink(parts[-1], dir_fd=fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        os.close(self._root)
        for made in self._made_dest:
            try:
                made.rmdir()
            except OSError:
                break

    def _release(self) -> None:
        self._drop_parent()
        os.close(self._root)

    # -- the tar format ------------------------------------------------------------

    def _header(self, block: bytes) -> None:
        if block == bytes(_BLOCK):
            self._state = _END
            return
        try:
            stored = _number(block[148:156], "checksum")
        except errors.UnsafeArchive:
            stored = -1
        blank = block[:148] + b" " * 8 + block[156:]
        # Some writers sum signed bytes; accept either sum.
        if stored not in (sum(blank), sum(b - 256 if b > 127 else b for b in blank)):
            raise _unsafe(f"{self._source} is not a tar stream (bad header checksum)")
        kind = block[156]
        size = _number(block[124:136], "size")
        if kind in (ord("x"), ord("g"), ord("L"), ord("K")):
            self._metas += 1
            if self._metas > _MAX_METAS:
                raise _unsafe(f"more than {_MAX_METAS} extended headers before one entry")
            if size > _MAX_META:
                raise _unsafe(f"a tar extended header of {size} bytes (at most {_MAX_META})")
            self._meta_kind, self._need, self._pad = kind, size, -size % _BLOCK
            self._meta.clear()
            self._state = _META
            if size == 0:
                self._finish_meta()
            return
        name = os.fsdecode(block[0:100].split(b"\0", 1)[0])
        if block[257:263] == b"ustar\0":  # POSIX: a prefix field; GNU uses those bytes otherwise
            prefix = os.fsdecode(block[345:500].split(b"\0", 1)[0])
            if prefix:
                name = f"{prefix}/{name}"
        link = os.fsdecode(block[157:257].split(b"\0", 1)[0])
        pax, self._pax = self._pax, {}
        self._metas = 0
        if any(key.startswith("GNU.sparse.") for key in pax):
            raise _unsafe(f"entry {name!r} is a sparse file")
        name = pax.get("path", self._long_name if self._long_name is not None else name)
        link = pax.get("linkpath", self._long_link if self._long_link is not None else link)
        self._long_name = self._long_link = None
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise _unsafe(f"entry {name!r} has a bad PAX size") from None
        if size < 0:
            raise _unsafe(f"entry {name!r} has a negative size")
        mtime = _number(block[136:148], "mtime")
        mode = _number(block[100:108], "mode")
        self._entries += 1
        if self._entries > self._max_entries:
            raise errors.FileTooLarge(
                f"{self._source} has more than {self._max_entries} entries "
                "(raise max_entries to accept it)"
            )
        # Every body counts, not only files': skipped bytes cost time too.
        if self._bytes + size > self._max_bytes:
            raise errors.FileTooLarge(
                f"{self._source} holds more than {self._max_bytes} bytes of files "
                f"(at {name!r}; raise max_bytes to accept it)"
            )
        self._bytes += size
        self._pad = -size % _BLOCK
        if kind in _REGULAR:
            self._start_file(_parts(name, "entry name"), name, size, mode, mtime)
            return
        if kind == ord("5"):
            self._directory(_parts(name, "entry name"), name, mode)
        elif kind == ord("2"):
            self._symlink(_parts(name, "entry name"), name, link)
        elif kind == ord("1"):
            self._hardlink(_parts(name, "entry name"), name, link)
        elif kind in _REFUSED_KINDS:
            raise _unsafe(f"entry {name!r} is {_REFUSED_KINDS[kind]}")
        else:
            raise _unsafe(f"entry {name!r} has an unsupported type {chr(kind)!r}")
        self._skip(size + self._pad)

    def _skip(self, count: int) -> None:
        self._need = count
        self._state = _SKIP if count else _HEADER

    def _finish_meta(self) -> None:
        body = bytes(self._meta)
        self._meta.clear()
        if self._meta_kind == ord("x"):
            self._pax = _parse_pax(body)
        elif self._meta_kind == ord("L"):
            self._long_name = os.fsdecode(body.rstrip(b"\0"))
        elif self._meta_kind == ord("K"):
            self._long_link = os.fsdecode(body.rstrip(b"\0"))
        # "g" (global PAX) is ignored: nothing it may say matters here.
        self._skip(self._pad)

    # -- the entries ----------------------------------------------------------------

    def _start_file(self, parts: list[str], name: str, size: int, mode: int, mtime: int) -> None:
        if not parts:
            raise _unsafe(f"file entry {name!r} has no name")
        parent = self._parent_fd(parts)
        self._clear(parent, parts, name)
        fd = os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent)
        key = tuple(parts)
        self._created.append(key)
        self._fd = fd
        self._fd_mtime = mtime
        info = os.fstat(fd)
        self._files[key] = (info.st_dev, info.st_ino)
        # No setuid/setgid/sticky, no group/other write, and the owner may read and write.
        os.fchmod(fd, (mode & 0o755) | 0o600)
        self._need = size
        self._state = _DATA
        if size == 0:
            self._finish_file()

    def _write(self, piece: memoryview) -> None:
        assert self._fd is not None
        while piece:
            written = os.write(self._fd, piece)
            piece = piece[written:]

    def _finish_file(self) -> None:
        assert self._fd is not None
        fd, self._fd = self._fd, None
        try:
            mtime_ns = min(max(self._fd_mtime, 0), 2**33) * 1_000_000_000
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        self._skip(self._pad)

    def _directory(self, parts: list[str], name: str, mode: int) -> None:
        if not parts:
            return  # "./": the destination itself
        parent = self._parent_fd(parts)
        try:
            info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            os.mkdir(parts[-1], 0o700, dir_fd=parent)
            self._created.append(tuple(parts))
            self._dirs.append((tuple(parts), (mode & 0o755) | 0o700))
            return
        if stat.S_ISLNK(info.st_mode):
            raise _unsafe(f"directory entry {name!r} stands where a symlink is")
        if not stat.S_ISDIR(info.st_mode):
            raise errors.NotADirectory(f"entry {name!r}: a file stands where it names a directory")

    def _symlink(self, parts: list[str], name: str, target: str) -> None:
        if not parts:
            raise _unsafe(f"symlink entry {name!r} has no name")
        if not target or "\0" in target or len(target) > _PATH_MAX:
            raise _unsafe(f"symlink {name!r} has a bad target")
        if target.startswith("/"):
            raise _unsafe(f"symlink {name!r} has an absolute target {target!r}")
        if self._escapes(parts, target):
            raise _unsafe(f"symlink {name!r} -> {target!r} resolves outside the destination")
        parent = self._parent_fd(parts)
        self._clear(parent, parts, name)
        os.symlink(target, parts[-1], dir_fd=parent)
        self._created.append(tuple(parts))
        self._links.append((tuple(parts), target))

    def _hardlink(self, parts: list[str], name: str, target: str) -> None:
        if not parts:
            raise _unsafe(f"hard link entry {name!r} has no name")
        source = tuple(_parts(target, "hard link target"))
        known = self._files.get(source)
        if known is None:
            raise _unsafe(
                f"hard link {name!r} -> {target!r}: only files unpacked before it may be linked"
            )
        source_dir = self._open_dir(list(source[:-1]), create=False)
        try:
            info = os.stat(source[-1], dir_fd=source_dir, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != known:
                raise _unsafe(f"hard link {name!r}: {target!r} is no longer the file unpacked")
            parent = self._parent_fd(parts)
            self._clear(parent, parts, name)
            os.link(
                source[-1],
                parts[-1],
                src_dir_fd=source_dir,
                dst_dir_fd=parent,
                follow_symlinks=False,
            )
        finally:
            os.close(source_dir)
        self._created.append(tuple(parts))

    # -- walking the tree without following anything -------------------------------

    def _parent_fd(self, parts: Sequence[str]) -> int:
        """The (cached) directory holding ``parts[-1]``, made where missing."""
        key = tuple(parts[:-1])
        if self._parent is not None and self._parent[0] == key:
            return self._parent[1]
        self._drop_parent()
        fd = self._open_dir(key, create=True)
        self._parent = (key, fd)
        return fd

    def _drop_parent(self) -> None:
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None

    def _open_dir(self, parts: Sequence[str], *, create: bool) -> int:
        """A new descriptor of directory ``parts`` under the root, one component at a time."""
        fd = os.dup(self._root)
        try:
            for depth, part in enumerate(parts):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o700, dir_fd=fd)
                    made = tuple(parts[: depth + 1])
                    self._created.append(made)
                    self._dirs.append((made, 0o755))
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    shown = "/".join(parts[: depth + 1])
                    info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISLNK(info.st_mode):
                        raise _unsafe(
                            f"an entry would be written through symlink {shown!r}"
                        ) from None
                    raise errors.NotADirectory(f"{shown!r} is not a directory") from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _clear(self, parent: int, parts: Sequence[str], name: str) -> None:
        """Remove a non-directory at the entry's name: replaced, never written through."""
        try:
            info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            raise errors.IsADirectory(f"entry {name!r}: a directory stands at its name")
        os.unlink(parts[-1], dir_fd=parent)

    def _escapes(self, link: Sequence[str], target: str) -> bool:
        """Whether symlink ``link`` -> ``target`` resolves outside the root.

        Walks the target as the kernel would, reading each symlink met on the
        way from the tree as it is now (through descriptors, never by path).
        Components that do not exist are taken literally. A chain the kernel
        would give up on, or one too long to check, counts as escaping.
        """
        stack: list[str] = []
        fds: list[int | None] = []
        todo = deque(link[:-1])
        todo.extend(target.split("/"))
        links = steps = 0
        try:
            # The link's own directory is re-walked like any other path, so a
            # symlink among the link's parents (there is none) would be read too.
            while todo:
                steps += 1
                if steps > _MAX_RESOLVE_STEPS:
                    return True
                part = todo.popleft()
                if part in ("", "."):
                    continue
                if part == "..":
                    if not stack:
                        return True
                    stack.pop()
                    fd = fds.pop()
                    if fd is not None:
                        os.close(fd)
                    continue
                here = fds[-1] if fds else self._root
                body: str | None = None
                if here is not None:
                    try:
                        body = os.readlink(part, dir_fd=here)
                    except OSError:
                        body = None
                if body is not None:
                    links += 1
                    if links > _MAX_LINKS or body.startswith("/"):
                        return True
                    todo.extendleft(reversed(body.split("/")))
                    continue
                child: int | None = None
                if here is not None:
                    try:
                        child = os.open(part, _DIR_FLAGS, dir_fd=here)
                    except OSError:
                        child = None
                stack.append(part)
                fds.append(child)
            return False
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)


def extract_tar(
    source: BinaryIO,
    dest: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_UNPACKED,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    name: str = "the archive",
) -> UnpackResult:
    """Unpack the tar read from ``source`` under ``dest`` (blocking); see `TarExtractor`."""
    extractor = TarExtractor(dest, max_bytes=max_bytes, max_entries=max_entries, source=name)
    try:
        while piece := source.read(1024 * 1024):
            extractor.feed(piece)
            if extractor.done:
                break
        return extractor.close()
    except BaseException:
        extractor.abort()
        raise
