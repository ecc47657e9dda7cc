"""The transport seam: `DaemonClient` over another transport than its own.

httpx over the same unix socket (``HttpxTransport``) must make the same client
work against the real daemon, and httpx's failures must reach the client as
the seam's errors, hence as the package's (DaemonUnavailable), never as httpx's.
"""

from __future__ import annotations

import tarfile
from collections.abc import AsyncIterator, Iterator
from io import BytesIO
from pathlib import Path

import httpx
import pytest

import sandman
from sandman._transport import ConnectionLost, HTTPTransport
from sandman._transport.bridge import HttpxTransport
from sandman.daemon import PROTOCOL_VERSION, DaemonClient
from tests.daemon.running import RunningDaemon, start_daemon

pytestmark = pytest.mark.anyio

TOKEN = "seam-token"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path, token=TOKEN, tcp=False)
    try:
        yield running
    finally:
        running.stop()


def _over_httpx(daemon: RunningDaemon) -> DaemonClient:
    assert daemon.uds is not None
    transport = HttpxTransport(
        httpx.AsyncHTTPTransport(uds=daemon.uds), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    return DaemonClient(transport=transport, request_timeout=30)


async def test_the_daemon_client_over_httpx(daemon: RunningDaemon, tmp_path: Path) -> None:
    async with _over_httpx(daemon) as client:
        assert (await client.health()).protocol == PROTOCOL_VERSION
        result = await client.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        async with client.exec_stream(["sh", "-c", "echo a; echo b"]) as events:
            kinds = [event.event async for event in events]
        assert kinds[-1] == "exit" and kinds.count("stdout") >= 1

        target = str(tmp_path / "f")
        await client.write_file(target, b"x" * 300_000)
        assert await client.read_file(target) == b"x" * 300_000
        async with client.read_file_stream(target) as chunks:
            assert sum([len(piece) async for piece in chunks]) == 300_000
        with pytest.raises(sandman.PathNotFound):
            await client.read_file(str(tmp_path / "missing"))

        buffer = BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo("t")
            info.size = 2
            tar.addfile(info, BytesIO(b"hi"))

        async def pieces() -> AsyncIterator[bytes]:  # a streamed (chunked) request body
            data = buffer.getvalue()
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        await client.upload_archive(str(tmp_path / "d"), pieces())
        assert (tmp_path / "d" / "t").read_bytes() == b"hi"


async def test_a_wrong_token_is_the_daemons_answer_over_any_transport(
    daemon: RunningDaemon,
) -> None:
    assert daemon.uds is not None
    transport = HttpxTransport(
        httpx.AsyncHTTPTransport(uds=daemon.uds), headers={"Authorization": "Bearer nope"}
    )
    async with DaemonClient(transport=transport) as client:
        with pytest.raises(sandman.DaemonError) as caught:
            await client.exec(["true"])
        assert caught.value.status == 401


async def test_httpx_failures_leave_as_the_seams_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    def cut(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    refused = HttpxTransport(httpx.MockTransport(refuse))
    with pytest.raises(ConnectionError, match="refused"):
        await refused.request("GET", "/v1/health")
    async with DaemonClient(transport=refused) as client:
        with pytest.raises(sandman.DaemonUnavailable, match="cannot reach"):
            await client.health()

    broken = HttpxTransport(httpx.MockTransport(cut))
    with pytest.raises(ConnectionLost, match="peer closed"):
        async with broken.stream("GET", "/"):
            pass
    async with DaemonClient(transport=broken) as client:
        with pytest.raises(sandman.DaemonUnavailable, match="lost"):
            await client.exec(["true"])


async def test_a_body_cut_short_is_connection_lost_through_httpx() -> None:
    async def truncated() -> AsyncIterator[bytes]:
        yield b"part"
        raise httpx.ReadError("connection reset")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Body(truncated()))

    transport = HttpxTransport(httpx.MockTransport(handler))
    async with transport.stream("GET", "/") as response:
        assert response.status == 200
        with pytest.raises(ConnectionLost, match="reset"):
            await response.read()
    await transport.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, pieces: AsyncIterator[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._pieces:
            yield piece


def test_a_transport_or_an_address_not_both() -> None:
    transport = HTTPTransport(uds="/nonexistent")
    with pytest.raises(sandman.ConfigError, match="not both"):
        DaemonClient(transport=transport, uds="/nonexistent")
    with pytest.raises(sandman.ConfigError, match="not both"):
        DaemonClient(transport=transport, token="t")
    assert "unix:/nonexistent" in repr(DaemonClient(transport=transport))
