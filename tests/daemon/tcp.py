"""Small TCP servers on 127.0.0.1 for the tests of ``expose``: an echo, a counter that
needs the half-close, a keep-alive HTTP page; each counts its connections."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from tests.support import eventually

__all__ = ["Handler", "Served", "count_then_answer", "echo", "http_hello", "serve"]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Served:
    """A TCP server on 127.0.0.1 that counts the connections it is handling."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.active = 0
        self.seen = 0
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        self.seen += 1
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the other side went away: what these servers are for
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self.active -= 1


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Served]:
    served = Served(handler)
    server = await asyncio.start_server(served.handle, "127.0.0.1", 0)
    served.port = server.sockets[0].getsockname()[1]
    try:
        yield served
    finally:
        server.close()
        await server.wait_closed()
        await eventually(lambda: served.active == 0)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(256 * 1024):
        writer.write(data)
        await writer.drain()


async def count_then_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # Needs the half-close: it answers only once its input has ended.
    total = 0
    while data := await reader.read(256 * 1024):
        total += len(data)
    writer.write(f"got {total}".encode())
    await writer.drain()


async def http_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # A keep-alive HTTP/1.1 server of one page, enough for httpx.
    while head := await reader.readuntil(b"\r\n\r\n"):
        path = head.split(b" ", 2)[1]
        body = b"hello from " + path
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
