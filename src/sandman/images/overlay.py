"""overlayfs' on-disk conventions for stored layers, and the kernel's limits on stacking them.

A stored layer is a directory overlayfs can use as one lower layer as it is:

- a deleted path (OCI ``dir/.wh.name``) is a *whiteout*: a character device 0/0 at
  ``dir/name``;
- an emptied directory (OCI ``dir/.wh..wh..opq``) is *opaque*: it carries the xattr
  ``trusted.overlay.opaque=y`` (``user.overlay.opaque`` when we may not set trusted
  xattrs, i.e. not root; a ``userxattr`` mount reads that one).

Limits (Linux ``fs/overlayfs``): at most `OVL_MAX_STACK` = 500 lower layers (the
constant has been 500 since 4.x and still is in 6.x); and with ``mount(2)`` all mount
options, ``lowerdir=A:B:…`` included, must fit in one page (`MOUNT_DATA_MAX`,
4096 bytes on x86-64 and arm64 with 4 KiB pages). The page is the tighter limit:
with the default store's paths (``/var/lib/sandman/images/layers/<64 hex>``, 96
bytes) 42 layers fill it, 31 when 1 KiB is kept for ``upperdir=`` and ``workdir=``
(`MOUNT_DATA_RESERVE`, what `lowerdir_fits` keeps). The new mount API (``fsconfig(FSCONFIG_SET_STRING, "lowerdir+", …)``,
kernel ≥ 6.8) passes one layer per call and lifts the page limit, not the 500.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "MOUNT_DATA_MAX",
    "OVL_MAX_STACK",
    "is_opaque",
    "is_whiteout",
    "kept_xattr",
    "lowerdir_fits",
    "make_whiteout",
    "set_opaque",
]

OVL_MAX_STACK = 500
"""The most lower layers one overlayfs mount takes (``OVL_MAX_STACK`` in the kernel)."""

MOUNT_DATA_MAX = 4096
"""Bytes of ``mount(2)`` option data the kernel copies: one page."""

MOUNT_DATA_RESERVE = 1024
"""Left for ``upperdir=…,workdir=…`` and any other option beside ``lowerdir=``."""

OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")


def kept_xattr(name: str) -> bool:
    """Whether an image file's extended attribute `name` goes through import and export:
    file capabilities (``security.capability``) and ``user.*``, never overlayfs' own
    (``trusted.overlay.*``, ``user.overlay.*``: how a stored layer marks opaque
    directories) nor the host's labels (``security.selinux``…)."""
    if name.startswith(_OVERLAY_XATTRS):
        return False
    return name == "security.capability" or name.startswith("user.")


def is_whiteout(st: os.stat_result) -> bool:
    """Whether `st` (an lstat) is an overlayfs whiteout: a character device 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def make_whiteout(path: Path) -> None:
    """Create the whiteout `path` (nothing may be there). Unprivileged since Linux 5.8."""
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(0, 0))


def set_opaque(directory: Path) -> None:
    """Mark `directory` opaque: lower layers' entries under it are hidden."""
    for name in OPAQUE_XATTRS:
        try:
            os.setxattr(directory, name, b"y", follow_symlinks=False)
            return
        except PermissionError:
            continue
    raise PermissionError(errno.EPERM, "cannot set an overlay opaque xattr", str(directory))


def is_opaque(directory: Path) -> bool:
    """Whether `directory` carries an overlay opaque xattr."""
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(directory, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def lowerdir_fits(lowers: Sequence[Path], *, reserve: int = MOUNT_DATA_RESERVE) -> bool:
    """Whether `lowers` can be stacked by one ``mount(2)`` call: not too many layers, and
    ``lowerdir=`` (paths joined by ``:``) within a page less `reserve` bytes."""
    if not 0 < len(lowers) <= OVL_MAX_STACK:
        return False
    option = len("lowerdir=") + sum(len(os.fsencode(p)) + 1 for p in lowers)
    return option <= MOUNT_DATA_MAX - reserve
