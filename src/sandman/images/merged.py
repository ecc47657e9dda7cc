"""The merged view of stacked layers, as overlayfs shows it, without mounting anything.

`MergedView` finds a path in layers given topmost first, honouring whiteouts and
opaque directories and resolving symlinks with chroot semantics (an absolute link
or ``..`` never leaves the image). `flatten` writes the merged tree as one
directory of hard links to the layers' files: no file data is copied, only
directories are made (with the topmost layer's mode, owner and mtime).

A flattened tree shares inodes with the layers, so a file's link count is higher
than the image says; its content, mode and owner are the layers'. Treat it as
read-only, as every lower dir.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from sandman.errors import ImageError
from sandman.images.overlay import is_opaque, is_whiteout

__all__ = ["MergedView", "flatten"]

MAX_SYMLINKS = 40


class MergedView:
    """Look paths up in `lowers` (topmost first) as one overlayfs would merge them."""

    def __init__(self, lowers: Sequence[Path]) -> None:
        self.lowers = [Path(p) for p in lowers]

    def find(self, name: str, *, follow_last: bool = True) -> Path | None:
        """The real path (in one layer) of what `name` is in the merged view, symlinks
        followed inside the image (the last one only with `follow_last`); None when
        nothing is there."""
        found = self._walk(name, follow_last=follow_last)
        return found[0] if found is not None else None

    def dir_layers(self, name: str) -> list[Path]:
        """The directories that make up merged directory `name`, topmost first ([] when
        `name` is no directory)."""
        found = self._walk(name, follow_last=True)
        return found[1] if found is not None else []

    def _walk(self, name: str, *, follow_last: bool) -> tuple[Path, list[Path]] | None:
        if not self.lowers:
            return None
        pending = [p for p in name.split("/") if p and p != "."]
        pending.reverse()
        current: list[str] = []
        # The layer directories making up each directory on the way, root first.
        stack: list[list[Path]] = [self._root_layers()]
        links = 0
        found: tuple[Path, list[Path]] = (self.lowers[0], stack[0])
        while pending:
            part = pending.pop()
            if part == "..":
                if current:
                    current.pop()
                    stack.pop()
                found = (stack[-1][0], stack[-1])
                continue
            entry = self._entry(stack[-1], part)
            if entry is None:
                return None
            path, layers = entry
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) and (pending or follow_last):
                links += 1
                if links > MAX_SYMLINKS:
                    raise ImageError(f"too many levels of symbolic links at /{name}")
                target = os.readlink(path)
                if target.startswith("/"):
                    current, stack = [], stack[:1]
                parts = [p for p in target.split("/") if p and p != "."]
                pending.extend(reversed(parts))
                found = (stack[-1][0], stack[-1])
                continue
            if stat.S_ISDIR(mode):
                current.append(part)
                stack.append(layers)
                found = (path, layers)
                continue
            if pending:
                return None  # a non-directory in the middle
            found = (path, [])
        return found

    def _root_layers(self) -> list[Path]:
        layers = []
        for lower in self.lowers:
            layers.append(lower)
            if is_opaque(lower):
                break
        return layers

    def _entry(self, parents: list[Path], name: str) -> tuple[Path, list[Path]] | None:
        """What the merged directory made of `parents` holds as `name`: the topmost real
        path and, for a directory, the layers' directories."""
        top: Path | None = None
        dirs: list[Path] = []
        for parent in parents:
            path = parent / name
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if is_whiteout(st):
                break
            if not stat.S_ISDIR(st.st_mode):
                if top is None:
                    top = path
                break
            if top is None:
                top = path
            dirs.append(path)
            if is_opaque(path):
                break
        if top is None:
            return None
        return top, dirs


def flatten(lowers: Sequence[Path], target: Path) -> None:
    """Write the merged view of `lowers` (topmost first) at `target` (absent, on the same
    filesystem): new directories, hard links to every other entry; no whiteouts."""
    os.mkdir(target, 0o755)
    for layer in reversed(lowers):
        _merge(layer, target)
    os.chmod(target, 0o755)


def _merge(layer: Path, target: Path) -> None:
    # Depth first, directories' metadata set after their children (which change mtimes).
    pending: list[tuple[Path, Path, bool]] = [(layer, target, False)]
    while pending:
        source, destination, done = pending.pop()
        if done:
            _copy_metadata(source, destination)
            continue
        if source != layer:
            pending.append((source, destination, True))
        with os.scandir(source) as entries:
            children = list(entries)
        for child in children:
            path = Path(child.path)
            into = destination / child.name
            st = child.stat(follow_symlinks=False)
            existing = _lstat_mode(into)
            if is_whiteout(st):
                _remove(into, existing)
            elif stat.S_ISDIR(st.st_mode):
                if not stat.S_ISDIR(existing):
                    _remove(into, existing)
                    os.mkdir(into, 0o700)
                elif is_opaque(path):
                    _clear(into)
                pending.append((path, into, False))
            else:
                _remove(into, existing)
                os.link(path, into, follow_symlinks=False)


def _copy_metadata(source: Path, destination: Path) -> None:
    st = os.lstat(source)
    if os.geteuid() == 0:
        os.chown(destination, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(destination, stat.S_IMODE(st.st_mode))
    os.utime(destination, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _remove(path: Path, mode: int) -> None:
    if mode == 0:
        return
    if stat.S_ISDIR(mode):
        from sandman.images.layers import rmtree

        rmtree(path)
    else:
        os.unlink(path)


def _clear(directory: Path) -> None:
    with os.scandir(directory) as entries:
        children = list(entries)
    for child in children:
        _remove(Path(child.path), child.stat(follow_symlinks=False).st_mode)
