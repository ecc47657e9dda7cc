"""A sandbox's TCP ports, reached from here through its daemon.

(About 700 lines, one piece: the listener, the dialer and the byte copy share
one connection's state and its ordered shutdown.)

`ExposedPort` listens on a local address (127.0.0.1 and an ephemeral port by
default). Every connection accepted there opens a connection of its own to
the daemon and asks it for the port (`Dialer`); once the daemon has
connected to the port inside the sandbox and said so, bytes are copied both
ways until both directions have ended. A sandbox on ``network="none"``, a
pod, or one reached through the service: whatever reaches its daemon reaches
its ports, authenticated like every other call.

Two wire forms of ``/v1/ports/{port}/connect``:

- straight to a daemon: ``GET`` with ``Connection: Upgrade`` and
  ``Upgrade: tcp``; ``101``, then raw bytes both ways, and an end of one
  direction passed on as a half-close;
- through the service's proxy route: ``POST`` with a chunked body. ASGI cannot
  hand a connection over after a 101 (uvicorn gives an app only websocket
  upgrades), so the route answers ``200`` with a chunked body at once and
  both bodies stream at the same time: the request's carries the bytes to
  the port, the answer's the port's bytes back, and the end of the request
  body is the half-close.

The daemon is not trusted: its answer's head and an error body are read with
a size cap and within a deadline, a chunk-size line is capped, and each
direction stops reading its source while its destination cannot take more
(asyncio's write-buffer water marks), so nothing buffers without bound. The
port is not trusted either: a connection the local side has left (closed,
or half-closed and waiting for an answer) is kept for the port only while
the port goes on sending, ``half_close_timeout`` at most without a byte;
otherwise a port that neither reads nor answers would hold every
connection ever made to it, and their descriptors, until the end. The
listener, the connections and their handshakes all end with `aclose`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from ssl import SSLContext
from types import TracebackType
from typing import Protocol, Self

from sandman._transport import ConnectionLost, check_peer
from sandman.daemon.protocol import error_from_response

__all__ = ["Dialer", "ExposedPort", "Refused", "Upstream"]

logger = logging.getLogger(__name__)

_MAX_HEAD = 64 * 1024  # the answer's status line and headers
_MAX_ERROR = 64 * 1024  # an error answer's body
_MAX_LINE = 1024  # a chunk-size or trailer line
_PROBE_EVERY = 1.0  # seconds between looks at a local connection that is not read
_TCP_CLOSE = 7  # tcp_info's state of a connection reset
_TCP_INFO: int | None = getattr(socket, "TCP_INFO", None)  # Linux only: elsewhere, no looking

# Phases of an upstream connection.
_HEAD = 0  # waiting for the answer's head
_ERROR = 1  # reading an error answer's body
_OPEN = 2  # carrying bytes
_DONE = 3  # refused or failed: nothing more is read
# States of the chunked decoder (the service's form only).
_SIZE = 0
_DATA = 1
_DATA_END = 2
_TRAILER = 3
_END = 4


class Refused(Exception):
    """The daemon (or the service) answered the request for a port with an error."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class Peer(Protocol):
    """What an `Upstream` hands the port's bytes to, and tells of its own state."""

    def deliver(self, data: bytes) -> None:
        """Bytes from the port."""

    def deliver_eof(self) -> None:
        """The port ended its direction."""

    def upstream_lost(self) -> None:
        """The connection to the daemon is closed."""

    def pause_sending(self) -> None:
        """The connection to the daemon takes no more for now: stop calling `Upstream.send`."""

    def resume_sending(self) -> None:
        """It takes more again."""


@dataclass(frozen=True, slots=True)
class Dialer:
    """How to reach one daemon for its ports: its address, headers and wire form.

    ``duplex`` selects the service's form (behind its proxy route); otherwise
    the daemon's own upgrade. ``connect_timeout`` bounds connecting,
    ``handshake_timeout`` the whole exchange up to the daemon's answer (it
    includes the daemon's own connect to the port, at most 10 s).
    """

    uds: str | None = None
    host: str | None = None
    port: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    prefix: str = ""
    ssl: SSLContext | None = None
    peer_pid: int | None = None
    duplex: bool = False
    connect_timeout: float = 10.0
    handshake_timeout: float = 30.0

    def where(self) -> str:
        """The daemon's address, for messages."""
        base = f"unix:{self.uds}" if self.uds is not None else f"tcp:{self.host}:{self.port}"
        return base + self.prefix.rstrip("/")

    def head(self, port: int) -> bytes:
        """The request for ``port``."""
        target = f"{self.prefix.rstrip('/')}/v1/ports/{port}/connect"
        if self.uds is not None:
            host = "sandmand"
        else:
            host = f"[{self.host}]" if self.host and ":" in self.host else str(self.host)
            host += f":{self.port}"
        fixed = {"Host": host, **self.headers}
        lines = [f"{'POST' if self.duplex else 'GET'} {target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in fixed.items()]
        if self.duplex:
            lines += ["Transfer-Encoding: chunked", "Content-Type: application/octet-stream"]
        else:
            lines += ["Connection: Upgrade", "Upgrade: tcp"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def open(self, port: int, peer: Peer) -> Upstream:
        """Connect to the daemon and have it connect to ``port``; the bytes go to ``peer``.

        Raises `Refused` (the daemon's error answer), `ConnectionLost` (an
        answer that is not one), `OSError` (cannot connect, `UntrustedPeer`)
        or `TimeoutError` (no answer within ``handshake_timeout``).
        """
        loop = asyncio.get_running_loop()
        upstream = Upstream(loop, peer, duplex=self.duplex)
        try:
            async with asyncio.timeout(self.handshake_timeout):
                await self._connect(loop, upstream)
                upstream.start(self.head(port))
                await upstream.ready
        except BaseException:
            upstream.abort()
            await upstream.wait_closed()
            if upstream.ready.done() and not upstream.ready.cancelled():
                upstream.ready.exception()  # seen: asyncio need not report it
            raise
        return upstream

    async def _connect(self, loop: asyncio.AbstractEventLoop, upstream: Upstream) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.uds is not None:
                    transport, _ = await loop.create_unix_connection(lambda: upstream, self.uds)
                    if self.peer_pid is not None:
                        check_peer(transport.get_extra_info("socket"), self.peer_pid, self.uds)
                elif self.host is not None and self.port is not None:
                    await loop.create_connection(
                        lambda: upstream, self.host, self.port, ssl=self.ssl
                    )
                else:
                    raise ValueError("a Dialer needs uds, or host and port")
        except TimeoutError:
            raise ConnectionError(
                f"connecting to {self.where()} took more than {self.connect_timeout} s"
            ) from None


class Upstream(asyncio.Protocol):
    """One connection to the daemon carrying one port's bytes; made by `Dialer.open`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: Peer, *, duplex: bool) -> None:
        self._peer = peer
        self._duplex = duplex
        self._transport: asyncio.Transport | None = None
        self._phase = _HEAD
        self._buffer = b""  # a partial head, error body or chunk line
        self._status = 0
        self._error_length: int | None = None
        self._chunk = _SIZE
        self._remaining = 0
        self._sent_eof = False
        self._loop = loop
        self._abort_later: asyncio.TimerHandle | None = None
        self.ready: asyncio.Future[None] = loop.create_future()
        self._closed: asyncio.Future[None] = loop.create_future()

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._phase == _OPEN:
            self._incoming(data)
        elif self._phase == _HEAD:
            self._buffer += data
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD:
                    self._fail("the daemon's answer has a head over 64 KiB")
                return
            head, rest = self._buffer[:end], self._buffer[end + 4 :]
            self._buffer = b""
            try:
                self._head(head)
            except ValueError as exc:
                self._fail(f"malformed answer from the daemon: {exc}")
                return
            if rest:
                self.data_received(rest)
        elif self._phase == _ERROR:
            self._buffer += data
            if self._error_length is not None and len(self._buffer) >= self._error_length:
                self._refuse()
            elif len(self._buffer) > _MAX_ERROR:
                self._fail("the daemon's error answer is over 64 KiB")

    def eof_received(self) -> bool | None:
        if self._phase == _OPEN and not self._duplex:
            self._peer.deliver_eof()
            return True  # the other direction may go on
        if self._phase == _ERROR and self._error_length is None:
            self._refuse()  # its body ran to the close
        elif self._phase == _OPEN and self._chunk != _END:
            self._peer.deliver_eof()  # the service's answer ended short: the port is gone
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionLost("connection closed before the daemon answered"))
        elif self._phase == _OPEN:
            self._peer.upstream_lost()
        if self._abort_later is not None:
            self._abort_later.cancel()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._peer.pause_sending()

    def resume_writing(self) -> None:
        self._peer.resume_sending()

    # -- the answer ---------------------------------------------------------------

    def _head(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"status line {lines[0][:100]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status >= 400:
            self._status = status
            length = headers.get("content-length")
            if length is not None:
                if not length.isdigit() or int(length) > _MAX_ERROR:
                    raise ValueError(f"error body of length {length[:20]!r}")
                self._error_length = int(length)
            self._phase = _ERROR
            if self._error_length == 0:
                self._refuse()
            return
        expected = 200 if self._duplex else 101
        if status != expected:
            raise ValueError(f"status {status}, expected {expected}")
        if self._duplex and "chunked" not in headers.get("transfer-encoding", "").lower():
            raise ValueError("the service's answer is not chunked")
        self._phase = _OPEN
        self.ready.set_result(None)

    def _refuse(self) -> None:
        body = self._buffer if self._error_length is None else self._buffer[: self._error_length]
        self._buffer = b""
        self._phase = _DONE
        if not self.ready.done():
            self.ready.set_exception(Refused(self._status, body))
        self.abort()

    def _fail(self, message: str) -> None:
        self._phase = _DONE
        if not self.ready.done():
            self.ready.set_exception(ConnectionLost(message))
        self.abort()

    def _incoming(self, data: bytes) -> None:
        if not self._duplex:
            self._peer.deliver(data)
            return
        # The service's chunked answer, decoded as it comes; nothing is kept
        # but a partial line (capped).
        if self._buffer:
            data, self._buffer = self._buffer + data, b""
        pos, end = 0, len(data)
        while pos < end:
            if self._chunk == _DATA:
                take = min(self._remaining, end - pos)
                self._peer.deliver(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk = _DATA_END
            elif self._chunk == _END:
                return  # nothing follows the last chunk
            else:
                stop = data.find(b"\r\n", pos)
                if stop < 0:
                    self._buffer = data[pos:]
                    if len(self._buffer) > _MAX_LINE:
                        self._fail("a chunk line over 1 KiB")
                    return
                line, pos = data[pos:stop], stop + 2
                if self._chunk == _DATA_END:
                    if line:
                        self._fail("a chunk not followed by CRLF")
                        return
                    self._chunk = _SIZE
                elif self._chunk == _TRAILER:
                    if not line:
                        self._chunk = _END
                        self._peer.deliver_eof()
                else:
                    size = line.split(b";", 1)[0].strip()
                    try:
                        self._remaining = int(size, 16)
                    except ValueError:
                        self._fail(f"chunk size {size[:20]!r}")
                        return
                    if self._remaining < 0:
                        self._fail("a negative chunk size")
                        return
                    self._chunk = _DATA if self._remaining else _TRAILER

    # -- used by the peer ------------------------------------------------------------

    def start(self, head: bytes) -> None:
        assert self._transport is not None
        self._transport.write(head)

    def send(self, data: bytes) -> None:
        """Bytes for the port."""
        if self._transport is None or self._sent_eof:
            return
        if self._duplex:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._transport.write(data)

    def send_eof(self) -> None:
        """End the direction to the port (a half-close)."""
        if self._transport is None or self._sent_eof or self._transport.is_closing():
            return
        self._sent_eof = True
        if self._duplex:
            self._transport.write(b"0\r\n\r\n")
        elif self._transport.can_write_eof():
            self._transport.write_eof()
        # Over TLS there is no half-close: the direction stays open until the end.

    def pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def close(self, grace: float | None = None) -> None:
        """Close once what is buffered for the daemon is sent; with ``grace``,
        abort if that takes longer (a port that stopped reading never takes it)."""
        if self._transport is None or self._closed.done():
            return
        self._transport.close()
        if grace is not None and self._abort_later is None:
            self._abort_later = self._loop.call_later(grace, self.abort)

    def abort(self) -> None:
        """Close now, dropping what is buffered."""
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self) -> None:
        """Return once the connection is closed (at once if it never opened)."""
        if self._transport is not None:
            await asyncio.shield(self._closed)


class _Local(asyncio.Protocol):
    """One connection accepted by an `ExposedPort`, joined to its own `Upstream`."""

    def __init__(self, exposed: ExposedPort) -> None:
        self._exposed = exposed
        self._transport: asyncio.Transport | None = None
        self._upstream: Upstream | None = None
        self._opening: asyncio.Task[None] | None = None
        self._upstream_full = False  # the daemon's connection takes no more for now
        self._local_full = False  # this connection takes no more for now
        self._got_eof = False  # the local side ended its direction
        self._sent_eof = False  # the port ended its direction
        self._idle: asyncio.TimerHandle | None = None  # half-closed: the port's time to answer
        self._probe: asyncio.TimerHandle | None = None  # while not read: is it still there?
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol (the local connection) ----------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._exposed.closed:
            transport.abort()
            return
        transport.pause_reading()  # until the port is reached
        self._exposed._locals.add(self)
        self._opening = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        exposed = self._exposed
        try:
            upstream = await exposed._dialer.open(exposed.remote_port, self)
        except Exception as exc:  # noqa: BLE001 - each failure ends this one connection
            exposed._failed(exc)
            self.abort()
            return
        assert self._transport is not None
        if self._transport.is_closing():
            upstream.abort()  # the local side left during the handshake
            return
        self._upstream = upstream
        exposed._upstreams.add(upstream)
        if self._local_full:
            upstream.pause_reading()
        self._update_reading()
        if self._got_eof:
            upstream.send_eof()
            self._wait_for_port()

    def data_received(self, data: bytes) -> None:
        if self._upstream is not None:
            self._upstream.send(data)

    def eof_received(self) -> bool | None:
        self._got_eof = True
        if self._upstream is not None:
            self._upstream.send_eof()
            self._wait_for_port()
        self._end_if_both()
        return True  # the port's answer may still come

    def connection_lost(self, exc: Exception | None) -> None:
        self._exposed._locals.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self._probe is not None:
            self._probe.cancel()
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._upstream is not None:
            # After what the local side sent last, if the port takes it in time.
            self._upstream.close(self._exposed.half_close_timeout)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._local_full = True
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_writing(self) -> None:
        self._local_full = False
        if self._upstream is not None:
            self._upstream.resume_reading()

    # -- Peer (the daemon's side) -----------------------------------------------------

    def deliver(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
        if self._idle is not None:
            self._wait_for_port()  # it answers: its time starts again

    def deliver_eof(self) -> None:
        self._sent_eof = True
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write_eof()
        self._end_if_both()

    def upstream_lost(self) -> None:
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            self._exposed._upstreams.discard(upstream)
        if self._transport is not None:
            self._transport.close()  # after what the port sent last

    def pause_sending(self) -> None:
        self._upstream_full = True
        self._update_reading()

    def resume_sending(self) -> None:
        self._upstream_full = False
        self._update_reading()

    # -- helpers ---------------------------------------------------------------------

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing() or self._upstream is None:
            return
        if self._upstream_full:
            transport.pause_reading()
            if self._probe is None and _TCP_INFO is not None:
                self._probe = asyncio.get_running_loop().call_later(_PROBE_EVERY, self._look)
        else:
            transport.resume_reading()
            if self._probe is not None:
                self._probe.cancel()
                self._probe = None

    def _look(self) -> None:
        """A connection not read is not watched: a reset of its local side
        would go unnoticed for as long as the port takes nothing, keeping it
        and its connection to the daemon. So look at its state now and then."""
        self._probe = None
        transport = self._transport
        if transport is None or transport.is_closing() or not self._upstream_full:
            return
        sock = transport.get_extra_info("socket")
        assert _TCP_INFO is not None
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 1)[0]
        except OSError:
            state = _TCP_CLOSE
        if state == _TCP_CLOSE:
            self.abort()
            return
        self._probe = asyncio.get_running_loop().call_later(_PROBE_EVERY, self._look)

    def _wait_for_port(self) -> None:
        """(Re)arm the half-closed connection's deadline: the local side has
        ended its direction (maybe closed: TCP cannot tell), the port has not."""
        timeout = self._exposed.half_close_timeout
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if timeout is not None and not self._sent_eof:
            self._idle = asyncio.get_running_loop().call_later(timeout, self._port_silent)

    def _port_silent(self) -> None:
        self._idle = None
        timeout = self._exposed.half_close_timeout
        self._exposed._failed(
            TimeoutError(f"the port sent nothing for {timeout} s after the local side ended")
        )
        self.abort()

    def _end_if_both(self) -> None:
        if self._got_eof and self._sent_eof:
            if self._transport is not None:
                self._transport.close()
            if self._upstream is not None:
                self._upstream.close(self._exposed.half_close_timeout)

    def abort(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._upstream is not None:
            self._upstream.abort()
        if self._transport is not None:
            self._transport.abort()


class ExposedPort:
    """A TCP port inside a sandbox, reachable here at `url` (made by ``expose``).

    Every connection to ``host:port`` is carried to the sandbox's port
    through its daemon. Close it with `aclose` (or `close` from another
    thread, as the blocking `Sandbox` does), or use it as a context manager;
    it is closed with the sandbox (or daemon client) it came from.
    """

    def __init__(
        self, dialer: Dialer, remote_port: int, *, half_close_timeout: float | None = 30.0
    ) -> None:
        self._dialer = dialer
        self.remote_port = remote_port
        """The port inside the sandbox."""
        self.half_close_timeout = half_close_timeout
        """Seconds a connection the local side has ended stays open while the port sends
        nothing (None: for as long as the port keeps it)."""
        self.host = ""
        """The local address it listens on."""
        self.port = 0
        """The local port it listens on."""
        self.closed = False
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._locals: set[_Local] = set()
        self._upstreams: set[Upstream] = set()
        self._last_failure: str | None = None

    @classmethod
    async def start(
        cls,
        dialer: Dialer,
        remote_port: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        half_close_timeout: float | None = 30.0,
    ) -> Self:
        """Listen on ``host:port`` (0: an ephemeral port) for ``remote_port`` of the daemon's sandbox."""
        exposed = cls(dialer, remote_port, half_close_timeout=half_close_timeout)
        loop = exposed._loop = asyncio.get_running_loop()
        exposed._server = await loop.create_server(lambda: _Local(exposed), host, port)
        sockname = exposed._server.sockets[0].getsockname()
        exposed.host, exposed.port = sockname[0], sockname[1]
        return exposed

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<ExposedPort {self.url} -> port {self.remote_port}{state}>"

    @property
    def url(self) -> str:
        """``http://host:port``: where to point an HTTP client."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections being carried now."""
        return len(self._locals)

    @property
    def last_failure(self) -> str | None:
        """Why the last connection that could not reach the port did not (None: none failed)."""
        return self._last_failure

    def _failed(self, exc: Exception) -> None:
        # A connection cannot carry an error: it is closed, and the reason kept and logged.
        if isinstance(exc, Refused):
            error = error_from_response(exc.status, exc.body)
            reason = f"{error.code}: {error.message}"
            quiet = error.code in ("connection_refused", "connect_timeout")
        else:
            reason = f"{type(exc).__name__}: {exc}"
            quiet = False
        self._last_failure = reason
        log = logger.debug if quiet else logger.warning
        log(
            "port %d at %s: a connection was closed: %s",
            self.remote_port,
            self._dialer.where(),
            reason,
        )

    async def aclose(self) -> None:
        """Stop listening and close every connection it carries. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._server is not None:
            self._server.close()
        locals_, upstreams = list(self._locals), list(self._upstreams)
        opening = [x._opening for x in locals_ if x._opening is not None]
        for local in locals_:
            local.abort()
        for upstream in upstreams:
            upstream.abort()
        await asyncio.gather(*opening, return_exceptions=True)
        await asyncio.gather(*(x.closed for x in locals_), *(x.wait_closed() for x in upstreams))
        if self._server is not None:
            await self._server.wait_closed()

    def close(self) -> None:
        """`aclose` from a thread other than the event loop's (the blocking `Sandbox`'s users)."""
        loop = self._loop
        if self.closed or loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("ExposedPort.close() on its own event loop: await aclose() instead")
        asyncio.run_coroutine_threadsafe(self.aclose(), loop).result()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
