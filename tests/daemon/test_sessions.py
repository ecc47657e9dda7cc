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
