"""Background processes outlive the call that started them."""

from __future__ import annotations

import anyio
import pytest

import sandman
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio


async def _output_until(client: DaemonClient, pid: str, text: str) -> str:
    seen = ""
    offset = 0
    with anyio.fail_after(10):
        while text not in seen:
            out = await client.read_output(pid, stdout_offset=offset, wait=1)
            seen += out.stdout
            offset = out.stdout_next_offset
    return seen


async def test_process_persists_across_calls(client: DaemonClient) -> None:
    proc = await client.spawn("echo started; sleep 1000")
    assert proc.running
    assert "started\n" in await _output_until(client, proc.id, "started")
    assert (await client.poll(proc.id)).running
    assert proc.id in [p.id for p in await client.list_processes()]

    after = await client.signal(proc.id, "TERM")
    assert after.id == proc.id
    done = await client.wait(proc.id, timeout=10)
    assert not done.running
    assert (done.exit_code, done.signal) == (128 + 15, "TERM")
    await client.kill(proc.id)
    with pytest.raises(sandman.PathNotFound):
        await client.poll(proc.id)


async def test_stdin_pipe(client: DaemonClient) -> None:
    proc = await client.spawn(["cat"], stdin=True)
    await client.write_stdin(proc.id, "abc")
    await client.write_stdin(proc.id, b"def\n", close=True)
    done = await client.wait(proc.id, timeout=10)
    assert done.exit_code == 0
    out = await client.read_output(proc.id)
    assert out.stdout == "abcdef\n"
    with pytest.raises(sandman.StdinClosed):
        await client.write_stdin(proc.id, "more")


async def test_no_stdin_unless_asked(client: DaemonClient) -> None:
    proc = await client.spawn(["sleep", "1000"])
    with pytest.raises(sandman.StdinClosed):
        await client.write_stdin(proc.id, "x")
    await client.kill(proc.id)


async def test_wait_times_out_while_running(client: DaemonClient) -> None:
    proc = await client.spawn(["sleep", "1000"])
    assert (await client.wait(proc.id, timeout=0.1)).running
    await client.kill(proc.id)


async def test_missing_command_is_an_exited_127_process(client: DaemonClient) -> None:
    proc = await client.spawn(["no-such-command-xyz"])
    done = await client.wait(proc.id, timeout=10)
    assert done.exit_code == 127


async def test_offsets_read_on(client: DaemonClient) -> None:
    proc = await client.spawn("printf abc; printf def >&2")
    await client.wait(proc.id, timeout=10)
    first = await client.read_output(proc.id, stdout_offset=1, stderr_offset=2)
    assert (first.stdout, first.stderr) == ("bc", "f")
    assert (first.stdout_next_offset, first.stderr_next_offset) == (3, 3)
    assert not first.running and first.exit_code == 0


async def test_unknown_process(client: DaemonClient) -> None:
    with pytest.raises(sandman.PathNotFound):
        await client.poll("p-does-not-exist")


async def test_merged_output_of_a_background_process(client: DaemonClient) -> None:
    proc = await client.spawn("echo out; echo err >&2; echo out2", merge_stderr=True)
    await client.wait(proc.id, timeout=10)
    output = await client.read_output(proc.id)
    assert (output.stdout, output.stderr) == ("out\nerr\nout2\n", "")
