"""The provider's command runner (`spawn.run`): output, stdin, deadlines, and no hang when
asyncio.run ends with commands in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandman.providers.local import spawn

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[3]


async def test_output_exit_code_and_stdin() -> None:
    done = await spawn.run(["sh", "-c", "cat; echo err >&2; exit 3"], timeout=10, stdin=b"in\n")
    assert (done.returncode, done.stdout, done.stderr) == (3, b"in\n", b"err\n")


async def test_stdin_larger_than_a_pipe_is_read_whole() -> None:
    data = os.urandom(1 << 20)  # 16 pipe buffers: a pipe written first would block
    done = await spawn.run(["wc", "-c"], timeout=10, stdin=data)
    assert done.stdout.split() == [str(len(data)).encode()]


async def test_without_stdin_the_command_reads_nothing() -> None:
    done = await spawn.run(["cat"], timeout=10)
    assert (done.returncode, done.stdout) == (0, b"")


async def test_a_missing_command_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        await spawn.run(["sandman-no-such-command"], timeout=10)


async def test_past_its_deadline_the_command_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(TimeoutError):
        await spawn.run(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"], timeout=0.5)
    pid = int(pid_file.read_text())
    with pytest.raises(ChildProcessError):  # killed and reaped: no zombie left
        os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: it never blocks)
    assert not Path(f"/proc/{pid}").exists()


def test_commands_in_flight_when_asyncio_run_ends_do_not_hang_the_exit() -> None:
    """asyncio.run cancels every task left when its main one returns, asyncio's own
    included: its subprocesses cut off while connecting their pipes never finished. The
    network manager's commands run through `spawn.run` for that reason."""
    script = textwrap.dedent("""\
        import asyncio
        from sandman.providers.local import network

        async def main():
            for _ in range(20):
                asyncio.ensure_future(network._run("sh", "-c", "cat", stdin="x"))
            await asyncio.sleep(0)

        for _ in range(20):
            asyncio.run(main())
        print("done")
        """)
    ran = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=60,  # the hang this guards against is for ever
        check=False,
    )
    assert (ran.returncode, ran.stdout) == (0, "done\n"), ran.stderr
