"""Turning the image's ``User`` setting into numeric ids, from the rootfs's own files."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from sandman.errors import ImageError
from sandman.images.merged import MergedView
from sandman.images.paths import secure_join

__all__ = ["resolve_user"]

MAX_DB_SIZE = 16 << 20


def resolve_user(rootfs: Path | Sequence[Path], user: str) -> tuple[int, int]:
    """Return ``(uid, gid)`` for `user` as the image config spells it.

    `rootfs` is one directory (`Image.rootfs`) or the image's layers, topmost
    first (`Image.lowers`): files are then found as overlayfs would merge them.

    ``""`` is root. ``"uid"`` takes its gid from the passwd entry for that uid,
    or 0 when there is none (docker does the same). ``"uid:gid"`` needs no
    lookup; names are looked up in the rootfs's ``/etc/passwd`` and
    ``/etc/group`` (never the host's). An unknown name raises `ImageError`.
    """
    name, _, group = user.partition(":")
    if not name:
        if group:
            raise ImageError(f"invalid user {user!r}: the user part is empty")
        return 0, 0
    passwd = _read_db(rootfs, "etc/passwd")
    if name.isdigit():
        uid = int(name)
        entry = next((e for e in passwd if len(e) > 3 and e[2] == name), None)
        gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    else:
        entry = next((e for e in passwd if len(e) > 3 and e[0] == name), None)
        if entry is None or not entry[2].isdigit() or not entry[3].isdigit():
            raise ImageError(f"user {name!r} is not in the image's /etc/passwd")
        uid, gid = int(entry[2]), int(entry[3])
    if not group:
        return uid, gid
    if group.isdigit():
        return uid, int(group)
    groups = _read_db(rootfs, "etc/group")
    found = next((e for e in groups if len(e) > 2 and e[0] == group), None)
    if found is None or not found[2].isdigit():
        raise ImageError(f"group {group!r} is not in the image's /etc/group")
    return uid, int(found[2])


def _read_db(rootfs: Path | Sequence[Path], name: str) -> list[list[str]]:
    """The colon-separated entries of a rootfs file; [] when the file is missing.

    The path is resolved inside the rootfs, and only a regular file is read:
    the image controls it, and a fifo or ``/dev/zero`` must not hang us.
    """
    if isinstance(rootfs, Path):
        path = secure_join(rootfs, name)
    else:
        found = MergedView(rootfs).find(name)
        if found is None:
            return []
        path = found
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ImageError(f"cannot read the image's /{name}: {exc}") from exc
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageError(f"the image's /{name} is not a regular file")
        text = file.read(MAX_DB_SIZE).decode("utf-8", "replace")
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]
