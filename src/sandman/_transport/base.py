"""The transport seam: what `DaemonClient` and `RemoteBackend` ask of HTTP.

Modelled on httpx's ``AsyncBaseTransport``: one ``request``/``stream`` pair
and ``aclose``. A transport is bound to one address and carries its own
fixed headers (authorization) and path prefix; callers give a method, a
request target (path and query), and maybe a body.

The contract every implementation keeps, and callers rely on:

- a failure of the connection, or an answer that is not HTTP, raises
  `ConnectionLost`; a connection that cannot be made raises `OSError`
  (`UntrustedPeer` among them); nothing else leaves a transport;
- deadlines belong to the caller (``asyncio.timeout`` around the call); a
  cancelled exchange leaves nothing behind that the next one could read;
- header names are lower-case in the answers.

Implementations: `sandman._transport.lean.HTTPTransport` (the hand-written
HTTP/1.1 of the hot path) and `sandman._transport.bridge.HttpxTransport`
(any httpx transport: ``MockTransport``, ``ASGITransport``, a unix socket).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "AsyncTransport",
    "ConnectionLost",
    "Response",
    "ResponseStream",
    "UntrustedPeer",
    "check_peer",
    "iter_lines",
]


class ConnectionLost(Exception):
    """The connection closed or broke before a whole response arrived, or the answer is not HTTP."""


class UntrustedPeer(ConnectionError):
    """The process at the other end of a unix socket is not the one expected."""


@dataclass(slots=True)
class Response:
    """A whole answer: status, headers (lower-case names), body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class ResponseStream(Protocol):
    """An answer whose body is read as it arrives (inside `AsyncTransport.stream`)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces as they arrive; `ConnectionLost` if it is cut short."""
        ...

    async def read(self) -> bytes:
        """The rest of the body."""
        ...


class AsyncTransport(Protocol):
    """HTTP requests to one address (see the module's docstring for the contract)."""

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> Response:
        """Send one request and read the whole answer."""
        ...

    def stream(
        self,
        method: str,
        target: str,
        *,
        body: bytes | AsyncIterable[bytes] | None = None,
        content_type: str | None = None,
    ) -> AbstractAsyncContextManager[ResponseStream]:
        """Send one request (the body may be streamed); read the answer inside the block.

        Leaving the block before the body's end gives up the exchange (its
        connection is not reused).
        """
        ...

    async def aclose(self) -> None:
        """Close the connections; the transport is not used afterwards."""
        ...


async def iter_lines(response: ResponseStream) -> AsyncIterator[bytes]:
    """The body line by line (without the newline), as lines complete."""
    pending = b""
    async for piece in response.iter_bytes():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def check_peer(sock: socket.socket, expected_pid: int, where: str) -> None:
    """Raise UntrustedPeer unless ``sock``'s peer (SO_PEERCRED) is process ``expected_pid``.

    For a unix stream socket the kernel records the process that called
    listen(2); only the daemon itself does that on a sandbox's socket.
    """
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if pid != expected_pid:
        raise UntrustedPeer(
            f"the peer at {where} is process {pid} (uid {uid}), not the sandbox's daemon "
            f"(pid {expected_pid}): refusing to talk to it"
        )
