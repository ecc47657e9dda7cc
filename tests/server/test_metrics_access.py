"""Who may read ``/metrics``, and whether they name tenants (issue 12, item 6).

Tenant names are other tenants' business: by default no series carries one;
with ``metrics_tenant_labels`` they do, and then only the holder of
``metrics_key`` or an admin tenant's key may scrape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError

from sandman.pool import Pool
from sandman.server import ServerSettings, create_app
from sandman.testing import FakeProvider
from tests.server.conftest import AUTH_A, AUTH_B, KEY_A, settings
from tests.support import eventually

pytestmark = pytest.mark.anyio

METRICS_KEY = "metrics-key-0123456789abcdef"


@contextlib.asynccontextmanager
async def _waiting_acquire(
    pool: Pool, fake: FakeProvider, config: ServerSettings
) -> AsyncIterator[httpx.AsyncClient]:
    """An app over ``pool`` with one acquire of tenant ``b`` waiting; yields a client
    without a key."""
    app = create_app(pool, config)
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as tenant_b,
        httpx.AsyncClient(transport=transport, base_url="http://x") as anyone,
    ):
        session = (await tenant_b.post("/v1/sessions")).json()["id"]
        fake.faults.create_latency = 5.0
        waiting = asyncio.ensure_future(
            tenant_b.post("/v1/sandboxes", json={"spec": {"image": "task"}, "session": session})
        )
        try:
            await eventually(lambda: fake.creating == 1)
            yield anyone
        finally:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting


async def test_open_metrics_name_no_tenant(pool: Pool, fake: FakeProvider) -> None:
    async with _waiting_acquire(pool, fake, settings()) as anyone:
        response = await anyone.get("/metrics")
        assert response.status_code == 200
        assert 'sandman_queue_depth{pool="t"} 1.0' in response.text
        assert 'tenant="' not in response.text and '"b"' not in response.text


async def test_metrics_key_guards_the_endpoint(pool: Pool, fake: FakeProvider) -> None:
    config = settings(
        metrics_key=METRICS_KEY, metrics_tenant_labels=True, admin_tenants="a"
    )  # fmt: skip
    async with _waiting_acquire(pool, fake, config) as anyone:
        for headers in [{}, {"Authorization": "Bearer wrong-wrong-wrong-wrong"},
                        {"Authorization": f"Basic {METRICS_KEY}"}, AUTH_B]:  # fmt: skip
            response = await anyone.get("/metrics", headers=headers)
            assert response.status_code == 401, (headers, response.text)
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
            assert "tenant" not in response.text
        # The scraper's key, and an operator's (admin tenant) key, see tenants.
        for key in (METRICS_KEY, KEY_A):
            response = await anyone.get("/metrics", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
            assert 'sandman_queue_depth{pool="t",tenant="b"} 1.0' in response.text
    assert AUTH_A  # tenant a is the admin here


async def test_metrics_key_without_tenant_labels(pool: Pool, fake: FakeProvider) -> None:
    async with _waiting_acquire(pool, fake, settings(metrics_key=METRICS_KEY)) as anyone:
        assert (await anyone.get("/metrics")).status_code == 401
        response = await anyone.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
        assert 'sandman_queue_depth{pool="t"} 1.0' in response.text


def test_tenant_labels_need_a_metrics_key() -> None:
    with pytest.raises(ValidationError, match="set metrics_key"):
        settings(metrics_tenant_labels=True)
    with pytest.raises(ValidationError):
        settings(metrics_key="short")
    env = {"SANDMAN_METRICS_KEY": METRICS_KEY, "SANDMAN_METRICS_TENANT_LABELS": "true"}
    loaded = ServerSettings.from_env(env)
    assert loaded.metrics_tenant_labels and loaded.metrics_key is not None
    assert METRICS_KEY not in repr(loaded)
