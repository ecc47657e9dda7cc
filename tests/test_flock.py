"""`sandman._flock`: a caller cancelled while its lock is being taken leaves it free."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import pytest

from sandman import _flock
from tests.support import eventually, until

pytestmark = pytest.mark.anyio


def free(path: Path) -> bool:
    """Whether a third open of ``path`` can take its lock now."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


async def test_the_lock_is_held_until_its_descriptor_closes(tmp_path: Path) -> None:
    path = tmp_path / "a" / "lock"
    fd = await _flock.lock(path, parent_mode=0o700)
    assert not free(path)
    os.close(fd)
    assert free(path)
    assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o644)


async def test_shared_locks_share(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    first = await _flock.lock(path, fcntl.LOCK_SH)
    second = await asyncio.wait_for(_flock.lock(path, fcntl.LOCK_SH), 10)
    os.close(first)
    os.close(second)
    assert free(path)


@pytest.mark.parametrize("when", ["while waiting", "as it is taken"])
async def test_a_caller_cancelled_while_the_lock_is_taken_leaves_it_free(
    tmp_path: Path, when: str
) -> None:
    """asyncio.run ends by cancelling every task: the taker's too. Cancelled while the
    thread waits, or just as it got the lock, the lock must not stay held by a descriptor
    nobody has (the next taker in this process would wait for ever)."""
    path = tmp_path / "lock"
    holder = _flock.lock_file(path)
    taker = asyncio.ensure_future(_flock.lock(path))
    await asyncio.sleep(0.05)  # the thread waits for the lock
    if when == "as it is taken":
        os.close(holder)
        # Without yielding to the loop (the taker cannot resume): the thread has it.
        until("the thread to take the lock", lambda: not free(path), 10)
    taker.cancel()  # a native cancellation, as asyncio.run's
    with pytest.raises(asyncio.CancelledError):
        await taker
    if when == "while waiting":
        os.close(holder)
    await eventually(lambda: free(path))
    fd = await asyncio.wait_for(_flock.lock(path), 10)
    os.close(fd)


async def test_a_path_that_cannot_be_opened_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await _flock.lock(tmp_path / "missing" / "lock")
