"""Fixtures for the service: the app in-process (httpx.ASGITransport) and a real uvicorn
server on 127.0.0.1 in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from sandman.pool import PacingConfig, Pool, PoolConfig
from sandman.server import ApiKey, ServerSettings, create_app
from sandman.testing import FakeProvider

KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
AUTH_A = {"Authorization": f"Bearer {KEY_A}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}

T = TypeVar("T")


def settings(**overrides: Any) -> ServerSettings:
    """Two tenants, ``a`` and ``b``; the test owns the pool's lifetime."""
    base: dict[str, Any] = {
        "api_keys": [ApiKey(tenant="a", key=KEY_A), ApiKey(tenant="b", key=KEY_B)],
        "close_pool": False,
    }
    return ServerSettings.model_validate({**base, **overrides})


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=1)
    yield provider
    await provider.aclose()


@pytest.fixture
async def pool(fake: FakeProvider) -> AsyncIterator[Pool]:
    async with Pool(fake, PoolConfig(name="t")) as pool:
        yield pool


@pytest.fixture
async def serial_pool(fake: FakeProvider) -> AsyncIterator[Pool]:
    """A pool that makes one sandbox at a time, each taking 0.3 s: waiters queue up."""
    fake.faults.create_latency = 0.3
    pacing = PacingConfig(window=1, min_window=1, rate=100.0)
    async with Pool(fake, PoolConfig(name="t", pacing=pacing)) as pool:
        yield pool


@pytest.fixture
def app(pool: Pool) -> FastAPI:
    return create_app(pool, settings())


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Tenant ``a``'s client of the app, in-process."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://sandman", headers=AUTH_A
    ) as c:
        yield c


@dataclass
class Served:
    """A service running in uvicorn on another thread (its own event loop)."""

    url: str
    app: FastAPI
    pool: Pool
    provider: FakeProvider
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (e.g. to look at the pool)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serve(
    *,
    daemon: bool = True,
    pool_config: PoolConfig | None = None,
    http: str = "h11",
    **overrides: Any,
) -> Iterator[Served]:
    """Serve a fresh FakeProvider-backed pool on 127.0.0.1:<free port> until the block ends.

    The app's lifespan starts the pool and, at the end, shuts the service down.
    ``http`` is uvicorn's HTTP implementation (``sandman serve`` runs httptools).
    """

    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[FastAPI, tuple[FastAPI, Pool, FakeProvider]]]:
        async with FakeProvider(daemon=daemon, seed=3) as provider:
            pool = Pool(provider, pool_config or PoolConfig(name="served"))
            app = create_app(pool, settings(close_pool=True, **overrides))
            yield app, (app, pool, provider)

    with serve_in_thread(setup, http=http) as (url, (app, pool, provider), loop):
        yield Served(url, app, pool, provider, loop)


@contextlib.contextmanager
def serve_in_thread(
    setup: Callable[[], contextlib.AbstractAsyncContextManager[tuple[FastAPI, T]]],
    *,
    name: str = "uvicorn",
    http: str = "h11",
    start_timeout: float = 20.0,
    stop_timeout: float = 30.0,
) -> Iterator[tuple[str, T, asyncio.AbstractEventLoop]]:
    """Serve the app ``setup`` yields in uvicorn on 127.0.0.1:<free port>, on a thread
    with its own event loop, until the block ends.

    The block gets the URL, what ``setup`` yielded beside the app and the server's
    loop. ``setup`` is entered and left on that loop: it is left once the server
    has stopped. Whatever the thread raised is raised here at the end.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    box: dict[str, Any] = {}
    failure: list[BaseException] = []

    async def main() -> None:
        async with setup() as (app, extra):
            server = uvicorn.Server(
                uvicorn.Config(app, log_level="warning", lifespan="on", ws="none", http=http)
            )
            box.update(server=server, extra=extra, loop=asyncio.get_running_loop())
            await server.serve(sockets=[sock])

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            failure.append(exc)

    thread = threading.Thread(target=thread_main, name=name, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not (box.get("server") and box["server"].started):
            if failure or not thread.is_alive():
                raise RuntimeError("the server did not start") from (
                    failure[0] if failure else None
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {start_timeout:g} s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", box["extra"], box["loop"]
    finally:
        if "server" in box:
            box["server"].should_exit = True
        thread.join(stop_timeout)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"
        if failure:
            raise failure[0]
