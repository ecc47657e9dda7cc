"""The host's calls around a memory checkpoint, against the real daemon: token
replacement, and the prepare that stops the serving until SIGUSR2."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

import sandman
from sandman.daemon.checkpoint import prepare_checkpoint, replace_token
from tests.daemon.conftest import TOKEN
from tests.daemon.running import RunningDaemon
from tests.daemon.test_spec import SPEC, _validator

pytestmark = pytest.mark.anyio

NEW = "a-token-of-its-own-0123456789"
SERVE = (
    "import socket, time; s = socket.create_server(('127.0.0.1', 0)); "
    "print('up', flush=True); time.sleep(60)"
)


def _refuses(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_replace_token(daemon: RunningDaemon) -> None:
    assert daemon.tcp is not None
    _validator("#/components/schemas/TokenRequest").validate({"token": NEW})
    await replace_token(NEW, token=TOKEN, host=daemon.tcp[0], port=daemon.tcp[1])
    async with daemon.client() as old:
        with pytest.raises(sandman.Unauthorized):
            await old.list_processes()
    async with daemon.client(token=NEW) as new:
        assert await new.list_processes() == []
    # The old token is gone for good, and a bad new one is refused.
    with pytest.raises(sandman.Unauthorized):
        await replace_token(NEW + "x", token=TOKEN, uds=daemon.uds)
    with pytest.raises(sandman.InvalidRequest):
        await replace_token("short", token=NEW, uds=daemon.uds)


async def test_prepare_stops_serving_until_sigusr2(daemon: RunningDaemon) -> None:
    assert daemon.tcp is not None
    async with daemon.client(transport="tcp") as client:
        sleeper = await client.spawn(["sleep", "60"])
        await prepare_checkpoint(token=TOKEN, host=daemon.tcp[0], port=daemon.tcp[1])
        assert _refuses(daemon.tcp)
        assert not Path(daemon.uds or "").exists()  # the unix socket is gone too
        daemon.process.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while _refuses(daemon.tcp):
            assert time.monotonic() < deadline, daemon.log_path.read_text()
            time.sleep(0.005)
        # The same daemon: its process, its token.
        assert (await client.poll(sleeper.id)).running
        await client.kill(sleeper.id)


async def test_prepare_is_refused_while_a_process_serves_tcp(daemon: RunningDaemon) -> None:
    assert daemon.tcp is not None
    async with daemon.client() as client:
        listener = await client.spawn(["python3", "-c", SERVE])
        while "up" not in (await client.read_output(listener.id, wait=1)).stdout:
            pass
        with pytest.raises(sandman.DaemonError) as refused:
            await prepare_checkpoint(token=TOKEN, uds=daemon.uds)
        assert refused.value.code == "not_checkpointable"
        assert refused.value.status == 409
        assert f"pid {listener.pid} (python3): LISTEN 127.0.0.1:" in str(refused.value)
        # Still serving.
        assert (await client.poll(listener.id)).running
        await client.kill(listener.id)


def test_the_spec_documents_both() -> None:
    token = SPEC["paths"]["/v1/token"]["post"]
    prepare = SPEC["paths"]["/v1/checkpoint/prepare"]["post"]
    assert {"204", "400", "401"} <= token["responses"].keys()
    assert {"204", "401", "409"} <= prepare["responses"].keys()
    codes = SPEC["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"]
    assert "not_checkpointable" in codes["enum"]
    _validator("#/components/schemas/Error").validate(
        json.loads('{"error": {"code": "not_checkpointable", "message": "pid 7 (x): LISTEN"}}')
    )
