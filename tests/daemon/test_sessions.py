"""Persistent shells: cd, variables and functions persist between runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import sandman
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_state_persists(client: DaemonClient, tmp_path: Path, shell: str) -> None:
    session = await client.create_session(shell=shell)
    assert session.alive and session.shell == shell
    await client.run_in_session(session.id, f"cd {tmp_path} && export A=1 && B=2", check=True)
    await client.run_in_session(session.id, "greet() { echo hello $1; }", check=True)
    result = await client.run_in_session(session.id, "pwd; echo $A $B; greet you")
    assert result.stdout == f"{tmp_path}\n1 2\nhello you\n"
    assert result.exit_code == 0 and result.alive
    await client.close_session(session.id)


async def test_output_without_newline_and_exit_code(client: DaemonClient) -> None:
    session = await client.create_session()
    result = await client.run_in_session(session.id, "printf 'no newline'; printf e >&2; false")
    assert (result.stdout, result.stderr, result.exit_code) == ("no newline", "e", 1)
    await client.close_session(session.id)


async def test_syntax_error_does_not_end_the_session(client: DaemonClient) -> None:
    session = await client.create_session(shell="/bin/sh")
    result = await client.run_in_session(session.id, "if then fi (")
    assert result.exit_code != 0 and result.alive
    assert (await client.run_in_session(session.id, "echo ok")).stdout == "ok\n"
    await client.close_session(session.id)


async def test_stdin_is_not_the_session_pipe(client: DaemonClient) -> None:
    session = await client.create_session()
    result = await client.run_in_session(session.id, "cat; echo after")
    assert result.stdout == "after\n"
    await client.close_session(session.id)


async def test_timeout_closes_the_session(client: DaemonClient) -> None:
    session = await client.create_session()
    result = await client.run_in_session(session.id, "sleep 1000", timeout=0.3)
    assert result.timed_out and not result.alive
    with pytest.raises(sandman.SessionClosed):
        await client.run_in_session(session.id, "echo hi")
    assert not (await client.get_session(session.id)).alive
    await client.close_session(session.id)


async def test_exit_closes_the_session(client: DaemonClient) -> None:
    session = await client.create_session()
    result = await client.run_in_session(session.id, "exit 7")
    assert (result.exit_code, result.alive) == (7, False)
    await client.close_session(session.id)


async def test_list_and_close(client: DaemonClient) -> None:
    session = await client.create_session()
    assert session.id in [s.id for s in await client.list_sessions()]
    await client.close_session(session.id)
    with pytest.raises(sandman.PathNotFound):
        await client.get_session(session.id)


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_merged_output_keeps_the_session_state(client: DaemonClient, shell: str) -> None:
    session = await client.create_session(shell=shell)
    merged = await client.run_in_session(
        session.id, "cd /; X=1; echo out; echo err >&2; echo out2", merge_stderr=True
    )
    assert (merged.stdout, merged.stderr) == ("out\nerr\nout2\n", "")
    apart = await client.run_in_session(session.id, "echo $X $(pwd); echo err >&2")
    assert (apart.stdout, apart.stderr) == ("1 /\n", "err\n")
    await client.close_session(session.id)


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
async def test_timeout_can_interrupt_and_keep_the_session(
    client: DaemonClient, tmp_path: Path, shell: str
) -> None:
    session = await client.create_session(shell=shell)
    await client.run_in_session(session.id, f"cd {tmp_path}; A=1", check=True)
    for command in ("B=2; echo before; sleep 1000; echo after", "while :; do sleep 0.05; done"):
        result = await client.run_in_session(
            session.id, command, timeout=0.3, on_timeout="interrupt"
        )
        assert result.timed_out and result.alive and result.exit_code == 130
        assert "after" not in result.stdout
        with pytest.raises(sandman.ExecTimeout):
            await client.run_in_session(
                session.id, command, timeout=0.2, on_timeout="interrupt", check=True
            )
    after = await client.run_in_session(session.id, "echo $A $B; pwd", check=True)
    assert after.stdout == f"1 2\n{tmp_path}\n"
    # A command that ignores SIGINT: the session is killed kill_grace later.
    stubborn = await client.run_in_session(
        session.id, "sh -c \"trap '' INT; sleep 1000\"", timeout=0.2, on_timeout="interrupt",
        kill_grace=0.2,
    )  # fmt: skip
    assert stubborn.timed_out and not stubborn.alive
    await client.close_session(session.id)
