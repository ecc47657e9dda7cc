"""A lean HTTP/1.1 client over a unix socket or TCP, with keep-alive.

The daemon protocol is a handful of small requests on a latency budget of a
fraction of a millisecond; general clients (httpx) spend several times the
cost of the command itself per call. This one does only what sandmand needs:
one request at a time per connection, Content-Length or chunked bodies, and a
pool of idle connections.

It raises only `ConnectionLost` (and `OSError` from connecting); the daemon
client maps those to the package's errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

__all__ = ["ConnectionLost", "HTTPResponse", "HTTPTransport", "StreamingResponse"]

_MAX_HEAD = 64 * 1024
_READ_CHUNK = 64 * 1024


class ConnectionLost(Exception):
    """The connection closed or broke before a whole response arrived."""


@dataclass(frozen=True, slots=True)
class HTTPResponse:
    status: int
    headers: dict[str, str]
    body: bytes


class _Connection:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class StreamingResponse:
    """A response whose body is read as it arrives."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self._done = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """Yield the body in pieces as they arrive."""
        if self.status not in (204, 304):
            async for piece in _iter_body(self._conn.reader, self.headers):
                yield piece
        self._done = True

    async def iter_lines(self) -> AsyncIterator[bytes]:
        """Yield the body line by line (without the newline), as lines complete."""
        pending = b""
        async for piece in self.iter_bytes():
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line
        if pending:
            yield pending

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.iter_bytes()])


class HTTPTransport:
    """Keep-alive HTTP/1.1 to one address: ``uds`` path, or ``host`` and ``port``."""

    def __init__(
        self,
        *,
        uds: str | None = None,
        host: str | None = None,
        port: int | None = None,
        default_headers: dict[str, str] | None = None,
        max_idle: int = 32,
    ) -> None:
        if (uds is None) == (host is None or port is None):
            raise ValueError("give either uds, or host and port")
        self._uds = uds
        self._host = host
        self._port = port
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False
        authority = "sandmand" if uds is not None else f"{host}:{port}"
        fixed = {"Host": authority, **(default_headers or {})}
        self._fixed_head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> HTTPResponse:
        """Send one request and read the whole response."""
        async with self.stream(method, target, body=body, content_type=content_type) as response:
            data = await response.read()
            return HTTPResponse(response.status, response.headers, data)

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | AsyncIterable[bytes] | None = None,
        content_type: str | None = None,
    ) -> AsyncIterator[StreamingResponse]:
        """Send one request; the response body is read from the yielded object.

        The connection goes back to the pool only if the body was read to its
        end; a cancelled or abandoned exchange closes it, so no half-read
        response is ever seen by the next request.
        """
        conn, status, headers = await self._exchange(method, target, body, content_type)
        response = StreamingResponse(conn, status, headers)
        try:
            yield response
        except BaseException:
            conn.close()
            raise
        if response._done and headers.get("connection", "").lower() != "close":
            self._release(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _exchange(
        self,
        method: str,
        target: str,
        body: bytes | AsyncIterable[bytes] | None,
        content_type: str | None,
    ) -> tuple[_Connection, int, dict[str, str]]:
        head = self._head(method, target, body, content_type)
        while True:
            conn = await self._acquire()
            try:
                await _send(conn.writer, head, body)
                status, headers = await _read_head(conn.reader)
            except BaseException as exc:
                conn.close()
                # A kept-alive connection the daemon closed while idle fails
                # before any byte of an answer: safe to send once more, fresh.
                if conn.reused and isinstance(exc, ConnectionLost | ConnectionError):
                    continue
                raise
            return conn, status, headers

    def _head(
        self,
        method: str,
        target: str,
        body: bytes | AsyncIterable[bytes] | None,
        content_type: str | None,
    ) -> bytes:
        parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._fixed_head]
        if body is None:
            if method in ("POST", "PUT", "PATCH"):
                parts.append(b"Content-Length: 0\r\n")
        elif isinstance(body, bytes):
            parts.append(b"Content-Length: %d\r\n" % len(body))
        else:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if content_type is not None:
            parts.append(f"Content-Type: {content_type}\r\n".encode("latin-1"))
        parts.append(b"\r\n")
        return b"".join(parts)

    async def _acquire(self) -> _Connection:
        if self._closed:
            raise ConnectionLost("transport is closed")
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        if self._uds is not None:
            reader, writer = await asyncio.open_unix_connection(self._uds, limit=_MAX_HEAD)
        else:
            reader, writer = await asyncio.open_connection(self._host, self._port, limit=_MAX_HEAD)
        return _Connection(reader, writer)

    def _release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self._max_idle or not conn.usable():
            conn.close()
        else:
            self._idle.append(conn)


async def _send(
    writer: asyncio.StreamWriter, head: bytes, body: bytes | AsyncIterable[bytes] | None
) -> None:
    if body is None or isinstance(body, bytes):
        writer.write(head + body if body else head)
    else:
        writer.write(head)
        async for piece in body:
            if piece:
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise ConnectionLost("connection closed before a response") from exc
    except asyncio.LimitOverrunError as exc:
        raise ConnectionLost("response head too large") from exc
    lines = raw.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError) as exc:
        raise ConnectionLost(f"malformed status line {lines[0]!r}") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def _iter_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    try:
        if "content-length" in headers:
            remaining = int(headers["content-length"])
            while remaining > 0:
                piece = await reader.read(min(remaining, _READ_CHUNK))
                if not piece:
                    raise ConnectionLost("connection closed mid-body")
                remaining -= len(piece)
                yield piece
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers from sandmand
                    return
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        else:
            while piece := await reader.read(_READ_CHUNK):
                yield piece
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        raise ConnectionLost("malformed or truncated response body") from exc
