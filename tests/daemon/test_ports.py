"""Ports of the daemon's machine reached through it: ``expose`` against a real daemon, and
against daemons that lie (issue 16, gap 6)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from jsonschema import Draft202012Validator

import sandman
from sandman._transport import HTTPTransport
from sandman.daemon import DaemonClient
from sandman.daemon.tunnel import Dialer, ExposedPort, Refused
from tests.daemon.conftest import TOKEN
from tests.daemon.running import RunningDaemon
from tests.daemon.tcp import (
    Handler,
    Served,
    count_then_answer,
    echo,
    http_hello,
    serve,
)
from tests.daemon.test_spec import REGISTRY, SPEC
from tests.support import eventually

pytestmark = pytest.mark.anyio


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_http_through_an_exposed_port(client: DaemonClient) -> None:
    async with serve(http_hello) as served:
        exposed = await client.expose(served.port)
        assert exposed.url == f"http://127.0.0.1:{exposed.port}" and exposed.host == "127.0.0.1"
        assert exposed.remote_port == served.port
        async with httpx.AsyncClient(base_url=exposed.url) as http:
            for path in ("/a", "/b", "/c"):  # one kept-alive connection
                answer = await http.get(path)
                assert answer.text == f"hello from {path}"
        assert served.seen == 1
        await exposed.aclose()
        assert exposed.closed and exposed.connections == 0


async def test_bulk_both_ways_and_the_half_close(client: DaemonClient) -> None:
    data = os.urandom(16 * 1024 * 1024)
    async with serve(echo) as echoed, serve(count_then_answer) as counted:
        async with await client.expose(echoed.port) as exposed:
            reader, writer = await asyncio.open_connection(exposed.host, exposed.port)

            async def send() -> None:
                for i in range(0, len(data), 1024 * 1024):
                    writer.write(data[i : i + 1024 * 1024])
                    await writer.drain()

            sending = asyncio.ensure_future(send())
            back = await reader.readexactly(len(data))
            await sending
            assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
            writer.write_eof()
            assert await reader.read() == b""  # the echo ended its side in turn
            writer.close()
            await writer.wait_closed()
        async with await client.expose(counted.port) as exposed:
            reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
            writer.write(data[:1_000_000])
            writer.write_eof()
            assert await reader.read() == b"got 1000000"
            writer.close()
            await writer.wait_closed()


async def test_a_port_nothing_listens_on_closes_the_connection_and_says_why(
    client: DaemonClient,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed_port = probe.getsockname()[1]
    async with await client.expose(closed_port) as exposed:
        reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
        assert await reader.read() == b""
        writer.close()
        await writer.wait_closed()
        assert exposed.last_failure is not None
        assert exposed.last_failure.startswith("connection_refused: nothing listens on port")
        await eventually(lambda: exposed.connections == 0)
        # The server may come up later: the same exposure reaches it then.
        with pytest.raises(sandman.ConfigError, match="port must be in 1..65535"):
            await client.expose(0)
        with pytest.raises(sandman.ConfigError, match="port must be in 1..65535"):
            await client.expose(65536)
        with pytest.raises(sandman.ConfigError, match="half_close_timeout must be > 0"):
            await client.expose(closed_port, half_close_timeout=0)
        with pytest.raises(sandman.ConfigError, match="cannot listen on 127.0.0.1"):
            await client.expose(closed_port, local_port=exposed.port)


async def test_many_connections_at_once(client: DaemonClient) -> None:
    async with serve(echo) as served, await client.expose(served.port) as exposed:

        async def one(i: int) -> bytes:
            reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
            message = f"connection {i} ".encode() * (i * 100 + 1)
            writer.write(message)
            writer.write_eof()
            back = await reader.read()
            writer.close()
            await writer.wait_closed()
            return back if back == message else b"wrong"

        results = await asyncio.gather(*(one(i) for i in range(48)))
        assert b"wrong" not in results and served.seen == 48
        await eventually(lambda: exposed.connections == 0 and served.active == 0)


async def test_closing_leaves_nothing_behind(client: DaemonClient) -> None:
    async with serve(echo) as served:
        await client.health()  # the client's own kept-alive connection, before counting
        before = open_fds()
        exposed = await client.expose(served.port)
        streams = [await asyncio.open_connection(exposed.host, exposed.port) for _ in range(5)]
        for reader, writer in streams:
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
        assert exposed.connections == 5 and served.active == 5
        await exposed.aclose()
        assert exposed.connections == 0 and not exposed._upstreams
        for reader, writer in streams:
            assert await reader.read() == b""  # closed from our side
            writer.close()
            await writer.wait_closed()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(exposed.host, exposed.port)
        # The daemon let go of the port's connections too.
        await eventually(lambda: served.active == 0)
        assert open_fds() == before
        await exposed.aclose()  # idempotent


async def test_the_daemon_client_closes_its_ports(daemon: RunningDaemon) -> None:
    async with serve(echo) as served:
        client = daemon.client()
        exposed = await client.expose(served.port)
        reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        await client.aclose()
        assert exposed.closed and await reader.read() == b""
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: served.active == 0)
        with pytest.raises(sandman.DaemonUnavailable, match="closed"):
            await client.expose(served.port)


async def test_the_daemons_answers_match_the_spec(daemon: RunningDaemon) -> None:
    ((_, item),) = ((p, i) for p, i in SPEC["paths"].items() if p == "/v1/ports/{id}/connect")
    operation = item["get"]
    assert "101" in operation["responses"]
    error = Draft202012Validator({"$ref": "urn:spec#/components/schemas/Error"}, registry=REGISTRY)
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed_port = probe.getsockname()[1]
    assert daemon.uds is not None
    for token, port, status, code in (
        (TOKEN, closed_port, 502, "connection_refused"),
        ("wrong", closed_port, 401, "unauthorized"),
    ):
        dialer = Dialer(uds=daemon.uds, headers={"Authorization": f"Bearer {token}"})
        with pytest.raises(Refused) as refused:
            await dialer.open(port, _NoPeer())
        assert refused.value.status == status and str(status) in operation["responses"]
        body = json.loads(refused.value.body)
        error.validate(body)
        assert body["error"]["code"] == code


class _NoPeer:
    def deliver(self, data: bytes) -> None:
        raise AssertionError("no bytes expected")

    def deliver_eof(self) -> None:
        pass

    def upstream_lost(self) -> None:
        pass

    def pause_sending(self) -> None:
        pass

    def resume_sending(self) -> None:
        pass


# -- daemons that lie -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def fake_daemon(tmp_path: Path, answer: Handler) -> AsyncIterator[Served]:
    """A unix-socket server that reads the request's head, then does ``answer``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await answer(reader, writer)

    served = Served(handler)
    path = str(tmp_path / "fake.sock")
    server = await asyncio.start_unix_server(served.handle, path)
    try:
        yield served
    finally:
        server.close()
        await server.wait_closed()
        await eventually(lambda: served.active == 0)


async def _expose_fake(tmp_path: Path, handshake_timeout: float = 30.0) -> ExposedPort:
    dialer = Dialer(uds=str(tmp_path / "fake.sock"), handshake_timeout=handshake_timeout)
    return await ExposedPort.start(dialer, 80)


async def _closed_at_once(exposed: ExposedPort) -> None:
    reader, writer = await asyncio.open_connection(exposed.host, exposed.port)
    writer.write(b"hello")
    # What it sent was never read: the kernel closes with a reset.
    with contextlib.suppress(ConnectionResetError):
        assert await reader.read() == b""
    writer.close()
    with contextlib.suppress(ConnectionResetError):
        await writer.wait_closed()


async def test_an_endless_head_is_cut(tmp_path: Path) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\n")
        while True:
            writer.write(b"X-Filler: " + b"y" * 1000 + b"\r\n")
            await writer.drain()

    async with fake_daemon(tmp_path, endless), await _expose_fake(tmp_path) as exposed:
        await _closed_at_once(exposed)
        assert exposed.last_failure == "ConnectionLost: the daemon's answer has a head over 64 KiB"


async def test_a_silent_daemon_times_out(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with (
        fake_daemon(tmp_path, silent),
        await _expose_fake(tmp_path, handshake_timeout=0.2) as exposed,
    ):
        await _closed_at_once(exposed)
        assert exposed.last_failure == "TimeoutError: "


@pytest.mark.parametrize(
    ("answer", "failure"),
    [
        (b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 99999999\r\n\r\n",
         "ConnectionLost: malformed answer from the daemon: error body of length '99999999'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
         "ConnectionLost: malformed answer from the daemon: status 200, expected 101"),
        (b"SSH-2.0-OpenSSH\r\n\r\n",
         "ConnectionLost: malformed answer from the daemon: status line 'SSH-2.0-OpenSSH'"),
        (b"HTTP/1.1 403 Forbidden\r\n\r\n" + b"z" * 70000,
         "ConnectionLost: the daemon's error answer is over 64 KiB"),
        (b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 5\r\n\r\nshort",
         "internal: HTTP 418: short"),
    ],
)  # fmt: skip
async def test_a_lying_answer_is_refused(tmp_path: Path, answer: bytes, failure: str) -> None:
    async def lie(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        await reader.read()

    async with fake_daemon(tmp_path, lie), await _expose_fake(tmp_path) as exposed:
        await _closed_at_once(exposed)
        assert exposed.last_failure == failure


async def test_a_flood_is_held_back_while_the_local_side_does_not_read(tmp_path: Path) -> None:
    sent = 0

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: tcp\r\n\r\n")
        chunk = b"f" * 65536
        while True:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)

    async with fake_daemon(tmp_path, flood), await _expose_fake(tmp_path) as exposed:
        _reader, writer = await asyncio.open_connection(exposed.host, exposed.port, limit=65536)
        # Nobody reads: the daemon's writes stall once the socket buffers and
        # the tunnel's bounded buffer are full.
        stalled_at = -1
        while stalled_at != sent:
            stalled_at = sent
            await asyncio.sleep(0.2)
        (local,) = exposed._locals
        assert local._transport is not None
        assert local._transport.get_write_buffer_size() < 1024 * 1024
        assert sent < 64 * 1024 * 1024, sent
        writer.close()
        await writer.wait_closed()


async def test_a_client_on_a_transport_of_its_own_has_no_address_to_expose(
    daemon: RunningDaemon,
) -> None:
    assert daemon.uds is not None
    client = DaemonClient(transport=HTTPTransport(uds=daemon.uds))
    try:
        with pytest.raises(sandman.ConfigError, match="transport="):
            await client.expose(80)
    finally:
        await client.aclose()
