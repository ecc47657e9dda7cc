"""Removing a directory tree a sandbox made, whatever its shape.

Root in a sandbox (with ``disk=None`` its files sit in its own directory) can make a
tree ``shutil.rmtree`` cannot remove: rmtree recurses once per level, so a chain of
a few thousand directories ends in `RecursionError`; and a walk that keeps a
descriptor per level runs out of descriptors on a deep enough one. `remove_tree`
keeps one descriptor, of the directory it is in: it goes down by name
(``O_NOFOLLOW``: never through a symlink) and back up by ``..``, checking at each
step up that the directory it arrives in holds the one it left, and it never goes
above the depth it came down. Memory and descriptors are constant in the depth;
names longer than ``PATH_MAX`` together are no matter (every call is relative to
a descriptor). It never crosses into another filesystem (a mount point).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = ["remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int) -> int:
    """``name`` in ``dir_fd``, a directory and not a symlink. One the workload made
    unreadable (mode 000) is made ours first; root on the host reads it anyway
    unless it runs without CAP_DAC_OVERRIDE."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        path_fd = os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
        finally:
            os.close(path_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _next_subdir(fd: int) -> str | None:
    """Unlink every non-directory in ``fd``; the name of a directory left in it, or None
    when it is empty. Entries another remover took first are skipped."""
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not is_dir:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
                continue
            return entry.name
    return None


def remove_tree(directory: Path) -> None:
    """Remove ``directory`` and everything under it, without following a symlink or
    leaving its filesystem; fine if it (or any part) is gone already, as when another
    remover works on it at the same time. Raises OSError otherwise."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        top = os.fstat(fd)
        depth = 0
        while True:
            name = _next_subdir(fd)
            if name is not None:
                try:
                    child = _open_dir(name, fd)
                except FileNotFoundError:
                    continue  # removed by another remover since the scan
                info = os.fstat(child)
                if info.st_dev != top.st_dev:
                    os.close(child)
                    raise OSError(
                        errno.EXDEV, f"a mount point under {directory}, not removed", name
                    )
                os.close(fd)
                fd, depth = child, depth + 1
                continue
            if depth == 0:
                break
            # Empty: up one level, to remove it from there.
            try:
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return  # this directory was removed by another remover: it finishes
            try:
                name = _entry_of(parent, os.fstat(fd))
                gone = os.fstat(fd).st_nlink == 0  # removed by another remover meanwhile
            finally:
                os.close(fd)
            fd, depth = parent, depth - 1
            if (name is None and not gone) or _same(os.fstat(fd), top) != (depth == 0):
                raise OSError(
                    errno.ESTALE, f"{directory} changed while it was being removed", directory
                )
            if name is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(directory)


def _entry_of(fd: int, child: os.stat_result) -> str | None:
    """The name in directory ``fd`` of the directory ``child`` (by inode)."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.inode() == child.st_ino:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode):
                        return entry.name
    return None


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
