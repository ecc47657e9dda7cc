"""The proxy's `Forwarder`: kept connections to daemons, and ones that fall out of the cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.server.errors import ApiError
from sandman.server.proxy import Forwarder
from sandman.testing import FakeProvider

pytestmark = pytest.mark.anyio


def _app(pool: Pool, forwarder: Forwarder) -> Starlette:
    async def route(request: Request) -> Response:
        record = pool.get(request.path_params["sid"])
        try:
            return await forwarder.forward(record, request, request.path_params["path"])
        except ApiError as exc:
            return Response(exc.code, status_code=exc.status)

    return Starlette(routes=[Route("/{sid}/{path:path}", route, methods=["GET", "POST"])])


async def test_requests_in_flight_survive_their_client_falling_out_of_the_cache() -> None:
    async with FakeProvider(daemon=True, seed=5) as fake, Pool(fake, PoolConfig(name="f")) as pool:
        session = pool.open_session()
        first, second = [
            await pool.acquire(SandboxSpec(image="task"), session=session, timeout=20)
            for _ in range(2)
        ]
        forwarder = Forwarder(max_body=1 << 20, connect_timeout=5, max_sockets=1)
        transport = httpx.ASGITransport(app=_app(pool, forwarder))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                slow = {"argv": ["sh", "-c", "sleep 0.5; echo slow"]}
                streaming = asyncio.ensure_future(
                    http.post(f"/{first.id}/v1/exec/stream", json=slow)
                )
                await asyncio.sleep(0.2)  # the first is mid-answer...
                # ...when the second's daemon pushes the first's client out of the cache.
                quick = await http.post(f"/{second.id}/v1/exec", json={"argv": ["echo", "b"]})
                assert quick.status_code == 200 and quick.json()["stdout"] == "b\n"
                answer = await streaming
                events = [json.loads(line) for line in answer.text.splitlines() if line]
                assert events[0]["data"] == "slow\n"
                assert events[-1]["event"] == "exit" and events[-1]["exit_code"] == 0
                # Used again after eviction: a fresh client, same answers.
                for sandbox, word in ((first, "a"), (second, "b"), (first, "a")):
                    again = await http.post(f"/{sandbox.id}/v1/exec", json={"argv": ["echo", word]})
                    assert again.json()["stdout"] == f"{word}\n"
                # A sandbox that is gone is not forwarded to.
                pool.release(first.id)
                gone = await http.post(f"/{first.id}/v1/exec", json={"argv": ["true"]})
                assert gone.status_code == 404 and gone.text == "sandbox_not_found"
        finally:
            await forwarder.aclose()


async def test_the_route_reaches_only_the_sandboxs_own_daemon(tmp_path: Path) -> None:
    """Whatever else answers at a sandbox's socket path is refused before a byte
    (the daemon's token least of all) is sent to it."""
    async with FakeProvider(daemon=True, seed=6) as fake, Pool(fake, PoolConfig(name="g")) as pool:
        record = await pool.acquire(
            SandboxSpec(image="task"), session=pool.open_session(), timeout=20
        )
        assert record.info is not None and record.info.endpoint is not None
        socket_path = record.info.endpoint.uds
        assert socket_path is not None and record.info.endpoint.pid is not None
        forwarder = Forwarder(max_body=1 << 20, connect_timeout=5)
        transport = httpx.ASGITransport(app=_app(pool, forwarder))
        received = bytearray()
        impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        impostor.bind(str(tmp_path / "impostor.sock"))
        impostor.listen()
        impostor.setblocking(False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                ok = await http.post(f"/{record.id}/v1/exec", json={"argv": ["echo", "a"]})
                assert ok.status_code == 200
                await forwarder.aclose()  # no kept connection to the real daemon
                os.replace(tmp_path / "impostor.sock", socket_path)
                refused = await http.post(f"/{record.id}/v1/exec", json={"argv": ["true"]})
                assert refused.status_code == 502 and refused.text == "untrusted_daemon"
            # The impostor may have seen the connection, never a byte of the request.
            with contextlib.suppress(BlockingIOError):
                while True:
                    conn, _ = impostor.accept()
                    with conn:
                        conn.setblocking(False)
                        with contextlib.suppress(BlockingIOError):
                            received += conn.recv(65536)
            assert bytes(received) == b""
        finally:
            impostor.close()
            await forwarder.aclose()
