"""The lean HTTP/1.1 transport: unix socket or TCP, keep-alive, peer-checked.

The daemon protocol is a handful of small requests on a latency budget of a
fraction of a millisecond; general clients (httpx) spend several times the
cost of the command itself per call (``benchmarks/latency.py`` measures both).
This one does only what sandmand and the service need: one request at a time
per connection, Content-Length or chunked bodies, and a pool of idle
connections.

Each connection is an `asyncio.Protocol` that parses the response as bytes
arrive, inside ``data_received``: a small answer (head and body in one read)
costs the caller a single wake-up, where StreamReader's readuntil/read pair
costs a wake-up or buffer copy per step.

It keeps the seam's contract (`sandman._transport.base`): `ConnectionLost`
for a broken connection or an answer that is not HTTP, `OSError` from
connecting, nothing else.
"""

from __future__ import annotations

import asyncio
import re
import ssl as _ssl
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import AbstractAsyncContextManager

from sandman._transport.base import ConnectionLost, Response, check_peer

__all__ = ["HTTPTransport", "StreamingResponse"]

_MAX_HEAD = 64 * 1024
# A chunk size fits in 64 bits; more digits is an overflow, not a large chunk.
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?", re.DOTALL)
_STATUS_LINE = re.compile(r"HTTP/1\.[01] ([1-5][0-9][0-9])(?: |\Z)")
# A trailer line is a header field (RFC 9110 token ":" value); a partial one must be
# able to become one, so that a malformed tail is refused as it arrives.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_FIELD = _TOKEN + rb"+:[\t\x20-\x7e\x80-\xff]*"
_TRAILER_LINE = re.compile(_FIELD)
_TRAILER_PREFIX = re.compile(rb"\r|" + _TOKEN + rb"*|" + _FIELD + rb"\r?")
_MAX_LENGTH_DIGITS = 18  # Content-Length below 10**18
# Unread body bytes a connection buffers before it stops reading the socket
# (back-pressure for large downloads read slowly).
_HIGH_WATER = 256 * 1024

# Parser states of a connection.
_IDLE = 0  # no exchange in flight; any byte is a protocol error
_HEAD = 1  # waiting for the status line and headers
_LENGTH = 2  # Content-Length body, ``_remaining`` bytes to go
_CHUNK_SIZE = 3  # chunked body: the next chunk-size line
_CHUNK_DATA = 4  # chunked body: ``_remaining`` bytes of chunk data
_CHUNK_END = 5  # chunked body: the CRLF closing a chunk
_TRAILER = 6  # chunked body: trailer lines up to an empty line
_UNTIL_CLOSE = 7  # body delimited by the server closing the connection
_DONE = 8  # the whole response arrived


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the incremental parser of its responses.

    The protocol callbacks fill ``_pieces`` (body bytes, de-chunked) and move
    ``_state``; the one task using the connection waits on ``_waiter``, which
    is woken only when something it can use arrived: the head, body bytes,
    the end of the body, or a failure.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._state = _IDLE
        self._rest = b""  # unparsed bytes: a partial head, chunk-size line or CRLF
        self._remaining = 0
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._no_body = False
        self._got_bytes = False
        self._error: str | None = None
        self._lost = False
        self._reading_paused = False
        self._writing_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.reused = False

    # -- asyncio.Protocol callbacks ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        if self._state in (_IDLE, _DONE):
            # Bytes nobody asked for: the connection can't be trusted again.
            self.close()
            return
        if self._rest:
            data, self._rest = self._rest + data, b""
        try:
            progressed = self._parse(data)
        except ValueError as exc:
            self._fail(f"malformed response: {exc}")
            return
        if progressed:
            self._wake()
        if (
            self._buffered > _HIGH_WATER
            and not self._reading_paused
            and self._transport is not None
        ):
            self._reading_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close our end too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state == _HEAD:
            self._error = "connection closed before a response"
        elif self._state not in (_IDLE, _DONE):
            self._error = "connection closed mid-body"
        self._wake()
        drain, self._drain_waiter = self._drain_waiter, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drain, self._drain_waiter = self._drain_waiter, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- the parser ------------------------------------------------------------

    def _parse(self, data: bytes) -> bool:
        """Consume ``data``; true if the waiting task has something new."""
        progressed = False
        pos = 0
        end = len(data)
        while True:
            state = self._state
            if state in (_LENGTH, _CHUNK_DATA):
                if pos == end:
                    return progressed
                take = min(self._remaining, end - pos)
                self._push(data if take == end and pos == 0 else data[pos : pos + take])
                progressed = True
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _DONE if state == _LENGTH else _CHUNK_END
            elif state == _HEAD:
                stop = data.find(b"\r\n\r\n", pos)
                if stop < 0:
                    if end - pos > _MAX_HEAD:
                        raise ValueError("response head too large")
                    self._rest = data[pos:]
                    return progressed
                if stop - pos > _MAX_HEAD:
                    raise ValueError("response head too large")
                self._parse_head(data[pos:stop])
                pos = stop + 4
                # Still _HEAD after an interim (1xx) answer: nothing for the task yet.
                progressed = progressed or self._state != _HEAD
            elif state in (_CHUNK_SIZE, _TRAILER):
                stop = data.find(b"\r\n", pos)
                if stop < 0:
                    if end - pos > _MAX_HEAD:
                        raise ValueError("chunk line too long")
                    if state == _TRAILER and not _TRAILER_PREFIX.fullmatch(data, pos, end):
                        raise ValueError(f"malformed trailer {data[pos : pos + 40]!r}")
                    self._rest = data[pos:]
                    return progressed
                line = data[pos:stop]
                pos = stop + 2
                if state == _TRAILER:
                    if not line:  # sandmand sends no trailers; others are skipped
                        self._state = _DONE
                        progressed = True
                    elif not _TRAILER_LINE.fullmatch(line):
                        raise ValueError(f"malformed trailer {line[:40]!r}")
                    continue
                match = _CHUNK_SIZE_LINE.fullmatch(line)
                if match is None:
                    raise ValueError(f"bad chunk size line {line[:40]!r}")
                size = int(match[1], 16)
                self._remaining = size
                self._state = _CHUNK_DATA if size else _TRAILER
            elif state == _CHUNK_END:
                if end - pos < 2:
                    self._rest = data[pos:]
                    return progressed
                if data[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _UNTIL_CLOSE:
                if pos < end:
                    self._push(data[pos:] if pos else data)
                    progressed = True
                return progressed
            else:  # _DONE
                if pos < end:
                    # Bytes past the response: it stands, the connection does not.
                    self.close()
                return progressed

    def _parse_head(self, raw: bytes) -> None:
        """The status line and headers; the body's framing. Strict where framing is
        decided: what a lenient reading could frame wrong is refused (ValueError)."""
        lines = raw.decode("latin-1").split("\r\n")
        match = _STATUS_LINE.match(lines[0])
        if match is None:
            raise ValueError(f"malformed status line {lines[0][:100]!r}")
        status = int(match[1])
        if status < 200:
            if status == 101:
                raise ValueError("101 Switching Protocols, which nothing asked for")
            return  # interim (100 Continue, 103 Early Hints): the answer follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            name = name.strip().lower()
            if not colon or not name:
                raise ValueError(f"malformed header line {line[:100]!r}")
            value = value.strip()
            if name not in headers:
                headers[name] = value
            elif name == "content-length":
                if value != headers[name]:
                    raise ValueError("conflicting Content-Length headers")
            else:  # repeated: one comma-separated list (RFC 9110 5.3)
                headers[name] = f"{headers[name]}, {value}"
        self.status = status
        self.headers = headers
        if self._no_body or status in (204, 304):
            self._state = _DONE
        elif "transfer-encoding" in headers:
            # Nothing asked for another coding (no TE header is sent), and with a
            # Content-Length beside it, the answer is ambiguous (RFC 9112 6.3).
            if headers["transfer-encoding"].lower() != "chunked" or "content-length" in headers:
                raise ValueError(f"unsupported framing {headers['transfer-encoding']!r}")
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not (length.isascii() and length.isdigit() and len(length) <= _MAX_LENGTH_DIGITS):
                raise ValueError(f"bad Content-Length {length[:40]!r}")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE
        else:
            self._state = _UNTIL_CLOSE

    def _push(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._buffered += len(piece)

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = message
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- used by the transport's task ------------------------------------------

    def usable(self) -> bool:
        return (
            not self._lost
            and self._error is None
            and self._state == _DONE
            and self._transport is not None
            and not self._transport.is_closing()
        )

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def send(self, data: bytes, *, no_body: bool) -> None:
        """Start an exchange: reset the parser, then write ``data`` (head and maybe body)."""
        assert self._transport is not None
        if self._lost or self._error is not None:
            raise ConnectionLost(self._error or "connection closed")
        self._state = _HEAD
        self._no_body = no_body
        self._got_bytes = False
        self._transport.write(data)

    def write(self, data: bytes) -> None:
        assert self._transport is not None
        self._transport.write(data)

    async def drain(self) -> None:
        """Wait while the socket's send buffer is full (for streamed request bodies)."""
        if self._writing_paused and not self._lost:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter
        if self._lost:
            raise ConnectionLost(self._error or "connection closed while sending")

    # The readers below are plain methods that say whether to `wait` rather
    # than coroutines that wait themselves: when the answer is already here,
    # as it mostly is, no coroutine is created at all.

    def head_arrived(self) -> bool:
        """True once ``status`` and ``headers`` are set; raises if the connection broke."""
        if self._state != _HEAD:
            return True
        if self._error is not None:
            raise ConnectionLost(self._error)
        return False

    def take(self) -> bytes | None:
        """The next piece of body; ``b""`` if none arrived yet, None at the end of the body."""
        if self._pieces:
            piece = self._pieces.popleft()
            self._buffered -= len(piece)
            if self._reading_paused and self._buffered <= _HIGH_WATER // 4:
                self._reading_paused = False
                if self._transport is not None:
                    self._transport.resume_reading()
            return piece
        if self._error is not None:
            raise ConnectionLost(self._error)
        return None if self._state == _DONE else b""

    async def wait(self) -> None:
        """Wait until the protocol callbacks bring something new (or a failure)."""
        self._waiter = self._loop.create_future()
        await self._waiter

    def got_bytes(self) -> bool:
        return self._got_bytes


class StreamingResponse:
    """A response whose body is read as it arrives."""

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        self._done = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """Yield the body in pieces as they arrive."""
        conn = self._conn
        while (piece := conn.take()) is not None:
            if piece:
                yield piece
            else:
                await conn.wait()
        self._done = True

    async def read(self) -> bytes:
        # Through iter_bytes, so that a wrapper replacing it sees every byte.
        pieces = []
        async for piece in self.iter_bytes():
            pieces.append(piece)  # noqa: PERF401 - an async comprehension costs a coroutine more
        return b"".join(pieces)


class HTTPTransport:
    """Keep-alive HTTP/1.1 to one address: ``uds`` path, or ``host`` and ``port``.

    ``prefix`` is put before every request target (a daemon reached through a
    gateway such as the service's proxy route); ``ssl`` speaks TLS over TCP.
    ``connect_timeout`` bounds opening a connection, whatever the request's own
    deadline (a call without one must not hang on an address that drops SYNs).
    With ``peer_pid``, a unix-socket connection whose peer is another process
    is closed at once (UntrustedPeer).
    """

    def __init__(
        self,
        *,
        uds: str | None = None,
        host: str | None = None,
        port: int | None = None,
        default_headers: dict[str, str] | None = None,
        max_idle: int = 32,
        prefix: str = "",
        ssl: _ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
        peer_pid: int | None = None,
    ) -> None:
        if (uds is None) == (host is None or port is None):
            raise ValueError("give either uds, or host and port")
        self._connect_timeout = connect_timeout
        self._peer_pid = peer_pid
        self._uds = uds
        self._tcp = (host, port) if host is not None and port is not None else None
        self._prefix = prefix.rstrip("/")
        self._ssl = ssl
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False
        authority = "sandmand" if uds is not None else f"{host}:{port}"
        fixed = {"Host": authority, **(default_headers or {})}
        self._fixed_head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")

    def __repr__(self) -> str:
        where = f"unix:{self._uds}" if self._tcp is None else "tcp:{}:{}".format(*self._tcp)
        return f"HTTPTransport({where + self._prefix!r})"

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> Response:
        """Send one request and read the whole response."""
        async with self.stream(method, target, body=body, content_type=content_type) as response:
            data = await response.read()
            return Response(response.status, response.headers, data)

    def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | AsyncIterable[bytes] | None = None,
        content_type: str | None = None,
    ) -> AbstractAsyncContextManager[StreamingResponse]:
        """Send one request; the response body is read from the yielded object.

        The connection goes back to the pool only if the body was read to its
        end; a cancelled or abandoned exchange closes it, so no half-read
        response is ever seen by the next request.
        """
        return _Exchange(self, method, target, body, content_type)

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
    ) -> _Connection:
        head = self._head(method, target, body, content_type)
        no_body = method == "HEAD"
        # A streamed body cannot be sent again once read: it never goes on a
        # kept-alive connection the daemon may have closed while idle.
        replayable = body is None or isinstance(body, bytes)
        while True:
            conn = (self._idle_connection() if replayable else None) or await self._connect()
            try:
                if body is None or isinstance(body, bytes):
                    # One write of one buffer: one send() syscall, one packet.
                    conn.send(head + body if body else head, no_body=no_body)
                else:
                    conn.send(head, no_body=no_body)
                    async for piece in body:
                        if piece:
                            conn.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                            await conn.drain()
                    conn.write(b"0\r\n\r\n")
                while not conn.head_arrived():
                    await conn.wait()
            except BaseException as exc:
                conn.close()
                # A kept-alive connection the daemon closed while idle fails
                # before any byte of an answer: safe to send once more, fresh.
                if conn.reused and isinstance(exc, ConnectionLost) and not conn.got_bytes():
                    continue
                raise
            return conn

    def _head(
        self,
        method: str,
        target: str,
        body: bytes | AsyncIterable[bytes] | None,
        content_type: str | None,
    ) -> bytes:
        line = f"{method} {self._prefix}{target} HTTP/1.1\r\n"
        parts = [line.encode("latin-1"), self._fixed_head]
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

    def _idle_connection(self) -> _Connection | None:
        if self._closed:
            raise ConnectionLost("transport is closed")
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                # asyncio sets TCP_NODELAY on TCP sockets itself.
                if self._tcp is not None:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(loop), *self._tcp, ssl=self._ssl
                    )
                else:
                    transport, conn = await loop.create_unix_connection(
                        lambda: _Connection(loop), self._uds
                    )
                    if self._peer_pid is not None:
                        try:
                            check_peer(
                                transport.get_extra_info("socket"), self._peer_pid, str(self._uds)
                            )
                        except BaseException:
                            transport.close()
                            raise
        except TimeoutError:
            # A ConnectionError (an OSError), not a TimeoutError: callers report
            # "cannot reach", not "did not answer within <their deadline>".
            where = self._uds or "{}:{}".format(*(self._tcp or ("?", "?")))
            raise ConnectionError(
                f"connecting to {where} took more than {self._connect_timeout} s"
            ) from None
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self._max_idle or not conn.usable():
            conn.close()
        else:
            self._idle.append(conn)


class _Exchange(AbstractAsyncContextManager[StreamingResponse]):
    """`HTTPTransport.stream` as a plain class: cheaper than @asynccontextmanager."""

    __slots__ = ("_args", "_conn", "_response", "_transport")

    def __init__(
        self,
        transport: HTTPTransport,
        method: str,
        target: str,
        body: bytes | AsyncIterable[bytes] | None,
        content_type: str | None,
    ) -> None:
        self._transport = transport
        self._args = (method, target, body, content_type)
        self._response: StreamingResponse | None = None

    async def __aenter__(self) -> StreamingResponse:
        conn = await self._transport._exchange(*self._args)
        self._response = StreamingResponse(conn, conn.status, conn.headers)
        return self._response

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        response = self._response
        assert response is not None
        conn = response._conn
        if (
            exc_type is None
            and response._done
            and response.headers.get("connection", "").lower() != "close"
        ):
            self._transport._release(conn)
        else:
            conn.close()
