"""Telling at once when a local sandbox's daemon dies, and why.

The daemon is the container's init: when it exits, the kernel kills everything
else in the sandbox. A pidfd of it, watched by the event loop, tells of the
exit as it happens. Why it died comes from what the exit left behind:

- its wait status: from the pidfd once the process is reaped (Linux 6.15+,
  ``PIDFD_GET_INFO`` with ``PIDFD_INFO_EXIT``), or from ``/proc/<pid>/stat``
  while it is a zombie (older kernels, if read before the reaper gets to it);
- the OOM kills its memory cgroup counted (``oom_kill`` in cgroup v1's
  ``memory.oom_control``, v2's ``memory.events``), read before the cgroup is
  removed;
- the last lines of its log: a Go crash (``panic:``, ``fatal error:``) or
  the signal it shut down on.

`classify` turns that evidence into a reason (`sandman.SandboxLost.REASONS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandman.providers.base import Lost, LostReports
from sandman.providers.losses import LossFeed

__all__ = ["ExitWatch", "classify", "in_cgroup", "log_tail", "oom_kills", "wait_status"]

logger = logging.getLogger(__name__)

_CGROUP_ROOT = Path("/sys/fs/cgroup")
# struct pidfd_info (include/uapi/linux/pidfd.h): its first 64 bytes (PIDFD_INFO_SIZE_VER0),
# mask at 0, exit_code at 60; PIDFD_GET_INFO is _IOWR(0xFF, 11, struct pidfd_info).
_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3
_LOG_TAIL = 4096
_CRASH_MARKS = ("panic: ", "fatal error: ")
_SHUTDOWN = ", shutting down"  # sandmand: "got terminated, shutting down"

Evidence = Callable[[str, int | None], Lost]
"""Builds the report of one sandbox from its wait status (None: not known)."""


@dataclass
class _Watched:
    pid: int
    pidfd: int
    started: int | None  # /proc/<pid>/stat's starttime: tells the zombie from a reused pid
    loop: asyncio.AbstractEventLoop


class ExitWatch:
    """Watches each sandbox's daemon by a pidfd; reports its death through `reports`.

    ``evidence`` reads what else the death left (cgroup, log); it is called in a
    thread, before the sandbox can be deleted by whoever reads the report.
    """

    def __init__(self, evidence: Evidence) -> None:
        self._evidence = evidence
        self._watched: dict[str, _Watched] = {}
        self._feed = LossFeed()
        self._tasks: set[asyncio.Task[None]] = set()

    def reports(self) -> LostReports:
        return self._feed.reader()

    def watch(self, sandbox_id: str, pid: int, member: Callable[[int], bool]) -> None:
        """Watch ``pid``, the daemon of ``sandbox_id``, on the running loop.

        ``member(pid)`` says whether the process now is in the sandbox's cgroup:
        a process that is not (the pid was reused) means the daemon is gone.
        """
        if sandbox_id in self._watched:
            return
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._lost(sandbox_id, None)  # already gone, and reaped
            return
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM):
                logger.debug("no pidfd for %s (%s): reconcile will notice", sandbox_id, exc)
                return
            raise
        try:
            watched = _Watched(pid, pidfd, _start_time(pid), loop)
            reused = not _exited(pidfd) and not member(pid)
        except BaseException:
            os.close(pidfd)
            raise
        if reused:
            os.close(pidfd)
            self._lost(sandbox_id, None)  # the pid is another process's now
            return
        self._watched[sandbox_id] = watched
        loop.add_reader(pidfd, self._on_exit, sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """Stop watching (before a delete kills the daemon: that is no loss)."""
        watched = self._watched.pop(sandbox_id, None)
        if watched is not None:
            _unwatch(watched)

    def close(self) -> None:
        """Stop watching everything; end the readers."""
        for sandbox_id in list(self._watched):
            self.forget(sandbox_id)
        for task in self._tasks:
            task.cancel()
        self._feed.close()

    def _on_exit(self, sandbox_id: str) -> None:
        watched = self._watched.pop(sandbox_id, None)
        if watched is None:
            return
        # At once: a zombie's status is gone when the reaper (the host's init) gets to it.
        status = wait_status(watched.pidfd, watched.pid, watched.started)
        _unwatch(watched)
        self._lost(sandbox_id, status)

    def _lost(self, sandbox_id: str, status: int | None) -> None:
        task = asyncio.get_running_loop().create_task(self._report(sandbox_id, status))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, sandbox_id: str, status: int | None) -> None:
        try:
            lost = await asyncio.to_thread(self._evidence, sandbox_id, status)
        except Exception:  # the loss is told even if its evidence is not
            logger.warning("cannot tell why %s was lost", sandbox_id, exc_info=True)
            lost = Lost(sandbox_id=sandbox_id, reason="unknown", detail="its daemon is gone")
        logger.info("sandbox %s lost (%s): %s", sandbox_id, lost.reason, lost.detail)
        self._feed.report(lost)


def _unwatch(watched: _Watched) -> None:
    if not watched.loop.is_closed():
        watched.loop.remove_reader(watched.pidfd)
    os.close(watched.pidfd)


def _exited(pidfd: int) -> bool:
    # poll, not select: a pool holds a pidfd per sandbox, and select takes no
    # descriptor past 1023 (FD_SETSIZE): every sandbox past ~1000 went unwatched.
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field (state) on; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def wait_status(pidfd: int, pid: int, started: int | None) -> int | None:
    """The exited process's wait status (as ``waitpid`` gives it), or None if unknown."""
    info = bytearray(_INFO_SIZE)
    struct.pack_into("Q", info, 0, _PIDFD_INFO_EXIT)
    with contextlib.suppress(OSError):
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info, True)
        if struct.unpack_from("Q", info, 0)[0] & _PIDFD_INFO_EXIT:
            return int(struct.unpack_from("i", info, 60)[0])
    fields = _stat_fields(pid)
    # Field 52 (exit_code, Linux 3.5+) of a zombie that is still our process.
    if fields is None or len(fields) < 50 or fields[0] != "Z":
        return None
    if started is not None and int(fields[19]) != started:
        return None
    return int(fields[49])


def in_cgroup(pid: int, path: str) -> bool:
    """Whether process ``pid`` is in cgroup ``path`` (a sandbox's) of some hierarchy."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return any(line.rstrip().endswith(f"/{path}") for line in text.splitlines())


def oom_kills(parent: str, sandbox_id: str) -> int:
    """How many processes the OOM killer killed in the sandbox's memory cgroup."""
    for path, prefix in (
        (_CGROUP_ROOT / "memory" / parent / sandbox_id / "memory.oom_control", "oom_kill "),
        (_CGROUP_ROOT / parent / sandbox_id / "memory.events", "oom_kill "),
    ):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(prefix):
                return int(line[len(prefix) :])
    return 0


def log_tail(path: Path) -> str:
    """The last few KiB of the daemon's log (empty if there is none)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def classify(status: int | None, oom: int, log: str) -> tuple[str, str]:
    """Why a daemon died: a reason (`sandman.SandboxLost.REASONS`) and a sentence.

    ``status`` is its wait status (None: unknown), ``oom`` the OOM kills its
    memory cgroup counted, ``log`` the end of its log.
    """
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    crash = next((line for line in lines if line.startswith(_CRASH_MARKS)), None)
    shutdown = next((line for line in reversed(lines) if line.endswith(_SHUTDOWN)), None)
    if status is not None and os.WIFSIGNALED(status):
        name = _signal_name(os.WTERMSIG(status))
        if os.WTERMSIG(status) == signal.SIGKILL and oom:
            return "oom", f"the OOM killer killed the daemon ({oom} OOM kills in the sandbox)"
        return "killed", f"the daemon was killed by {name}"
    if status is not None and os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        if shutdown is not None:
            return "killed", f"the daemon was stopped by a signal ({shutdown!r})"
        said = f": {crash or lines[-1]!r}" if lines else ""
        if oom and crash is not None and "out of memory" in crash:
            return "oom", f"the daemon ran out of memory{said}"
        return "daemon_exit", f"the daemon exited with status {code}{said}"
    # No status: what the sandbox and the log say.
    if oom:
        return "oom", f"the daemon is gone and the sandbox counted {oom} OOM kills"
    if crash is not None:
        return "daemon_exit", f"the daemon crashed: {crash!r}"
    if shutdown is not None:
        return "killed", f"the daemon was stopped by a signal ({shutdown!r})"
    # A daemon that ends by itself always says why; a SIGKILL leaves no word.
    return "killed", "the daemon is gone without a word (as after a SIGKILL)"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
