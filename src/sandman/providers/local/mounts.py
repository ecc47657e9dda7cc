"""Mount the sandbox's overlay root in a private mount namespace.

The runtime's ``create`` is started in a fresh mount namespace where the
overlay is mounted; the container inherits it, and the mount disappears with
the container. Nothing is ever mounted on the host, so a crash of this
process can leak no mount.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["overlay_in_private_namespace"]

_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(step: str) -> None:
    err = ctypes.get_errno()
    # We are in the forked child before exec: report on stderr (the sandbox
    # log) and exit, since an exception cannot carry errno out of here.
    os.write(2, f"sandman: {step}: {os.strerror(err)}\n".encode())
    os._exit(125)


def overlay_in_private_namespace(
    lower: Path, upper: Path, work: Path, target: Path
) -> Callable[[], None]:
    """A ``preexec_fn`` that unshares the mount namespace and mounts the overlay at ``target``."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    target_b = os.fsencode(target)

    def preexec() -> None:
        if _libc.unshare(_CLONE_NEWNS) != 0:
            _fail("unshare(CLONE_NEWNS)")
        if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            _fail("make / private")
        if _libc.mount(b"overlay", target_b, b"overlay", 0, options) != 0:
            _fail(f"mount overlay on {target}")

    return preexec
