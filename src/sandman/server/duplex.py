"""A sandbox's port carried over one HTTP exchange of the service, both ways at once.

ASGI hands an app no connection after a ``101``: uvicorn (httptools) gives it
only websocket upgrades, answers the bytes behind any other upgrade request
with ``400 Invalid HTTP request``, and h11 refuses to send a ``101`` at all.
So the proxy route takes the port's traffic as a full-duplex ``POST``: the
request's chunked body carries the caller's bytes to the port while the
answer's chunked body carries the port's bytes back, both streaming at the
same time (uvicorn delivers body chunks as they arrive, whether or not the
answer has started). The end of the request body is the caller's half-close;
the end of the answer is the port's. The service itself reaches the daemon
with the daemon's own upgrade (`sandman.daemon.tunnel`).

Bounded: what the port sends waits in a queue of at most ``_HIGH_WATER``
bytes before the daemon's connection stops being read, and the caller's
bytes are taken only while the daemon's connection takes them.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandman.daemon.tunnel import Dialer, Upstream

__all__ = ["DuplexResponse"]

_HIGH_WATER = 256 * 1024


class DuplexResponse(Response):
    """The answer to a port request; also the `Peer` of its connection to the daemon."""

    def __init__(self) -> None:
        super().__init__(status_code=200, media_type="application/octet-stream")
        self._upstream: Upstream | None = None
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._eof = False  # the port ended its direction, or the daemon's connection closed
        self._reading_paused = False
        self._arrived = asyncio.Event()  # something for the caller, or the end
        self._sendable = asyncio.Event()  # the daemon's connection takes bytes
        self._sendable.set()

    async def open(self, dialer: Dialer, port: int) -> None:
        """Reach ``port`` through the daemon (`Dialer.open`: its errors are raised)."""
        self._upstream = await dialer.open(port, self)

    # -- Peer -------------------------------------------------------------------------

    def deliver(self, data: bytes) -> None:
        self._queue.append(data)
        self._queued += len(data)
        self._arrived.set()
        if self._queued > _HIGH_WATER and not self._reading_paused and self._upstream:
            self._reading_paused = True
            self._upstream.pause_reading()

    def deliver_eof(self) -> None:
        self._eof = True
        self._arrived.set()

    def upstream_lost(self) -> None:
        self._eof = True
        self._arrived.set()
        self._sendable.set()  # nobody waits for a connection that is gone

    def pause_sending(self) -> None:
        self._sendable.clear()

    def resume_sending(self) -> None:
        self._sendable.set()

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = self._upstream
        assert upstream is not None, "open() first"
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/octet-stream"),
                        (b"cache-control", b"no-store"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            tasks = (
                asyncio.ensure_future(self._to_caller(send)),
                asyncio.ensure_future(self._to_port(receive, upstream)),
            )
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    raise outcome
        finally:
            # The answer is complete (the port's end) or the caller left: either
            # way nothing more goes through this connection.
            upstream.abort()
            await upstream.wait_closed()

    async def _to_caller(self, send: Send) -> None:
        upstream = self._upstream
        assert upstream is not None
        while True:
            while self._queue:
                piece = self._queue.popleft()
                self._queued -= len(piece)
                if self._reading_paused and self._queued <= _HIGH_WATER // 4:
                    self._reading_paused = False
                    upstream.resume_reading()
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if self._eof:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            self._arrived.clear()
            await self._arrived.wait()

    async def _to_port(self, receive: Receive, upstream: Upstream) -> None:
        """Carry the request's body to the port; return when the caller has left."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            if body:
                await self._sendable.wait()
                upstream.send(body)
            if not message.get("more_body", False):
                upstream.send_eof()
                # Nothing more comes but the news that the caller left.
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
