"""Joining untrusted paths onto a root directory without ever leaving it.

Tar member names and symlink targets inside an image are paths *in the
container*. Resolving them on the host must treat the rootfs as ``/`` (chroot
semantics, like Go's ``securejoin``): ``..`` stops at the root and an absolute
symlink target starts again at the root, never at the host's ``/``.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from sandman.errors import ImageError

__all__ = ["clean_name", "secure_join"]

MAX_SYMLINKS = 255
"""Symlinks followed while resolving one path (Linux stops at 40; a loop must end somewhere)."""


def clean_name(name: str) -> str:
    """Normalise a tar member name to a relative path inside the rootfs, as docker does.

    Leading ``/`` and ``./`` are stripped (``/etc/passwd`` is the image's
    ``/etc/passwd``); the result is ``"."`` for the root itself. A name whose
    ``..`` climbs above the root raises `ImageError`.
    """
    if "\x00" in name:
        raise ImageError(f"tar entry name {name!r} contains a NUL byte")
    stripped = name.lstrip("/")
    cleaned = posixpath.normpath(stripped) if stripped else "."
    if cleaned == ".." or cleaned.startswith("../"):
        raise ImageError(f"tar entry {name!r} points outside the root filesystem")
    return cleaned


def secure_join(root: Path, unsafe: str) -> Path:
    """Return ``root/unsafe`` with every symlink on the way resolved inside `root`.

    Missing components are appended as they are (the caller may create them).
    The result is always `root` or below it, and its existing components are
    real directories, never symlinks. Raises `ImageError` on a symlink loop.
    """
    pending = list(reversed(unsafe.split("/")))
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            # Chroot semantics: ".." at the root is the root.
            if done:
                done.pop()
            continue
        candidate = os.path.join(root, *done, part)
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            done.append(part)
            continue
        if not stat.S_ISLNK(mode):
            done.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            raise ImageError(f"too many levels of symbolic links resolving {unsafe!r}")
        target = os.readlink(candidate)
        if target.startswith("/"):
            done = []
        pending.extend(reversed(target.split("/")))
    return root.joinpath(*done)
