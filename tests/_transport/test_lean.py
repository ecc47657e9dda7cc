"""The lean HTTP/1.1 transport against a scripted server: framing, keep-alive, failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandman import errors
from sandman._transport import ConnectionLost, HTTPTransport, iter_lines
from sandman.daemon import DaemonClient

pytestmark = pytest.mark.anyio

Reply = Callable[[bytes], bytes | None]


@asynccontextmanager
async def scripted_server(
    path: Path, reply: Reply, *, dribble: bool = False
) -> AsyncIterator[list[int]]:
    """Answers each request head with reply(head); None closes the connection.

    ``dribble`` sends the answer a byte at a time, each in its own read.
    """
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                answer = reply(head)
                if answer is None:
                    break
                for piece in (
                    [answer[i : i + 1] for i in range(len(answer))] if dribble else [answer]
                ):
                    writer.write(piece)
                    await writer.drain()
                    if dribble:
                        await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, path=str(path))
    try:
        yield connections
    finally:
        server.close()
        await server.wait_closed()


async def test_content_length_and_keep_alive(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    async with scripted_server(
        sock, lambda _: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
    ) as conns:
        transport = HTTPTransport(uds=str(sock))
        for _ in range(5):
            response = await transport.request("GET", "/")
            assert (response.status, response.body) == (200, b"hi")
        await transport.aclose()
    assert len(conns) == 1


async def test_chunked_and_no_content(tmp_path: Path) -> None:
    sock = tmp_path / "s"

    def reply(head: bytes) -> bytes:
        if head.startswith(b"DELETE"):
            return b"HTTP/1.1 204 No Content\r\n\r\n"
        return (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )

    async with scripted_server(sock, reply) as conns:
        transport = HTTPTransport(uds=str(sock))
        assert (await transport.request("GET", "/")).body == b"abcde"
        assert (await transport.request("DELETE", "/")).status == 204
        assert (await transport.request("GET", "/")).body == b"abcde"
        async with transport.stream("GET", "/") as response:
            assert [line async for line in iter_lines(response)] == [b"abcde"]
        await transport.aclose()
    assert len(conns) == 1


async def test_response_split_across_reads(tmp_path: Path) -> None:
    # Every boundary (status line, headers, chunk sizes, chunk CRLFs) falls
    # between two reads at some point; the incremental parser must not care.
    sock = tmp_path / "s"
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    plain = b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\nX-Thing: Yes\r\n\r\nhello"

    def reply(head: bytes) -> bytes:
        return chunked if head.startswith(b"GET") else plain

    async with scripted_server(sock, reply, dribble=True) as conns:
        transport = HTTPTransport(uds=str(sock))
        assert (await transport.request("GET", "/")).body == b"abcde"
        response = await transport.request("POST", "/", body=b"x")
        assert (response.status, response.headers["x-thing"], response.body) == (
            201,
            "Yes",
            b"hello",
        )
        async with transport.stream("GET", "/") as streamed:
            pieces = [piece async for piece in streamed.iter_bytes()]
        assert b"".join(pieces) == b"abcde"
        assert len(pieces) > 1  # yielded as they came, not at the end
        await transport.aclose()
    assert len(conns) == 1


async def test_body_until_close(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()
        served += 1

    server = await asyncio.start_unix_server(handle, path=str(sock))
    transport = HTTPTransport(uds=str(sock))
    try:
        assert (await transport.request("GET", "/")).body == b"all of it"
        assert (await transport.request("GET", "/")).body == b"all of it"
        assert served == 2  # the body ended with its connection: none to reuse
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_abandoned_exchange_closes_its_connection(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    slow = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"/slow" in head:
                    await slow.wait()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, path=str(sock))
    transport = HTTPTransport(uds=str(sock))
    try:
        # Cancelled while waiting for the answer: that answer must never be
        # read as the answer to the next request.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await transport.request("GET", "/slow")
        slow.set()
        assert (await transport.request("GET", "/fast")).body == b"ok"
        # Left before the body was read: the same.
        async with transport.stream("GET", "/fast") as response:
            assert response.status == 200
        assert (await transport.request("GET", "/fast")).body == b"ok"
        assert len(transport._idle) == 1
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_client_deadline_is_a_timeout_not_unavailable(tmp_path: Path) -> None:
    # SandboxTimeout is a TimeoutError, hence an OSError: it must not be
    # mistaken for a transport failure (DaemonUnavailable, retryable).
    sock = tmp_path / "s"
    finished = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers; returns once the client hangs up
        writer.close()
        finished.set()

    server = await asyncio.start_unix_server(handle, path=str(sock))
    client = DaemonClient(uds=str(sock), request_timeout=0.05)
    try:
        with pytest.raises(errors.SandboxTimeout, match="did not answer"):
            await client.health()
        await asyncio.wait_for(finished.wait(), 5)  # the timed-out connection was closed
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_connection_close_is_honoured(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    async with scripted_server(sock, lambda _: answer) as conns:
        transport = HTTPTransport(uds=str(sock))
        for _ in range(3):
            assert (await transport.request("GET", "/")).body == b"x"
        await transport.aclose()
    assert len(conns) == 3


async def test_stale_idle_connection_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    count = 0

    def reply(_: bytes) -> bytes | None:
        nonlocal count
        count += 1
        # Answer once per connection, then close it as an idle server would.
        return b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx" if count % 2 else None

    async with scripted_server(sock, reply) as conns:
        transport = HTTPTransport(uds=str(sock))
        for _ in range(3):
            assert (await transport.request("GET", "/")).body == b"x"
        await transport.aclose()
    assert len(conns) == 3


async def test_a_streamed_body_takes_a_fresh_connection(tmp_path: Path) -> None:
    # It could not be sent again if a kept-alive one turned out closed.
    sock = tmp_path / "s"
    sent: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        sent.append(b"once")
        yield b"once"

    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx"
    async with scripted_server(sock, lambda _: ok) as conns:
        transport = HTTPTransport(uds=str(sock))
        assert (await transport.request("GET", "/")).body == b"x"
        assert len(transport._idle) == 1
        async with transport.stream("PUT", "/", body=body()) as response:
            assert await response.read() == b"x"
        assert len(conns) == 2 and sent == [b"once"]
        await transport.aclose()


async def test_fresh_connection_failure_is_not_retried(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    async with scripted_server(sock, lambda _: None):
        transport = HTTPTransport(uds=str(sock))
        with pytest.raises(ConnectionLost):
            await transport.request("POST", "/", body=b"{}")
        await transport.aclose()


async def test_a_connect_that_hangs_is_cut_off() -> None:
    # A listener that never accepts, its one-slot queue already full: the
    # kernel drops further SYNs, so a connect hangs as to a black-holed address.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    host, port = listener.getsockname()
    queued: list[socket.socket] = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((host, port))
            queued.append(s)
        transport = HTTPTransport(host=host, port=port, connect_timeout=0.3)
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionError, match="took more than 0.3 s"):
            await transport.request("GET", "/")
        assert asyncio.get_running_loop().time() - started < 5
        await transport.aclose()
    finally:
        for s in queued:
            s.close()
        listener.close()


async def test_truncated_body(tmp_path: Path) -> None:
    sock = tmp_path / "s"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(handle, path=str(sock))
    transport = HTTPTransport(uds=str(sock))
    try:
        with pytest.raises(ConnectionLost):
            await transport.request("GET", "/")
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_garbage_status_line(tmp_path: Path) -> None:
    sock = tmp_path / "s"
    async with scripted_server(sock, lambda _: b"garbage\r\n\r\n"):
        transport = HTTPTransport(uds=str(sock))
        with pytest.raises(ConnectionLost):
            await transport.request("GET", "/")
        await transport.aclose()


def test_needs_exactly_one_address() -> None:
    with pytest.raises(ValueError, match="either"):
        HTTPTransport()
