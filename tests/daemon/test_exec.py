"""Commands run to completion, streamed, with timeouts and output caps, over unix and TCP."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.daemon import DaemonClient
from tests.support import alive

pytestmark = pytest.mark.anyio


async def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while alive(pid):
            await anyio.sleep(0.01)


async def test_health(client: DaemonClient) -> None:
    health = await client.health()
    assert health.status == "ok"
    assert health.protocol == "v1"
    assert health.pid > 0


async def test_argv_and_shell_string(client: DaemonClient) -> None:
    result = await client.exec(["echo", "hello", "world"])
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello world\n", "")
    assert result.ok and not result.timed_out and not result.truncated

    result = await client.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok


async def test_cwd_env_and_stdin(client: DaemonClient, tmp_path: Path) -> None:
    result = await client.exec(
        "pwd; echo $GREETING; cat", cwd=str(tmp_path), env={"GREETING": "hi"}, stdin="from stdin"
    )
    assert result.stdout == f"{tmp_path}\nhi\nfrom stdin"


async def test_missing_cwd_is_not_found(client: DaemonClient, tmp_path: Path) -> None:
    with pytest.raises(sandman.PathNotFound):
        await client.exec(["true"], cwd=str(tmp_path / "nope"))


async def test_command_not_found_is_exit_127(client: DaemonClient) -> None:
    result = await client.exec(["no-such-command-xyz"])
    assert result.exit_code == 127
    assert "no-such-command-xyz" in result.stderr


async def test_not_executable_is_exit_126(client: DaemonClient, tmp_path: Path) -> None:
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = await client.exec([str(script)])
    assert result.exit_code == 126


async def test_check_raises_command_failed(client: DaemonClient) -> None:
    with pytest.raises(sandman.CommandFailed) as info:
        await client.exec("echo boom >&2; exit 4", check=True)
    assert info.value.exit_code == 4
    assert info.value.stderr == "boom\n"


async def test_output_over_cap_is_truncated(client: DaemonClient) -> None:
    result = await client.exec("head -c 3000000 /dev/zero | tr '\\0' a", max_output=1000)
    assert result.exit_code == 0
    assert result.truncated
    assert result.stdout == "a" * 1000


async def test_binary_output_as_base64(client: DaemonClient) -> None:
    result = await client.exec(["printf", "\\377\\000\\001"], encoding="base64")
    assert result.stdout_bytes == b"\xff\x00\x01"


async def test_signal_exit_code(client: DaemonClient) -> None:
    result = await client.exec("kill -KILL $$")
    assert (result.exit_code, result.signal) == (128 + 9, "KILL")


async def test_timeout_kills_the_whole_group_even_if_term_is_ignored(
    client: DaemonClient, tmp_path: Path
) -> None:
    pidfile = tmp_path / "grandchild.pid"
    started = time.monotonic()
    result = await client.exec(
        f"trap '' TERM; sh -c 'trap \"\" TERM; echo $$ > {pidfile}; sleep 1000' & wait",
        timeout=0.5,
        kill_grace=0.3,
    )
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.signal == "KILL"
    assert elapsed < 10
    await _wait_gone(int(pidfile.read_text()))


async def test_timed_out_with_check_raises_exec_timeout(client: DaemonClient) -> None:
    with pytest.raises(sandman.ExecTimeout):
        await client.exec(["sleep", "10"], timeout=0.2, kill_grace=0.1, check=True)


async def test_daemon_settings_are_not_inherited(client: DaemonClient) -> None:
    result = await client.exec(["env"])
    assert "SANDMAND" not in result.stdout
    assert "s3cret-token" not in result.stdout


async def test_stream_yields_output_as_it_happens(client: DaemonClient) -> None:
    async with client.exec_stream("echo one; echo two >&2; echo three; exit 5") as stream:
        events = [event async for event in stream]
    # The two pipes are read concurrently: order is kept within a stream only.
    assert "".join(e.data for e in events if e.event == "stdout") == "one\nthree\n"
    assert "".join(e.data for e in events if e.event == "stderr") == "two\n"
    assert [e.event for e in events].count("exit") == 1
    assert events[-1].event == "exit"
    assert events[-1].exit_code == 5


async def test_leaving_a_stream_early_kills_the_command(
    client: DaemonClient, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    async with client.exec_stream(f"echo $$ > {pidfile}; echo started; sleep 1000") as stream:
        async for event in stream:
            assert event.data == "started\n"
            break
    await _wait_gone(int(pidfile.read_text()))
    assert (await client.exec(["true"])).ok  # and the daemon lives on


async def test_concurrent_calls(client: DaemonClient) -> None:
    results: list[str] = []

    async def one(i: int) -> None:
        result = await client.exec(["echo", str(i)])
        results.append(result.stdout)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert sorted(results) == sorted(f"{i}\n" for i in range(20))


async def test_cancelled_call_leaves_the_client_usable(client: DaemonClient) -> None:
    with anyio.move_on_after(0.2):
        await client.exec(["sleep", "2"])
    assert (await client.exec(["echo", "after"])).stdout == "after\n"


async def test_merge_stderr_interleaves_both_outputs_in_stdout(client: DaemonClient) -> None:
    script = "echo out1; echo err1 >&2; echo out2; echo err2 >&2"
    result = await client.exec(script, merge_stderr=True)
    assert (result.stdout, result.stderr) == ("out1\nerr1\nout2\nerr2\n", "")
    async with client.exec_stream(script, merge_stderr=True) as stream:
        events = [event async for event in stream]
    assert {e.event for e in events} == {"stdout", "exit"}
    assert "".join(e.data for e in events if e.event == "stdout") == "out1\nerr1\nout2\nerr2\n"
    failed = await client.exec("echo why >&2; exit 3", merge_stderr=True)
    with pytest.raises(sandman.CommandFailed, match="why"):
        await client.exec("echo why >&2; exit 3", merge_stderr=True, check=True)
    assert (failed.exit_code, failed.stdout) == (3, "why\n")


async def test_binary_stdin_reaches_the_command_byte_for_byte(client: DaemonClient) -> None:
    payload = bytes(range(256)) * 3 + b"\xc3\x28\x00"
    result = await client.exec(["cat"], stdin=payload, encoding="base64")
    assert result.stdout_bytes == payload
    async with client.exec_stream(["wc", "-c"], stdin=payload) as stream:
        counted = "".join([e.data async for e in stream if e.event == "stdout"])
    assert int(counted) == len(payload)
    assert (await client.exec(["cat"], stdin="text stays text")).stdout == "text stays text"


async def test_cancelling_an_exec_kills_its_process_group(
    client: DaemonClient, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    script = f"sleep 1000 & echo $! > {pidfile}.child; echo $$ > {pidfile}; wait"

    async def wait_started() -> None:
        with anyio.fail_after(10):
            while not pidfile.exists() or not pidfile.read_text().endswith("\n"):
                await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(client.exec, script)
        await wait_started()
        tg.cancel_scope.cancel()
    # The shell and its background child (same process group) are gone.
    await _wait_gone(int(pidfile.read_text()))
    await _wait_gone(int(Path(f"{pidfile}.child").read_text()))
    assert (await client.exec(["true"])).ok
