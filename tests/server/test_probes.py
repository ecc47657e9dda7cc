"""``/v1/ready`` and ``/v1/live``: what Kubernetes' readiness and liveness probes ask."""

from __future__ import annotations

import builtins
from collections.abc import Mapping

import httpx
import pytest

from sandman import errors
from sandman.pool import Pool, PoolConfig
from sandman.providers.base import SandboxInfo
from sandman.server import create_app, service_of
from sandman.testing import FakeProvider
from tests.server.conftest import settings
from tests.support import eventually

pytestmark = pytest.mark.anyio


def client(pool: Pool) -> httpx.AsyncClient:
    """An unauthenticated client of a new app over ``pool``: probes need no key."""
    app = create_app(pool, settings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")


async def probe(api: httpx.AsyncClient, path: str) -> tuple[int, str, list[str]]:
    response = await api.get(path)
    body = response.json()
    return response.status_code, body["status"], body["reasons"]


async def test_ready_and_live_once_the_pool_started(fake: FakeProvider) -> None:
    pool = Pool(fake, PoolConfig(name="t"))
    async with client(pool) as api:
        status, word, reasons = await probe(api, "/v1/ready")
        assert (status, word) == (503, "not_ready")
        assert reasons == ["the pool is not started"]
        # Not started is not a reason to restart: it is starting.
        assert await probe(api, "/v1/live") == (200, "alive", [])
        await pool.start()
        try:
            assert await probe(api, "/v1/ready") == (200, "ready", [])
            assert await probe(api, "/v1/live") == (200, "alive", [])
        finally:
            await pool.aclose()
        status, word, reasons = await probe(api, "/v1/ready")
        assert (status, reasons) == (503, ["the pool is closed"])
        assert await probe(api, "/v1/live") == (200, "alive", [])


async def test_not_ready_from_the_moment_it_stops_accepting(pool: Pool) -> None:
    app = create_app(pool, settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as api:
        assert (await api.get("/v1/ready")).status_code == 200
        service_of(app).stop_accepting()  # what SIGTERM does first (`sandman serve`)
        status, word, reasons = await probe(api, "/v1/ready")
        assert (status, word, reasons) == (503, "not_ready", ["the service is shutting down"])
        # Draining is no reason to be killed.
        assert await probe(api, "/v1/live") == (200, "alive", [])


async def test_not_ready_while_the_provider_does_not_answer_yet_alive(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = PoolConfig(name="t", reconcile_interval=0.2, lease=0.4)
    async with Pool(fake, config) as pool, client(pool) as api:
        assert (await api.get("/v1/ready")).status_code == 200
        listed = fake.list

        async def unreachable(
            *, labels: Mapping[str, str] | None = None
        ) -> builtins.list[SandboxInfo]:
            raise errors.ProviderError("the API server does not answer")

        monkeypatch.setattr(fake, "list", unreachable)
        answers: list[tuple[int, str, list[str]]] = []

        async def unready() -> bool:
            answers.append(await probe(api, "/v1/ready"))
            return answers[-1][0] == 503

        await eventually(unready, timeout=10)
        [reason] = answers[-1][2]
        assert reason.startswith("the fake provider has not answered for "), reason
        # A backend away must not restart the service (every replica at once).
        assert await probe(api, "/v1/live") == (200, "alive", [])
        # Back: ready again at the next pass.
        monkeypatch.setattr(fake, "list", listed)

        async def ready() -> bool:
            return (await api.get("/v1/ready")).status_code == 200

        await eventually(ready, timeout=10)


async def test_not_live_once_a_pool_loop_ended_by_itself(pool: Pool) -> None:
    async with client(pool) as api:
        assert await probe(api, "/v1/live") == (200, "alive", [])
        scheduler = next(t for t in pool._loops if t.get_name() == "sandman-pool-scheduler")
        scheduler.cancel()  # as if it had crashed: nothing would be handed out any more
        await eventually(scheduler.done)
        reason = "the pool's loop sandman-pool-scheduler stopped"
        assert await probe(api, "/v1/live") == (503, "stopped", [reason])
        status, _, reasons = await probe(api, "/v1/ready")
        assert (status, reasons) == (503, [reason])


async def test_probes_are_in_the_openapi_document(pool: Pool) -> None:
    async with client(pool) as api:
        paths = (await api.get("/v1/openapi.json")).json()["paths"]
    assert {"/v1/ready", "/v1/live", "/v1/health"} <= set(paths)
