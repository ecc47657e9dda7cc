from __future__ import annotations

import pytest

import sandman
from sandman.daemon import protocol


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
