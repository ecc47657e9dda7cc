from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

import sandman
from sandman._transport import Response
from sandman.daemon import DaemonClient, protocol


def test_target_encodes_and_skips_none() -> None:
    assert (
        protocol.target("/v1/files", path="/a b/c&d", mode=None)
        == "/v1/files?path=%2Fa%20b%2Fc%26d"
    )
    assert protocol.target("/v1/x", flag=True, other=False) == "/v1/x?flag=true&other=false"
    assert protocol.target("/v1/x") == "/v1/x"


def test_command_fields() -> None:
    assert protocol.command_fields("ls | wc") == {"cmd": "ls | wc"}
    assert protocol.command_fields(("ls", "-l"), cwd="/w", env={"A": "1"}) == {
        "argv": ["ls", "-l"], "cwd": "/w", "env": {"A": "1"},
    }  # fmt: skip
    assert protocol.command_fields("x", shell="/bin/bash") == {"cmd": "x", "shell": "/bin/bash"}
    with pytest.raises(sandman.ConfigError):
        protocol.command_fields([])
    with pytest.raises(sandman.ConfigError):
        protocol.command_fields(["ls"], shell="/bin/sh")


def test_quote_segment() -> None:
    assert protocol.quote_segment("p-1") == "p-1"
    assert protocol.quote_segment("../x") == "..%2Fx"


def test_exec_fields_put_each_option_on_the_wire() -> None:
    assert protocol.exec_fields("true", {}) == {"cmd": "true"}
    options: protocol.ExecOptions = {
        "cwd": "/w", "env": {"A": "1"}, "stdin": b"\x00", "timeout": 5.0, "kill_grace": 0.5,
        "max_output": 10, "shell": "/bin/bash", "encoding": "base64", "user": 0,
        "merge_stderr": True,
    }  # fmt: skip
    assert protocol.exec_fields("x", options) == {
        "cmd": "x", "cwd": "/w", "env": {"A": "1"}, "stdin": "AA==", "stdin_encoding": "base64",
        "timeout": 5.0, "kill_grace": 0.5, "max_output": 10, "shell": "/bin/bash",
        "encoding": "base64", "user": "0", "merge_stderr": True,
    }  # fmt: skip
    # Absent and the default are the same request: the daemon's defaults apply.
    defaults: protocol.ExecOptions = {
        "cwd": None, "env": None, "stdin": None, "timeout": None, "kill_grace": None,
        "max_output": None, "shell": None, "encoding": "utf-8", "user": None,
        "merge_stderr": False,
    }  # fmt: skip
    assert protocol.exec_fields(["ls"], defaults) == {"argv": ["ls"]}


class _Unreachable:
    """A transport that fails the test if anything is sent through it."""

    async def request(self, *args: object, **kwargs: object) -> Response:
        raise AssertionError("nothing should be sent")

    def stream(self, *args: object, **kwargs: object) -> AbstractAsyncContextManager[Any]:
        raise AssertionError("nothing should be sent")

    async def aclose(self) -> None:
        pass


@pytest.mark.anyio
async def test_an_unknown_exec_option_is_a_type_error_and_sends_nothing() -> None:
    # ``**options`` takes any keyword at run time: a misspelt one must still fail as an
    # unknown keyword did when each option was a parameter, not be dropped.
    with pytest.raises(TypeError, match="'timout'"):
        protocol.exec_fields("true", {"timout": 1.0})  # type: ignore[typeddict-unknown-key]
    async with DaemonClient(transport=_Unreachable()) as client:
        with pytest.raises(TypeError, match="'timout'"):
            await client.exec("sleep 9", timout=1.0)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'checks'"):
            async with client.exec_stream("sleep 9", checks=True):  # type: ignore[call-arg]
                pass


def test_exec_documents_every_option() -> None:
    # IDEs show exec's docstring with its signature: it lists the options it takes.
    doc = DaemonClient.exec.__doc__ or ""
    for name in protocol.ExecOptions.__optional_keys__:
        assert f"- ``{name}``:" in doc, name
    assert set(protocol.ExecOptions.__optional_keys__) == set(protocol.ExecOptions.__annotations__)
