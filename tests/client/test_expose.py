"""``expose``: a server inside a sandbox without a network, reached from the host
through the daemon (issue 16, gap 6), on the real local provider."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import sandman
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = needs_root_and_crun


async def _get_when_up(url: str, timeout: float = 20.0) -> httpx.Response:
    """GET ``url`` until the server behind it answers (it starts in the background)."""
    async with httpx.AsyncClient() as http, asyncio.timeout(timeout):
        while True:
            try:
                return await http.get(url)
            except httpx.TransportError:
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _connected(
    exposed: sandman.ExposedPort,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection through ``exposed`` once the port inside accepts it: the
    first byte written comes back (an echo server)."""
    async with asyncio.timeout(20):
        while True:
            reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
            writer.write(b"?")
            with contextlib.suppress(ConnectionError):
                if await reader.read(1) == b"?":
                    break
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            await asyncio.sleep(0.02)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.mark.anyio
async def test_a_web_server_in_a_sandbox_without_network(
    imported: LocalProvider, local_state: Path
) -> None:
    async with (
        sandman.local(state_dir=local_state) as client,
        client.sandbox("busybox", network="none") as sb,
    ):
        await sb.write_file("/www/index.html", "hello from the sandbox\n")
        await sb.write_file("/www/big", b"\x00\x01" * 2_000_000)
        await sb.spawn(["busybox", "httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/www"])
        exposed = await sb.expose(8080)
        assert exposed.url.startswith("http://127.0.0.1:")
        answer = await _get_when_up(exposed.url + "/index.html")
        assert answer.status_code == 200 and answer.text == "hello from the sandbox\n"
        async with httpx.AsyncClient() as http:
            big = await http.get(exposed.url + "/big")
            assert big.content == b"\x00\x01" * 2_000_000
            missing = await http.get(exposed.url + "/missing")
            assert missing.status_code == 404
        # The same server, a second exposure; then an echo on a one-shot nc,
        # which needs the half-close to answer in full.
        again = await sb.expose(8080)
        assert (await _get_when_up(again.url + "/index.html")).status_code == 200
        await sb.spawn(["busybox", "nc", "-l", "-p", "9000", "-e", "/bin/cat"])
        echo = await sb.expose(9000)
        async with _connected(echo) as (reader, writer):
            writer.write(b"through the daemon\n" * 1000)
            writer.write_eof()
            assert await reader.read() == b"through the daemon\n" * 1000
    # Released with the sandbox: nothing listens any more.
    assert exposed.closed and again.closed and echo.closed
    for port in (exposed, again, echo):
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(port.host, port.port)
        assert port.connections == 0


@pytest.mark.anyio
async def test_a_port_that_is_not_listening_yet(imported: LocalProvider, local_state: Path) -> None:
    async with (
        sandman.local(state_dir=local_state) as client,
        client.sandbox("busybox") as sb,
    ):
        exposed = await sb.expose(8081)
        with pytest.raises(httpx.TransportError):
            async with httpx.AsyncClient() as http:
                await http.get(exposed.url)
        assert exposed.last_failure is not None
        assert exposed.last_failure.startswith("connection_refused: nothing listens on port 8081")
        await sb.write_file("/www/index.html", "late\n")
        await sb.spawn(["busybox", "httpd", "-f", "-p", "8081", "-h", "/www"])
        assert (await _get_when_up(exposed.url + "/index.html")).text == "late\n"
        await exposed.aclose()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(exposed.host, exposed.port)


def test_the_blocking_face(imported: LocalProvider, local_state: Path) -> None:
    with sandman.local_sync(state_dir=local_state) as client, client.sandbox("busybox") as sb:
        sb.write_file("/www/index.html", "sync\n")
        sb.spawn(["busybox", "httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/www"])
        with sb.expose(8080) as exposed, httpx.Client() as http:
            for _ in range(1000):
                try:
                    answer = http.get(exposed.url + "/index.html")
                    break
                except httpx.TransportError:
                    time.sleep(0.02)
            assert answer.text == "sync\n"
        assert exposed.closed
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((exposed.host, exposed.port)).close()
        kept = sb.expose(8080)
    assert kept.closed  # released with the sandbox
