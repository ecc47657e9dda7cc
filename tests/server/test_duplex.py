"""The service's full-duplex answer for a port, on its own: bounded, and nothing left
once the caller leaves (issue 16, gap 6)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from sandman.server.duplex import DuplexResponse

pytestmark = pytest.mark.anyio


class _Upstream:
    """What the answer asks of its connection to the daemon."""

    def __init__(self) -> None:
        self.paused = False
        self.sent: list[bytes] = []
        self.eof = False
        self.aborted = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def send_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.aborted = True

    async def wait_closed(self) -> None:
        pass


async def test_what_the_port_sends_waits_bounded_while_the_caller_does_not_read() -> None:
    response = DuplexResponse()
    upstream = _Upstream()
    response._upstream = upstream  # type: ignore[assignment]
    reading = asyncio.Event()  # the caller reads once this is set
    bodies: list[bytes] = []
    left = asyncio.Event()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            await reading.wait()
            bodies.append(message["body"])

    async def receive() -> Message:
        await left.wait()
        return {"type": "http.disconnect"}

    answering = asyncio.ensure_future(response({"type": "http"}, receive, send))
    for _ in range(16):
        response.deliver(b"x" * 65536)  # 1 MiB the caller does not take
    assert upstream.paused  # the daemon's connection is not read past 256 KiB
    reading.set()
    async with asyncio.timeout(10):
        while sum(map(len, bodies)) < 16 * 65536:
            await asyncio.sleep(0.001)
    assert not upstream.paused
    left.set()  # the caller leaves: the daemon's connection goes too
    await asyncio.wait_for(answering, 10)
    assert upstream.aborted


async def test_the_callers_bytes_and_half_close_reach_the_port() -> None:
    response = DuplexResponse()
    upstream = _Upstream()
    response._upstream = upstream  # type: ignore[assignment]
    messages: asyncio.Queue[Message] = asyncio.Queue()
    for body, more in ((b"one", True), (b"two", False)):
        messages.put_nowait({"type": "http.request", "body": body, "more_body": more})
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    answering = asyncio.ensure_future(response({"type": "http"}, messages.get, send))
    async with asyncio.timeout(10):
        while not upstream.eof:
            await asyncio.sleep(0.001)
    assert upstream.sent == [b"one", b"two"]
    response.deliver(b"answer")
    response.deliver_eof()  # the port's end ends the answer
    await asyncio.wait_for(answering, 10)
    assert [m.get("body") for m in sent[1:]] == [b"answer", b""]
    assert sent[-1]["more_body"] is False and upstream.aborted
