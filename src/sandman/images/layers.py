"""Applying layer tarballs, in order, onto one flattened root filesystem, safely.

Each layer is a tar stream (plain, gzip, bzip2 or xz; zstd is refused). Its
entries add, replace or, through whiteouts, delete paths of the layers below:

- ``dir/.wh.name`` deletes ``dir/name``; ``dir/.wh..wh..opq`` empties ``dir``
  of everything lower layers put there.
- A non-directory replaces whatever was at its path; a directory over a
  directory merges.
- Modes (setuid/setgid/sticky included), numeric ownership (when we are root)
  and mtimes are kept; device nodes need root and are skipped otherwise.
- Extended attributes (``SCHILY.xattr.*`` PAX records, as docker and buildah write
  them) are kept when they are file capabilities (``security.capability``, root only)
  or ``user.*`` (`sandman.images.overlay.kept_xattr`); overlayfs' own are never taken
  from a layer.

With ``lower`` (the layers below, as a `MergedView`), a layer is unpacked on its own,
as overlayfs stores it (see `sandman.images.overlay`): whiteouts become character
devices 0/0 and opaque markers an xattr instead of deleting anything; directories a
layer only implies take their mode and owner from below; symlinked directories of
the layers below are followed (chroot semantics) when naming a path; a hard link to
a file of a lower layer copies that file up first, as overlayfs would.

Security: nothing is ever written outside the root. Names with ``..`` that
climb out are refused; every parent directory is resolved *inside* the root
with chroot semantics (see `sandman.images.paths`), and the final component is
never followed: an existing symlink there is replaced, not written through.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import re
import shutil
import stat
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

from sandman.errors import ImageError
from sandman.images.compression import CORRUPT, decompressed
from sandman.images.digests import CHUNK, HashingReader, check_digest
from sandman.images.merged import MergedView
from sandman.images.overlay import is_whiteout, kept_xattr, make_whiteout, set_opaque
from sandman.images.paths import MAX_SYMLINKS, clean_name, secure_join

__all__ = ["apply_layer", "disk_usage", "rmtree"]

logger = logging.getLogger(__name__)

WHITEOUT_PREFIX = ".wh."
WHITEOUT_META_PREFIX = ".wh..wh."
WHITEOUT_OPAQUE = ".wh..wh..opq"
BLOCKSIZE = 512
XATTR_PAX_PREFIX = "SCHILY.xattr."
# Not fatal: a filesystem without (user) xattrs, or not root for security.capability.
_XATTR_UNSUPPORTED = (errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP)
_PAX_TIME = re.compile(r"(-?)(\d{1,12})(?:\.(\d{1,30}))?")


def apply_layer(
    root: Path,
    layer: BinaryIO,
    *,
    what: str,
    digest: str | None = None,
    diff_id: str | None = None,
    lower: MergedView | None = None,
) -> str:
    """Apply one layer onto `root`, checking its digests as it streams by.

    `layer` must be seekable (we sniff the compression). `digest` is the
    expected sha256 of the bytes as stored, `diff_id` of the uncompressed tar;
    `what` names the layer in error messages. With `lower`, `root` is an empty
    directory that becomes the layer in overlayfs' form, over those layers.
    Returns the diff id (the uncompressed tar's sha256). Any problem raises
    `ImageError`; the caller throws the half-applied root away.
    """
    head = layer.read(8)
    layer.seek(0)
    raw = HashingReader(layer)
    plain = HashingReader(decompressed(head, cast(BinaryIO, raw), what) or cast(BinaryIO, raw))
    try:
        with tarfile.open(
            fileobj=cast(Any, plain), mode="r|", encoding="utf-8", errors="surrogateescape"
        ) as tar:
            _Applier(root, what, lower).apply(tar, plain)
        plain.drain()
        raw.drain()
    except CORRUPT as exc:
        raise ImageError(f"{what} is corrupt or truncated: {exc}") from exc
    # A digest mismatch explains a "corrupt" tar better, but we only know it at
    # the end; the checks below run whenever the stream was read completely.
    check_digest(what, digest, raw.digest)
    check_digest(f"{what} (uncompressed)", diff_id, plain.digest)
    return plain.digest


class _Applier:
    """Applies the entries of one layer; state lives for that layer only."""

    def __init__(self, root: Path, what: str, lower: MergedView | None = None) -> None:
        self.root = root
        self.what = what
        self.lower = lower
        self.is_root = os.geteuid() == 0
        # Paths this layer wrote: an opaque whiteout keeps these and drops the rest.
        self.unpacked: set[Path] = set()
        # Directory metadata is set at the end: adding children changes mtimes.
        self.dirs: list[tuple[Path, tarfile.TarInfo]] = []
        # Resolved parent directories; any symlink or removal may change them.
        self.parents: dict[str, Path] = {}
        # Directories this layer made opaque (with `lower` only).
        self.opaque: set[Path] = set()

    def apply(self, tar: tarfile.TarFile, plain: HashingReader) -> None:
        while (member := tar.next()) is not None:
            # Stream mode keeps every member; a layer may have a million.
            tar.members.clear()  # type: ignore[attr-defined]
            try:
                self.entry(tar, member)
            except (ImageError, *CORRUPT):
                raise
            except (OSError, ValueError, OverflowError) as exc:
                raise ImageError(f"{self.what}: cannot unpack {member.name!r}: {exc}") from exc
        # tarfile treats a truncated or garbled header as the end of the archive;
        # a complete archive has (at least) its end-of-archive block after it.
        plain.drain()
        if plain.count < tar.offset + BLOCKSIZE:
            raise ImageError(f"{self.what} is truncated (no end-of-archive marker)")
        for path, member in self.dirs:
            if stat.S_ISDIR(_lstat_mode(path)):
                self.metadata(path, member)

    def entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = clean_name(member.name)
        if name == ".":
            # The root's own mode and owner are ours (0755 root): an image must
            # not make "/" unreadable for its non-root users.
            return
        parent_name, base = posixpath.split(name)
        if base.startswith(WHITEOUT_PREFIX):
            self.whiteout(parent_name, base)
            return
        path = self.parent(parent_name) / base
        self.mark_unpacked(path)
        existing = _lstat_mode(path)
        if member.isdir():
            if not stat.S_ISDIR(existing):
                self.remove(path)
                os.mkdir(path, 0o700)
                if self.lower is not None and stat.S_ISCHR(existing):
                    set_opaque(path)  # deleted, then made anew: nothing from below
                    self.opaque.add(path)
            self.dirs.append((path, member))
            return
        if member.islnk():
            # Resolve before removing: the link may name its own path.
            target = self.link_target(member.linkname)
            self.remove(path)
            # follow_symlinks=False: a hard link to a symlink links the symlink.
            os.link(target, path, follow_symlinks=False)
            return
        self.remove(path)
        if member.isreg():
            self.write_file(tar, member, path)
        elif member.issym():
            os.symlink(member.linkname, path)
            self.parents.clear()
        elif member.isfifo():
            os.mkfifo(path, 0o600)
        elif member.ischr() or member.isblk():
            kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
            if not self.is_root:
                logger.debug("%s: skipping device node %s (not root)", self.what, name)
                return
            try:
                os.mknod(path, 0o600 | kind, os.makedev(member.devmajor, member.devminor))
            except PermissionError:
                logger.debug("%s: skipping device node %s (not permitted)", self.what, name)
                return
        else:
            logger.debug("%s: skipping %s of unknown tar type %r", self.what, name, member.type)
            return
        self.metadata(path, member)

    def mark_unpacked(self, path: Path) -> None:
        # Parents count too: a layer need not list the directories it writes into.
        while path not in self.unpacked and path != self.root:
            self.unpacked.add(path)
            path = path.parent

    def parent(self, name: str) -> Path:
        """The directory `name` resolves to inside the root, created if missing."""
        cached = self.parents.get(name)
        if cached is not None:
            return cached
        resolved = self.join(name)
        current = self.root
        for part in resolved.relative_to(self.root).parts:
            current = current / part
            mode = _lstat_mode(current)
            if mode == 0:
                os.mkdir(current)
                # Explicit, not left to the umask: implicit parents are 0755 as in docker.
                os.chmod(current, 0o755)
                self.implied(current)
            elif not stat.S_ISDIR(mode):
                raise ImageError(f"{self.what}: /{name} is not a directory")
        self.parents[name] = resolved
        return resolved

    def join(self, name: str) -> Path:
        """`name` inside the root, symlinks on the way followed inside the image: this
        layer's, and with `lower` those of the layers below where this one has nothing."""
        if self.lower is None:
            return secure_join(self.root, name)
        pending = list(reversed(name.split("/")))
        done: list[str] = []
        links = 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            candidate = os.path.join(self.root, *done, part)
            target: str | None = None
            try:
                st = os.lstat(candidate)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(candidate)
            except (FileNotFoundError, NotADirectoryError):
                if self.lower_visible(done):
                    below = self.lower.find("/".join([*done, part]), follow_last=False)
                    if below is not None and below.is_symlink():
                        target = os.readlink(below)
            if target is None:
                done.append(part)
                continue
            links += 1
            if links > MAX_SYMLINKS:
                raise ImageError(f"too many levels of symbolic links resolving {name!r}")
            if target.startswith("/"):
                done = []
            pending.extend(reversed(target.split("/")))
        return self.root.joinpath(*done)

    def lower_visible(self, parts: list[str]) -> bool:
        """Whether the layers below show through at directory `parts` of this layer."""
        current = self.root
        for part in parts:
            current = current / part
            try:
                st = os.lstat(current)
            except (FileNotFoundError, NotADirectoryError):
                return True
            if not stat.S_ISDIR(st.st_mode) or current in self.opaque:
                return False
        return True

    def implied(self, path: Path) -> None:
        """A directory this layer names only as a parent: as it is below, else 0755 root."""
        if self.lower is None:
            return
        below = self.lower.find(str(path.relative_to(self.root)), follow_last=False)
        if below is None or not below.is_dir() or below.is_symlink():
            return
        st = os.lstat(below)
        info = tarfile.TarInfo(path.name)
        info.type, info.mode = tarfile.DIRTYPE, stat.S_IMODE(st.st_mode)
        info.uid, info.gid, info.mtime = st.st_uid, st.st_gid, int(st.st_mtime)
        self.dirs.append((path, info))

    def link_target(self, linkname: str) -> Path:
        name = clean_name(linkname)
        parent_name, base = posixpath.split(name)
        if name == "." or base in ("", "..") or base.startswith(WHITEOUT_PREFIX):
            raise ImageError(f"{self.what}: invalid hard link target {linkname!r}")
        target = self.join(parent_name) / base
        if self.lower is not None and _lstat_mode(target) == 0:
            self.copy_up(target)
        elif self.lower is not None and is_whiteout(os.lstat(target)):
            raise ImageError(f"{self.what}: hard link target {linkname!r} was deleted")
        mode = _lstat_mode(target)
        if mode == 0 or stat.S_ISDIR(mode):
            raise ImageError(
                f"{self.what}: hard link target {linkname!r} is missing or a directory"
            )
        return target

    def copy_up(self, target: Path) -> None:
        """Copy a lower layer's file (or symlink) to `target` in this layer, for a hard link."""
        assert self.lower is not None
        relative = str(target.relative_to(self.root))
        if not self.lower_visible(list(Path(relative).parts[:-1])):
            return
        below = self.lower.find(relative, follow_last=False)
        if below is None:
            return
        st = os.lstat(below)
        parent = self.parent(str(Path(relative).parent))
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(below), parent / target.name)
        elif stat.S_ISREG(st.st_mode):
            shutil.copyfile(below, parent / target.name, follow_symlinks=False)
        else:
            return
        if self.is_root:
            os.chown(parent / target.name, st.st_uid, st.st_gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(parent / target.name, stat.S_IMODE(st.st_mode))
        os.utime(parent / target.name, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)

    def whiteout(self, parent_name: str, base: str) -> None:
        if self.lower is not None:
            self.overlay_whiteout(parent_name, base)
            return
        parent = secure_join(self.root, parent_name)
        if base == WHITEOUT_OPAQUE:
            if stat.S_ISDIR(_lstat_mode(parent)):
                self.clear_lower(parent)
            return
        if base.startswith(WHITEOUT_META_PREFIX):
            # Other aufs metadata (.wh..wh.plnk, .wh..wh.aufs): not content.
            return
        victim = base.removeprefix(WHITEOUT_PREFIX)
        if victim in ("", ".", ".."):
            raise ImageError(f"{self.what}: invalid whiteout {base!r}")
        self.remove(parent / victim)

    def overlay_whiteout(self, parent_name: str, base: str) -> None:
        """A whiteout as overlayfs stores it: nothing below is touched, only marked hidden."""
        if base.startswith(WHITEOUT_META_PREFIX) and base != WHITEOUT_OPAQUE:
            return
        parent = self.parent(parent_name)
        if base == WHITEOUT_OPAQUE:
            set_opaque(parent)
            self.opaque.add(parent)
            return
        victim = base.removeprefix(WHITEOUT_PREFIX)
        if victim in ("", ".", ".."):
            raise ImageError(f"{self.what}: invalid whiteout {base!r}")
        path = parent / victim
        if path in self.unpacked:
            # Made by this very layer: it stays (whiteouts hide only what is below), and a
            # directory no longer shows what was below it.
            if stat.S_ISDIR(_lstat_mode(path)):
                set_opaque(path)
                self.opaque.add(path)
            return
        try:
            if is_whiteout(os.lstat(path)):
                return
        except FileNotFoundError:
            pass
        self.remove(path)
        make_whiteout(path)

    def clear_lower(self, directory: Path) -> None:
        with os.scandir(directory) as entries:
            children = list(entries)
        for child in children:
            path = Path(child.path)
            if path not in self.unpacked:
                self.remove(path)
            elif child.is_dir(follow_symlinks=False):
                self.clear_lower(path)

    def remove(self, path: Path) -> None:
        mode = _lstat_mode(path)
        if mode == 0:
            return
        if stat.S_ISDIR(mode):
            rmtree(path)
        else:
            os.unlink(path)
        self.parents.clear()

    def write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
        source = tar.extractfile(member)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path, flags, 0o600), "wb") as out:
            if source is not None:
                shutil.copyfileobj(source, out, CHUNK)

    def metadata(self, path: Path, member: tarfile.TarInfo) -> None:
        if self.is_root:
            # Before chmod: chown clears the setuid and setgid bits.
            os.chown(path, member.uid, member.gid, follow_symlinks=False)
        if not member.issym():
            os.chmod(path, member.mode & 0o7777)
            # After chown, which drops security.capability.
            self.xattrs(path, member)
        mtime = _mtime_ns(member)
        os.utime(path, ns=(mtime, mtime), follow_symlinks=False)

    def xattrs(self, path: Path, member: tarfile.TarInfo) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith(XATTR_PAX_PREFIX):
                continue
            name = key.removeprefix(XATTR_PAX_PREFIX)
            if not kept_xattr(name):
                logger.debug("%s: not keeping xattr %s of %s", self.what, name, member.name)
                continue
            # tarfile decodes PAX values with surrogateescape: this is the original bytes.
            data = value.encode("utf-8", "surrogateescape")
            try:
                os.setxattr(path, name, data, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _XATTR_UNSUPPORTED:
                    raise
                logger.debug("%s: cannot set xattr %s on %s: %s", self.what, name, member.name, exc)


def _mtime_ns(member: tarfile.TarInfo) -> int:
    """`member`'s mtime in nanoseconds: exact from a PAX record (tarfile's float is not)."""
    match = _PAX_TIME.fullmatch(member.pax_headers.get("mtime", ""))
    if match is None:
        return int(member.mtime * 1_000_000_000)
    sign, seconds, fraction = match.groups()
    nanos = int(seconds) * 1_000_000_000 + int((fraction or "")[:9].ljust(9, "0"))
    return -nanos if sign else nanos


def _lstat_mode(path: Path) -> int:
    """The st_mode of `path` itself, 0 when nothing is there."""
    try:
        return os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return 0


def rmtree(path: Path) -> None:
    """Remove a tree the image controls, even with read-only directories in it."""

    def retry(function: Callable[..., Any], failed: str, _exc: object) -> None:
        # A directory without write permission (non-root runs): open it up, retry.
        parent = os.path.dirname(failed)
        if parent and not os.path.islink(parent):
            os.chmod(parent, 0o700)
        function(failed)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def disk_usage(root: Path) -> int:
    """Bytes in the regular files under `root`, each hard-linked file counted once."""
    seen: set[int] = set()
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(directory, name))
            if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total
