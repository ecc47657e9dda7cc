"""``sandman serve`` as a process of its own on the local provider: start, serve, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import sandman
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider
from tests.server.conftest import KEY_A, KEY_B

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

KEYS = f"a:{KEY_A},b:{KEY_B}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Host:
    """One machine's local provider (its own state dir and cgroup parent)."""

    config: LocalConfig
    provider: LocalProvider

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SANDMAN_STATE_DIR": str(self.config.state_dir),
            "SANDMAN_CGROUP_PARENT": self.config.cgroup_parent,
            "SANDMAN_API_KEYS": KEYS,
        }


@pytest.fixture
async def host(busybox_tar: Path) -> AsyncIterator[Host]:
    async with fresh_local_provider(busybox_tar) as provider:
        yield Host(provider.config, provider)


class ServeProcess:
    """``sandman serve`` in a process of its own; its log goes to a file."""

    def __init__(self, host: Host, port: int, pool: str, *args: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.pool = pool
        self.log = host.config.state_dir / f"serve-{port}-{time.monotonic_ns()}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from sandman.cli import main; main()", "serve",
                 "--port", str(port), "--pool-name", pool, "--log-level", "warning", *args],
                env=host.env(), stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as http:
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"serve exited {self.process.returncode}: {self.output()}")
                try:
                    if (await http.get("/v1/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"serve not healthy in {timeout} s: {self.output()}")
                await asyncio.sleep(0.05)

    async def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; wait (with a deadline) for it to exit; its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


@contextlib.contextmanager
def served(host: Host, port: int, pool: str, *args: str) -> Iterator[ServeProcess]:
    process = ServeProcess(host, port, pool, *args)
    try:
        yield process
    finally:
        process.kill()


async def watchdogs_of(pool: str) -> list[int]:
    """Processes whose command line names the pool (its watchdog)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"sandman.client.watchdog" in cmdline and pool.encode() in cmdline:
                found.append(int(proc.name))
    return found


async def test_serve_then_sigterm_releases_everything(host: Host) -> None:
    pool = f"serve-test-{uuid.uuid4().hex[:8]}"
    with served(host, free_port(), pool) as server:
        await server.wait_healthy()
        assert await watchdogs_of(pool)  # bound to the service, should it be SIGKILLed
        client = sandman.connect(server.url, api_key=KEY_A)
        try:
            sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=60)
            result = await sb.exec(["sh", "-c", "echo served from $(hostname)"])
            assert result.exit_code == 0 and result.stdout == f"served from {sb.id}\n"
            assert [i.id for i in await host.provider.list()] == [sb.id]
            # SIGTERM while the sandbox is held: the service releases it before it exits.
            assert await server.terminate() == 0, server.output()
            assert await host.provider.list() == []
        finally:
            await client.aclose()  # the service is gone: closing still returns
    assert await watchdogs_of(pool) == []


async def test_an_idle_keep_alive_connection_outlives_a_clients_expiry(host: Host) -> None:
    """A client that keeps a connection idle for its keep-alive expiry (httpx: 5 s) and
    then reuses it gets an answer, not a reset: with uvicorn's own 5 s the two raced,
    and the server closed the connection as the request arrived."""
    pool = f"serve-test-{uuid.uuid4().hex[:8]}"
    with served(host, free_port(), pool) as server:
        await server.wait_healthy()
        port = int(server.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET /v1/health HTTP/1.1\r\nHost: sandman\r\n\r\n"
        try:
            for idle in (0.0, 6.0):
                await asyncio.sleep(idle)  # the idle time under test, not a wait
                writer.write(request)
                await writer.drain()
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    length = next(
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    )
                    await reader.readexactly(length)
        finally:
            writer.close()
        assert await server.terminate() == 0, server.output()


async def test_leave_on_shutdown_and_the_next_instance_adopts(host: Host) -> None:
    pool = f"serve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    client = sandman.connect(f"http://127.0.0.1:{port}", api_key=KEY_A, heartbeat_interval=0.5)
    try:
        with served(host, port, pool, "--on-shutdown", "leave") as first:
            await first.wait_healthy()
            sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=60)
            await sb.write_file("/kept", "state")
            assert await first.terminate() == 0, first.output()
        # Left running, and still usable: commands go straight to its daemon.
        infos = await host.provider.list()
        assert [(i.id, i.state) for i in infos] == [(sb.id, "running")]
        assert (await sb.exec(["cat", "/kept"])).stdout == "state"

        with served(host, port, pool) as second:
            await second.wait_healthy()
            async with httpx.AsyncClient(
                base_url=second.url, headers={"Authorization": f"Bearer {KEY_A}"}
            ) as api:
                listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
                assert [(s["id"], s["state"]) for s in listed] == [(sb.id, "leased")]
                other = await api.get("/v1/sandboxes", headers={"Authorization": f"Bearer {KEY_B}"})
                assert other.json()["sandboxes"] == []  # still tenant a's alone
            # Three heartbeats (every 0.5 s) reach the new instance, which adopted the
            # session: none finds it expired, so the client keeps it.
            session = client.session
            await asyncio.sleep(1.5)
            assert client.session == session
            assert (await sb.exec(["cat", "/kept"])).stdout == "state"
            await sb.release()
            deadline = time.monotonic() + 30
            while await host.provider.list():
                assert time.monotonic() < deadline, "the released sandbox is still there"
                await asyncio.sleep(0.05)
            await client.aclose()
            assert await second.terminate() == 0, second.output()
    finally:
        await client.aclose()


@pytest.mark.timeout(240)
async def test_sigkill_mid_burst_then_adopt_leases_only_what_clients_received(
    host: Host,
) -> None:
    """A service that leaves its sandboxes is SIGKILLed while a burst is being created.
    The next instance adopts as leased only sandboxes whose hand-over was recorded, and
    deletes the rest (made, or half made, for acquires that never got an answer); the
    clients give back what was recorded but never reached them. In the end exactly
    what the clients received is leased."""
    pool = f"serve-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    clients = [sandman.connect(url, api_key=KEY_A, heartbeat_interval=0.3) for _ in range(3)]
    received: dict[str, sandman.AsyncSandbox] = {}
    first_received = asyncio.Event()

    async def one(client: sandman.AsyncClient) -> None:
        sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=120)
        received[sb.id] = sb
        first_received.set()

    async def leased(api: httpx.AsyncClient) -> set[str]:
        listed = (await api.get("/v1/sandboxes", params={"state": "leased"})).json()
        return {s["id"] for s in listed["sandboxes"]}

    burst: list[asyncio.Task[None]] = []
    try:
        with served(host, port, pool, "--on-shutdown", "leave") as first:
            await first.wait_healthy()
            burst = [asyncio.ensure_future(one(c)) for c in clients for _ in range(10)]
            # Mid-burst: one handed over, many more being made.
            async with asyncio.timeout(120):
                await first_received.wait()
            first.kill()  # SIGKILL: no shutdown at all
            await asyncio.wait(burst, timeout=60)
            assert all(t.done() for t in burst)
        handed = set(received)
        infos = await host.provider.list()
        assert handed < {i.id for i in infos}  # more was made than any client received
        unrecorded = {i.id for i in infos if "sandman.io/session" not in i.labels}
        assert not unrecorded & handed  # every hand-over was recorded before its answer

        with served(host, port, pool, "--adopt") as second:
            await second.wait_healthy()
            auth = {"Authorization": f"Bearer {KEY_A}"}
            async with httpx.AsyncClient(base_url=second.url, headers=auth) as api:
                assert not await leased(api) & unrecorded
                # Recorded but never answered (killed in between): its client gives it back.
                deadline = time.monotonic() + 60
                while await leased(api) != handed:
                    assert time.monotonic() < deadline, (await leased(api), handed)
                    await asyncio.sleep(0.05)
            deadline = time.monotonic() + 60
            while {i.id for i in await host.provider.list()} != handed:
                assert time.monotonic() < deadline, "what no client received is still there"
                await asyncio.sleep(0.05)
            for sb in received.values():  # what was received still works
                assert (await sb.exec(["echo", "kept"])).stdout == "kept\n"
                await sb.release()
            for client in clients:
                await client.aclose()
            assert await second.terminate() == 0, second.output()
        assert await host.provider.list() == []
    finally:
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
        for client in clients:
            await client.aclose()
