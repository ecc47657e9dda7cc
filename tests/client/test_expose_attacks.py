"""``expose`` against a hostile sandbox (docs/security.md): the workload that
listens on an exposed port is root in its sandbox and may answer anything, or
nothing. Whatever it does, the client's memory stays bounded, its call ends
within its own timeout (a typed error or a clean end of stream), the daemon
keeps answering other calls, and nothing is left after the release. Straight
to the daemon and through the service's full-duplex proxy route, on the real
local provider, each sandbox without a network."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

import sandman
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.server import ApiKey, ServerSettings, create_app
from sandman.settings import LocalConfig
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import serve_in_thread
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

KEY = "sk-sandman-test-key-attacks-0123456789"
# What the client's process may grow by while the sandbox attacks: a few of
# asyncio's write buffers and socket reads, nowhere near what the flood sends
# (tens of MiB get through before the kernel's buffers are full).
HEAP_BOUND = 16 * 1024 * 1024
TIMEOUT = 2.0  # the client's own timeout in each call


@pytest.fixture(params=["direct", "proxied"])
async def client(
    request: pytest.FixtureRequest, imported: LocalProvider, local_state: Path
) -> AsyncIterator[sandman.AsyncClient]:
    """``sandman.local``, or a client of a service (on the same local provider)
    that reaches the daemon only through the proxy route."""
    if request.param == "direct":
        async with sandman.local(state_dir=local_state) as direct:
            yield direct
        return

    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[FastAPI, None]]:
        provider = LocalProvider(LocalConfig(state_dir=local_state))
        pool = Pool(provider, PoolConfig(name="attacks"))
        settings = ServerSettings(api_keys=[ApiKey(tenant="t", key=KEY)], close_pool=True)
        try:
            yield create_app(pool, settings), None
        finally:
            await provider.aclose()

    with serve_in_thread(setup) as (url, _, _loop):
        async with sandman.connect(url, api_key=KEY, via_proxy=True) as proxied:
            yield proxied


class Heap:
    """The growth of this process's Python heap (the service's too, when it runs here)."""

    base = 0

    def reset(self) -> None:
        """Measure from here."""
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.base = tracemalloc.get_traced_memory()[0]

    def peak(self) -> int:
        return tracemalloc.get_traced_memory()[1] - self.base

    def check(self) -> None:
        assert self.peak() < HEAP_BOUND, f"the heap grew by {self.peak() >> 20} MiB"


@pytest.fixture
def heap() -> Iterator[Heap]:
    try:
        yield Heap()
    finally:
        tracemalloc.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _listening(sb: sandman.AsyncSandbox, port: int) -> None:
    """Wait until something in the sandbox listens on ``port`` (IPv4 or IPv6)."""

    async def up() -> bool:
        table = (await sb.exec("cat /proc/net/tcp /proc/net/tcp6")).stdout
        return any(
            line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
            for line in table.splitlines()
            if not line.lstrip().startswith("sl")
        )

    await eventually(up, timeout=20, what=f"a listener on port {port}", interval=0.02)


async def _connect(
    exposed: sandman.ExposedPort,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(exposed.host, exposed.port)


async def _close(writer: asyncio.StreamWriter, *, reset: bool = False) -> None:
    """Leave at once (a graceful close would wait for writes the sandbox never
    takes); with ``reset``, as a client that dies does, with a reset."""
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _responsive(sb: sandman.AsyncSandbox) -> None:
    """The daemon answers a no-op while the attack goes on."""
    async with asyncio.timeout(5):
        assert (await sb.exec(["true"])).exit_code == 0


async def _written(sb: sandman.AsyncSandbox, pid: int) -> int:
    """Bytes the process ``pid`` has written so far (``wchar`` of its /proc io)."""
    io = (await sb.exec(["cat", f"/proc/{pid}/io"])).stdout
    return next(int(line.split()[1]) for line in io.splitlines() if line.startswith("wchar:"))


def _nothing_left(exposed: sandman.ExposedPort) -> None:
    assert exposed.closed and exposed.connections == 0


async def _refused(exposed: sandman.ExposedPort) -> None:
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(exposed.host, exposed.port)


async def test_a_flood_the_client_does_not_read(client: sandman.AsyncClient, heap: Heap) -> None:
    fds = _open_fds()
    async with client.sandbox("busybox", network="none") as sb:
        flood = await sb.spawn("exec busybox nc -l -p 9001 < /dev/zero")
        exposed = await sb.expose(9001)
        await _listening(sb, 9001)
        heap.reset()
        _reader, writer = await _connect(exposed)
        # The flood goes on until every buffer between it and this unread
        # socket is full: then it is held back, and no further.
        samples: list[int] = []

        async def held_back() -> bool:
            heap.check()
            samples.append(await _written(sb, flood.pid))
            return len(samples) >= 3 and samples[-1] == samples[-3] > 0

        await eventually(held_back, timeout=60, what="the flood held back", interval=0.05)
        heap.check()
        await _responsive(sb)
        # The client leaves: the flood's connection is torn down, the flood ends.
        await _close(writer)
        await eventually(lambda: exposed.connections == 0, what="the connection closed")

        async def flood_ended() -> bool:
            return not (await sb.poll(flood.id)).running

        await eventually(flood_ended, timeout=20, what="the flood ended")
        heap.check()
    _nothing_left(exposed)
    await _refused(exposed)
    await eventually(lambda: _open_fds() <= fds, what="no descriptor left")


async def test_a_port_that_accepts_and_stalls(client: sandman.AsyncClient, heap: Heap) -> None:
    fds = _open_fds()
    async with client.sandbox("busybox", network="none") as sb:
        # Each connection goes to a sleep that never reads nor writes.
        await sb.spawn(["busybox", "nc", "-ll", "-p", "9002", "-e", "sleep", "100000"])
        exposed = await sb.expose(9002, half_close_timeout=1.0)
        await _listening(sb, 9002)
        heap.reset()
        before = _open_fds()
        # An HTTP client's call ends with its own timeout's error.
        async with httpx.AsyncClient(timeout=TIMEOUT) as http, asyncio.timeout(TIMEOUT + 10):
            with pytest.raises(httpx.ReadTimeout):
                await http.get(exposed.url)
        # A client that writes and writes: its writes are held back (drain
        # blocks), they do not pile up in this process.
        _reader, writer = await _connect(exposed)
        chunk, sent = b"x" * (1 << 20), 0
        while True:
            writer.write(chunk)
            sent += len(chunk)
            heap.check()
            assert sent < 512 << 20, "the writes were never held back"
            try:
                await asyncio.wait_for(writer.drain(), 0.5)
            except TimeoutError:
                break
        await _responsive(sb)
        heap.check()
        await _close(writer, reset=True)
        # Both are let go of: the one HTTP closed (to the port, half-closed:
        # it may still answer) once the port has been silent too long; the
        # other, not read while the port takes nothing, once its reset is seen.
        await eventually(lambda: exposed.connections == 0, what="the connections closed")
        assert exposed.last_failure is not None and "sent nothing" in exposed.last_failure
        await eventually(lambda: _open_fds() <= before, what="their descriptors closed")
    _nothing_left(exposed)
    await _refused(exposed)
    await eventually(lambda: _open_fds() <= fds, what="no descriptor left")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        # accepted, then closed at once
        (["true"], (httpx.RemoteProtocolError, httpx.ReadError)),
        # closed in the middle of the answer's head
        (["printf", "HTTP/1.1 200 OK\\r\\nContent-Le"], httpx.RemoteProtocolError),
        # closed in the middle of the body
        (
            ["printf", "HTTP/1.1 200 OK\\r\\nContent-Length: 1000000\\r\\n\\r\\nshort"],
            httpx.RemoteProtocolError,
        ),
    ],
)
async def test_a_port_that_closes_mid_way(
    client: sandman.AsyncClient, heap: Heap, answer: list[str], error: type[Exception]
) -> None:
    fds = _open_fds()
    async with client.sandbox("busybox", network="none") as sb:
        await sb.spawn(["busybox", "nc", "-ll", "-p", "9003", "-e", *answer])
        exposed = await sb.expose(9003)
        await _listening(sb, 9003)
        heap.reset()
        async with httpx.AsyncClient(timeout=TIMEOUT) as http, asyncio.timeout(TIMEOUT + 10):
            for _ in range(3):
                with pytest.raises(error):
                    await http.get(exposed.url)
        # A stream cut while the client still sends: the end, or a reset, in time.
        await sb.spawn(
            ["busybox", "nc", "-ll", "-p", "9004", "-e", "head", "-c", "1000000", "/dev/zero"]
        )
        cut = await sb.expose(9004)
        await _listening(sb, 9004)
        reader, writer = await _connect(cut)
        writer.write(b"never read\n" * 10000)
        got = 0
        async with asyncio.timeout(TIMEOUT + 10):
            with contextlib.suppress(ConnectionResetError):
                while data := await reader.read(1 << 16):
                    got += len(data)
        assert got <= 1000000
        await _close(writer)
        await _responsive(sb)
        heap.check()
        await eventually(lambda: exposed.connections == cut.connections == 0, what="all closed")
    _nothing_left(exposed)
    _nothing_left(cut)
    await _refused(exposed)
    await eventually(lambda: _open_fds() <= fds, what="no descriptor left")
