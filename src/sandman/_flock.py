"""File locks (``flock``) taken from the event loop, which a cancelled caller never leaves held.

``flock`` blocks, so it is taken in a worker thread. A caller cancelled while
the thread waits (a timeout, a cancelled task, asyncio.run cancelling every
task as it ends) no longer waits for the thread, and whatever the thread then
gets is let go at once. Passing the descriptor back through an ordinary
``to_thread`` call lost it when the cancellation came first: the lock stayed
held by a descriptor nobody owned, and the next taker in this process waited
for ever (flock locks conflict between two opens of one file, in one process
too).
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import anyio.to_thread

__all__ = ["lock", "lock_file"]


def lock_file(
    path: Path, operation: int = fcntl.LOCK_EX, *, mode: int = 0o644, parent_mode: int | None = None
) -> int:
    """Open ``path`` (made if missing, its directory too with ``parent_mode`` if given) and
    ``flock`` it, waiting; the descriptor: close it to unlock."""
    if parent_mode is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=parent_mode)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, operation)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Handover:
    """The descriptor between the thread that locks and the caller that may have gone."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.fd: int | None = None
        self.abandoned = False

    def deliver(self, fd: int) -> int:
        with self.mutex:
            if self.abandoned:
                os.close(fd)
                return -1
            self.fd = fd
            return fd

    def abandon(self) -> None:
        with self.mutex:
            self.abandoned = True
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


async def lock(
    path: Path, operation: int = fcntl.LOCK_EX, *, mode: int = 0o644, parent_mode: int | None = None
) -> int:
    """`lock_file` in a worker thread: the descriptor, or the caller's cancellation with
    nothing left held."""
    handover = _Handover()

    def take() -> int:
        return handover.deliver(lock_file(path, operation, mode=mode, parent_mode=parent_mode))

    try:
        return await anyio.to_thread.run_sync(take, abandon_on_cancel=True)
    except BaseException:
        handover.abandon()
        raise
