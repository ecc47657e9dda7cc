"""Persistent shells: cd, variables and functions persist between runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandman
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_state_persists(client: DaemonClient, tmp_path: Path, shell: str) -> None:
    sh = await client.create_shell(shell=shell)
    assert sh.alive and sh.shell == shell
    await client.run_in_shell(sh.id, f"cd {tmp_path} && export A=1 && B=2", check=True)
    await client.run_in_shell(sh.id, "greet() { echo hello $1; }", check=True)
    result = await client.run_in_shell(sh.id, "pwd; echo $A $B; greet you")
    assert result.stdout == f"{tmp_path}\n1 2\nhello you\n"
    assert result.exit_code == 0 and result.alive
    await client.close_shell(sh.id)


async def test_output_without_newline_and_exit_code(client: DaemonClient) -> None:
    sh = await client.create_shell()
    result = await client.run_in_shell(sh.id, "printf 'no newline'; printf e >&2; false")
    assert (result.stdout, result.stderr, result.exit_code) == ("no newline", "e", 1)
    await client.close_shell(sh.id)


async def test_syntax_error_does_not_end_the_shell(client: DaemonClient) -> None:
    sh = await client.create_shell(shell="/bin/sh")
    result = await client.run_in_shell(sh.id, "if then fi (")
    assert result.exit_code != 0 and result.alive
    assert (await client.run_in_shell(sh.id, "echo ok")).stdout == "ok\n"
    await client.close_shell(sh.id)


async def test_stdin_is_not_the_shell_pipe(client: DaemonClient) -> None:
    sh = await client.create_shell()
    result = await client.run_in_shell(sh.id, "cat; echo after")
    assert result.stdout == "after\n"
    await client.close_shell(sh.id)


async def test_timeout_closes_the_shell(client: DaemonClient) -> None:
    sh = await client.create_shell()
    result = await client.run_in_shell(sh.id, "sleep 1000", timeout=0.3)
    assert result.timed_out and not result.alive
    with pytest.raises(sandman.ShellClosed):
        await client.run_in_shell(sh.id, "echo hi")
    assert not (await client.get_shell(sh.id)).alive
    await client.close_shell(sh.id)


async def test_exit_closes_the_shell(client: DaemonClient) -> None:
    sh = await client.create_shell()
    result = await client.run_in_shell(sh.id, "exit 7")
    assert (result.exit_code, result.alive) == (7, False)
    await client.close_shell(sh.id)


async def test_list_and_close(client: DaemonClient) -> None:
    sh = await client.create_shell()
    assert sh.id in [s.id for s in await client.list_shells()]
    await client.close_shell(sh.id)
    with pytest.raises(sandman.PathNotFound):
        await client.get_shell(sh.id)


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_merged_output_keeps_the_shell_state(client: DaemonClient, shell: str) -> None:
    sh = await client.create_shell(shell=shell)
    merged = await client.run_in_shell(
        sh.id, "cd /; X=1; echo out; echo err >&2; echo out2", merge_stderr=True
    )
    assert (merged.stdout, merged.stderr) == ("out\nerr\nout2\n", "")
    apart = await client.run_in_shell(sh.id, "echo $X $(pwd); echo err >&2")
    assert (apart.stdout, apart.stderr) == ("1 /\n", "err\n")
    await client.close_shell(sh.id)


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_timeout_can_interrupt_and_keep_the_shell(
    client: DaemonClient, tmp_path: Path, shell: str
) -> None:
    sh = await client.create_shell(shell=shell)
    await client.run_in_shell(sh.id, f"cd {tmp_path}; A=1", check=True)
    for command in ("B=2; echo before; sleep 1000; echo after", "while :; do sleep 0.05; done"):
        result = await client.run_in_shell(sh.id, command, timeout=0.3, on_timeout="interrupt")
        assert result.timed_out and result.alive and result.exit_code == 130
        assert "after" not in result.stdout
        with pytest.raises(sandman.ExecTimeout):
            await client.run_in_shell(
                sh.id, command, timeout=0.2, on_timeout="interrupt", check=True
            )
    after = await client.run_in_shell(sh.id, "echo $A $B; pwd", check=True)
    assert after.stdout == f"1 2\n{tmp_path}\n"
    # A command that ignores SIGINT: the shell is killed kill_grace later.
    stubborn = await client.run_in_shell(
        sh.id, "sh -c \"trap '' INT; sleep 1000\"", timeout=0.2, on_timeout="interrupt",
        kill_grace=0.2,
    )  # fmt: skip
    assert stubborn.timed_out and not stubborn.alive
    await client.close_shell(sh.id)


async def test_the_old_session_names_are_the_same_calls(client: DaemonClient) -> None:
    # Deprecated (CHANGELOG), kept working: the shells were called sessions.
    assert sandman.SessionClosed is sandman.ShellClosed
    assert sandman.SessionBusy is sandman.ShellBusy
    assert sandman.SessionInfo is sandman.ShellInfo
    assert sandman.SessionRunResult is sandman.ShellRunResult
    for face in (DaemonClient, sandman.AsyncSandbox, sandman.Sandbox):
        for old, new in [
            ("create_session", "create_shell"),
            ("list_sessions", "list_shells"),
            ("get_session", "get_shell"),
            ("run_in_session", "run_in_shell"),
            ("close_session", "close_shell"),
        ]:
            assert getattr(face, old) is getattr(face, new), (face, old)
    sh = await client.create_session()
    assert (await client.run_in_session(sh.id, "echo old")).stdout == "old\n"
    assert sh.id in [s.id for s in await client.list_sessions()]
    assert (await client.get_session(sh.id)).alive
    await client.close_session(sh.id)
    with pytest.raises(sandman.PathNotFound):
        await client.get_shell(sh.id)
