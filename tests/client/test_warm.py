"""Warm spares from the SDK, the service (per tenant) and `sandman serve --warm`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import sandman
from sandman.cli import build
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.server import ApiKey, ServerSettings, TenantLimits, WarmSpares, create_app
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import KEY_A, KEY_B, serve_in_thread
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


async def ready_spares(provider: LocalProvider, tenant: str | None = None) -> set[str]:
    """Running sandboxes no session holds yet (and, with ``tenant``, made for it)."""
    return {
        info.id
        for info in await provider.list()
        if info.state == "running"
        and "sandman.io/session" not in info.labels
        and (tenant is None or info.labels.get("sandman.io/tenant") == tenant)
    }


async def test_an_acquire_takes_a_spare_the_client_asked_for(
    local_state: Path, imported: LocalProvider
) -> None:
    async with sandman.local(state_dir=local_state) as client:
        await client.warm("busybox", 2, memory="64Mi")
        await eventually(lambda: _count(imported, 2), timeout=30, what="two spares")
        # Running is not yet ready: the pool hands a spare out once its daemon answered.
        pool = client._backend.pool  # type: ignore[attr-defined]
        await eventually(lambda: _ready(pool, 2), timeout=30, what="two spares ready")
        spares = await ready_spares(imported)
        sb = await client.acquire("busybox", memory="64Mi")
        assert sb.id in spares  # taken ready, not made
        await sb.release()
        with pytest.raises(sandman.ConfigError):
            await client.warm("busybox", -1)
        await client.warm("busybox", 0, memory="64Mi")


async def _count(provider: LocalProvider, n: int) -> bool:
    return len(await ready_spares(provider)) >= n


async def _ready(pool: Pool, n: int) -> bool:
    return pool.stats().get("ready", 0) >= n


@contextlib.asynccontextmanager
async def service(provider: LocalProvider, warm: list[WarmSpares]) -> AsyncIterator[str]:
    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[object, None]]:
        pool = Pool(provider, PoolConfig(name="warm"))
        settings = ServerSettings(
            api_keys=[ApiKey(tenant="a", key=KEY_A), ApiKey(tenant="b", key=KEY_B)],
            tenant_limits={"b": TenantLimits(max_sandboxes=1)},
            warm=warm,
            close_pool=True,
        )
        yield create_app(pool, settings), None

    with serve_in_thread(setup) as (url, _, _loop):  # type: ignore[arg-type]
        yield url


async def test_spares_are_a_tenants_own(local_state: Path, imported: LocalProvider) -> None:
    spec = SandboxSpec(image="busybox", memory="64Mi")
    async with (
        service(imported, [WarmSpares(tenant="a", spec=spec, count=1)]) as url,
        sandman.connect(url, api_key=KEY_A) as a,
        sandman.connect(url, api_key=KEY_B) as b,
    ):
        await eventually(lambda: _count(imported, 1), timeout=30, what="a's spare")
        (spare,) = await ready_spares(imported, "a")
        theirs = await b.acquire(spec)
        assert theirs.id != spare  # b never gets a's spare
        await theirs.release()
        ours = await a.acquire(spec)
        assert ours.id == spare
        await ours.release()
        with pytest.raises(sandman.CapacityError, match="may hold 1"):
            await b.warm(spec, 2)


def test_serve_says_what_a_bad_warm_is() -> None:
    result = CliRunner().invoke(build(), ["serve", "--warm", "busybox=4"])
    assert result.exit_code == 2
    assert "'busybox=4' is not TENANT=IMAGE:N" in result.output
