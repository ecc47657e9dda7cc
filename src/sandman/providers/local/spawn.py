"""Run a command from the event loop without blocking it and without threads.

asyncio's subprocesses fork (not vfork) as soon as a ``preexec_fn`` is given,
read the child's exec status with a blocking read, and on Python 3.11 start a
thread per child to wait for it. At a few hundred runtime calls a second
that is most of the provider's cost. Here: ``posix_spawn`` (vfork + exec),
a pidfd watched by the event loop for the exit, pipes read as they fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Completed", "run"]


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: bytes
    stderr: bytes


async def _read_all(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            chunks.append(data)
        elif not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return b"".join(chunks)


async def _wait(pid: int) -> int:
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited: asyncio.Future[None] = loop.create_future()

    def gone() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, gone)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    # The pidfd said it exited: this waitpid returns at once.
    _, status = os.waitpid(pid, 0)  # noqa: ASYNC222
    return os.waitstatus_to_exitcode(status)


async def run(
    argv: Sequence[str],
    *,
    log: Path | None = None,
    timeout: float,
    pass_fds: Sequence[int] = (),
    stdin: bytes | None = None,
) -> Completed:
    """Run ``argv``; stdout and stderr are captured, or both appended to ``log``.

    ``stdin`` is what the child reads (else ``/dev/null``). ``pass_fds``
    become the child's descriptors 3, 4, ... in that order (the caller keeps
    and closes its own). The child is killed (SIGKILL) and reaped if
    ``timeout`` passes or the caller is cancelled; TimeoutError is raised in
    the first case.
    """
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = []
    readers: list[int] = []
    closers: list[int] = []
    if stdin is None:
        actions.append((os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0))
    else:
        # A memory file, not a pipe: written whole now, it never blocks either side.
        memory = os.memfd_create("sandman-stdin", os.MFD_CLOEXEC)
        closers.append(memory)
        os.write(memory, stdin)
        os.lseek(memory, 0, os.SEEK_SET)
        actions.append((os.POSIX_SPAWN_DUP2, memory, 0))
    for target, fd in enumerate(pass_fds, start=3):
        # Copied above every target first, so that no dup2 overwrites a
        # descriptor another one still has to be copied from.
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(pass_fds))
        closers.append(high)
        actions.append((os.POSIX_SPAWN_DUP2, high, target))
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        closers.append(fd)
        actions += [(os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, fd, 2)]
    else:
        for target in (1, 2):
            read_end, write_end = os.pipe()  # both close-on-exec; dup2 clears it on the copy
            readers.append(read_end)
            closers.append(write_end)
            actions.append((os.POSIX_SPAWN_DUP2, write_end, target))
    try:
        # vfork + exec: blocks only until the child has exec'd; measured
        # cheaper inline than a hop to a worker thread.
        pid = os.posix_spawnp(argv[0], list(argv), os.environ, file_actions=actions)  # noqa: ASYNC221
    except BaseException:
        for fd in readers:
            os.close(fd)
        raise
    finally:
        for fd in closers:
            os.close(fd)
    waiting = asyncio.ensure_future(_wait(pid))
    reading = [asyncio.ensure_future(_read_all(fd)) for fd in readers]
    try:
        async with asyncio.timeout(timeout):
            returncode = await asyncio.shield(waiting)
            outputs = [await r for r in reading]
    except BaseException:
        # Timed out or cancelled: the child must not outlive the call.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await asyncio.shield(asyncio.gather(waiting, *reading, return_exceptions=True))
        raise
    stdout, stderr = outputs if outputs else (b"", b"")
    return Completed(returncode, stdout, stderr)
