"""Bad input gets a clear 4xx with a stable code, and the daemon lives on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sandman
from sandman._transport import HTTPTransport
from sandman.daemon import DaemonClient
from tests.daemon.conftest import TOKEN
from tests.daemon.running import RunningDaemon, start_daemon

pytestmark = pytest.mark.anyio


async def _raw(
    daemon: RunningDaemon, method: str, target: str, body: bytes, token: str = TOKEN
) -> tuple[int, str]:
    assert daemon.uds is not None
    transport = HTTPTransport(uds=daemon.uds, default_headers={"Authorization": f"Bearer {token}"})
    try:
        response = await transport.request(
            method, target, body=body, content_type="application/json"
        )
    finally:
        await transport.aclose()
    code = json.loads(response.body)["error"]["code"] if response.status >= 400 else ""
    return response.status, code


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"argv": ["true"], "bogus": 1}', 400, "invalid_request"),
        (b'{"argv": "true"}', 400, "invalid_request"),
        (b'{"argv": ["true"], "cmd": "true"}', 400, "invalid_request"),
        (b"{}", 400, "invalid_request"),
        (b'{"argv": []}', 400, "invalid_request"),
        (b'{"argv": ["true"], "timeout": -1}', 400, "invalid_request"),
        (b'{"argv": ["true"], "encoding": "latin-1"}', 400, "invalid_request"),
    ],
)
async def test_malformed_exec_requests(
    daemon: RunningDaemon, body: bytes, status: int, code: str
) -> None:
    assert await _raw(daemon, "POST", "/v1/exec", body) == (status, code)
    async with daemon.client() as client:
        assert (await client.exec(["true"])).ok


async def test_unknown_route_and_method(daemon: RunningDaemon) -> None:
    assert await _raw(daemon, "GET", "/v1/nope", b"") == (404, "unknown_route")
    assert await _raw(daemon, "DELETE", "/v1/exec", b"") == (405, "method_not_allowed")


async def test_wrong_and_missing_token(daemon: RunningDaemon) -> None:
    async with daemon.client(token="wrong") as client:
        assert (await client.health()).status == "ok"  # health needs no token
        with pytest.raises(sandman.Unauthorized):
            await client.exec(["true"])
    async with daemon.client(token=None) as client:
        with pytest.raises(sandman.Unauthorized) as info:
            await client.read_file("/etc/hostname")
        assert info.value.status == 401


async def test_token_from_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    running = start_daemon(
        tmp_path, token=None, tcp=False, extra_args=["--token-file", str(token_file)]
    )
    try:
        async with running.client(token="file-token") as client:
            assert (await client.exec(["true"])).ok
        async with running.client(token="other") as client:
            with pytest.raises(sandman.Unauthorized):
                await client.exec(["true"])
    finally:
        assert running.stop() == 0


def test_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="token"):
        start_daemon(tmp_path, token=None, tcp=False)


async def test_unreachable_daemon(tmp_path: Path) -> None:
    async with DaemonClient(uds=str(tmp_path / "nothing.sock"), token="x") as client:
        with pytest.raises(sandman.DaemonUnavailable) as info:
            await client.health()
        assert info.value.retryable
    async with DaemonClient(host="127.0.0.1", port=1, token="x") as client:
        with pytest.raises(sandman.DaemonUnavailable):
            await client.exec(["true"])


async def test_daemon_restart_is_survived_by_kept_alive_connections(tmp_path: Path) -> None:
    first = start_daemon(tmp_path, token=TOKEN, tcp=False)
    assert first.uds is not None
    client = DaemonClient(uds=first.uds, token=TOKEN)
    try:
        assert (await client.exec(["true"])).ok
        assert first.stop() == 0
        second = start_daemon(tmp_path, token=TOKEN, tcp=False)
        try:
            assert (await client.exec(["true"])).ok
        finally:
            second.stop()
    finally:
        await client.aclose()


def test_client_needs_one_address() -> None:
    with pytest.raises(sandman.ConfigError):
        DaemonClient(token="x")
    with pytest.raises(sandman.ConfigError):
        DaemonClient(uds="/x", host="h", port=1)


async def test_child_oom_score_adj_flag(tmp_path: Path) -> None:
    running = start_daemon(
        tmp_path, token=TOKEN, tcp=False, extra_args=["--child-oom-score-adj", "500"]
    )
    try:
        async with running.client() as client:
            # Set by the daemon right after the fork: look at a process that lives on.
            proc = await client.spawn(["sleep", "1000"])
            adj = Path(f"/proc/{proc.pid}/oom_score_adj").read_text()
            await client.kill(proc.id)
            assert adj == "500\n"
    finally:
        assert running.stop() == 0
