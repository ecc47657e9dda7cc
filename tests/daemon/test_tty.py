"""Background processes on a pseudo-terminal: isatty, size, resize, no descriptor left."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.daemon import DaemonClient
from tests.daemon.running import RunningDaemon

pytestmark = pytest.mark.anyio


def _pty_fds(pid: int) -> int:
    """How many of ``pid``'s descriptors are on a pseudo-terminal (either side)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        count += target == "/dev/ptmx" or target.startswith("/dev/pts/")
    return count


class _Terminal:
    """Reads a tty process's output on from where the last read stopped."""

    def __init__(self, client: DaemonClient, process_id: str) -> None:
        self.client, self.id = client, process_id
        self.seen = ""
        self._offset = 0

    async def until(self, text: str) -> str:
        """Everything seen so far, once ``text`` is in the part not yet consumed."""
        start = len(self.seen)
        with anyio.fail_after(10):
            while text not in self.seen[start:]:
                out = await self.client.read_output(self.id, stdout_offset=self._offset, wait=1)
                self.seen += out.stdout
                self._offset = out.stdout_next_offset
                assert out.running or text in self.seen[start:], self.seen
        return self.seen


async def test_shell_on_a_terminal(daemon: RunningDaemon) -> None:
    pid = daemon.process.pid
    before = _pty_fds(pid)
    async with daemon.client() as client:
        proc = await client.spawn(
            ["/bin/sh", "-i"], env={"PS1": "$ ", "ENV": ""}, tty=True, rows=30, cols=100
        )
        assert proc.tty and proc.stdin_open and proc.running
        assert _pty_fds(pid) > before
        term = _Terminal(client, proc.id)
        await term.until("$ ")
        await client.write_stdin(proc.id, "test -t 0 && test -t 1 && test -t 2 && echo all-tty\n")
        await term.until("all-tty\r\n")
        await client.write_stdin(proc.id, "stty size\n")
        await term.until("30 100\r\n")
        # The foreground group hears of the resize (SIGWINCH), and the size sticks.
        await client.write_stdin(proc.id, "trap 'echo winched' WINCH\n")
        await term.until("$ ")
        await client.resize(proc.id, rows=40, cols=120)
        await client.write_stdin(proc.id, "stty size\n")
        await term.until("40 120\r\n")
        assert "winched" in term.seen
        await client.write_stdin(proc.id, "exit 3\n")
        done = await client.wait(proc.id, timeout=10)
        assert (done.running, done.exit_code, done.stdin_open) == (False, 3, False)
        out = await client.read_output(proc.id)
        assert out.stderr == "" and "exit 3" in out.stdout  # the terminal's echo
        with anyio.fail_after(10):
            while _pty_fds(pid) != before:
                await anyio.sleep(0.01)
        await client.kill(proc.id)


async def test_killing_a_terminal_process_frees_its_terminal(daemon: RunningDaemon) -> None:
    pid = daemon.process.pid
    before = _pty_fds(pid)
    async with daemon.client() as client:
        procs = [await client.spawn("sleep 1000 & echo up; wait", tty=True) for _ in range(3)]
        for proc in procs:
            await _Terminal(client, proc.id).until("up")
        for proc in procs:
            await client.kill(proc.id)
        with anyio.fail_after(10):
            while _pty_fds(pid) != before:
                await anyio.sleep(0.01)
        assert await client.list_processes() == []


async def test_terminal_mistakes_are_clear(daemon: RunningDaemon) -> None:
    async with daemon.client() as client:
        with pytest.raises(sandman.ConfigError, match="need tty"):
            await client.spawn(["true"], rows=10)
        plain = await client.spawn(["sleep", "1000"])
        assert not plain.tty
        with pytest.raises(sandman.InvalidRequest) as caught:
            await client.resize(plain.id, rows=10, cols=10)
        assert caught.value.code == "not_a_tty"
        term = await client.spawn(["cat"], tty=True)
        with pytest.raises(sandman.InvalidRequest, match="rows must be 1..65535"):
            await client.resize(term.id, rows=0, cols=10)
        for proc in (plain, term):
            await client.kill(proc.id)
