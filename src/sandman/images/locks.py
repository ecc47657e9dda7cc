"""Exclusive locks that hold across the tasks of this process and across processes."""

from __future__ import annotations

import fcntl
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from sandman import _flock

__all__ = ["StoreLock", "try_lock_file"]


class StoreLock:
    """One named lock of the store: an anyio lock (tasks) plus ``flock`` on a file (processes).

    Lock files are never deleted, so two processes always lock the same inode.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = anyio.Lock()

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the lock for the body of an ``async with``."""
        async with self._lock:
            fd = await _flock.lock(self.path)
            try:
                yield
            finally:
                os.close(fd)


def try_lock_file(path: Path) -> int | None:
    """Take the lock without waiting: the fd to close when done, or None if it is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
