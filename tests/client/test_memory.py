"""A long run keeps nothing per sandbox: 10,000 acquire/release cycles leave the
client's memory and tables as they were (issue 15). Counted in objects the
garbage collector tracks, not in time.

Every cycle asks for a spec of its own (a task id in its labels, as a training job's
specs carry), and the service's cycles come from many tenants under a limit, with
callers who give up while they wait: a table keyed by spec, tenant or session that
never lets go grows here by thousands (issue 30)."""

from __future__ import annotations

import asyncio
import gc
from collections import deque
from collections.abc import Mapping

import pytest

from sandman.client import AsyncClient, InProcessBackend
from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig
from sandman.providers.base import DaemonEndpoint, SandboxInfo
from sandman.server import ApiKey, ServerSettings
from sandman.server.errors import ApiError
from sandman.server.schemas import AcquireRequest
from sandman.server.service import ClientGone, Service
from sandman.testing import FakeProvider
from tests.support import Delegating

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

CYCLES = 10_000
WARM_UP = 300
TENANTS = 500
SERVICE_CYCLES = 4_000


class _OneDaemon(Delegating):
    """The fake's sandboxes, all answered by one real daemon: the cycles cost the
    pool's and the client's own work, not 10,000 daemon starts."""

    name = "fake"

    def __init__(self, endpoint: DaemonEndpoint) -> None:
        self.fake = FakeProvider(daemon=False)
        super().__init__(self.fake)
        self.endpoint = endpoint

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        info = await self.fake.create(spec, sandbox_id=sandbox_id, labels=labels)
        return info.model_copy(update={"endpoint": self.endpoint})

    async def aclose(self) -> None:
        await self.fake.aclose(forget=True)


async def _settled(pool: Pool) -> None:
    async with asyncio.timeout(30):
        while pool.list():  # releases are deleted in the background
            await asyncio.sleep(0.01)


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_ten_thousand_sandboxes_leave_nothing_behind_in_the_client() -> None:
    async with FakeProvider() as daemons:
        one = await daemons.create(SandboxSpec(image="busybox"))
        assert one.endpoint is not None
        provider = _OneDaemon(one.endpoint)
        # Paced only by the work itself: the pacer's start rate is not under test.
        pacing = PacingConfig(rate=1e6, max_rate=1e6, burst=1000)
        pool = Pool(provider, PoolConfig(name="memory", delete_backoff=0.01, pacing=pacing))
        backend = InProcessBackend(pool)
        async with AsyncClient(backend) as client:
            made = 0

            async def cycles(count: int) -> dict[str, float]:
                nonlocal made
                timeline: dict[str, float] = {}
                for _ in range(count):
                    made += 1
                    async with client.sandbox("busybox", labels={"task": f"t{made}"}) as sb:
                        pass
                    timeline = await sb.timeline()  # still there: kept on the sandbox
                await _settled(pool)
                return timeline

            await cycles(WARM_UP)  # caches, pools of connections, interned strings
            tables = _tables(backend, pool, pool._pacer)
            before = _tracked()
            timeline = await cycles(CYCLES)
            after = _tracked()

            assert "handed_out" in timeline and "released" in timeline
            # One object kept a sandbox would be 10,000; allow noise (~100), not growth.
            assert after - before < CYCLES // 10, (before, after)
            assert provider.fake.live == 0 and provider.fake.created_total == WARM_UP + CYCLES
            assert _tables(backend, pool, pool._pacer) == tables


async def test_distinct_specs_and_tenants_leave_nothing_behind_in_the_service() -> None:
    """Many tenants under a limit, a spec per acquire, one caller in ten gone before its
    sandbox is ready: the service's and the pool's tables end as they began."""
    keys = [ApiKey(tenant=f"tenant-{n}", key=f"key-of-tenant-{n:06d}") for n in range(TENANTS)]
    settings = ServerSettings(
        api_keys=keys,
        close_pool=False,
        recent_sandboxes=100,  # full after the warm-up: bounded, not the growth looked for
        default_limits={"max_sandboxes": 2, "max_pending": 2},
    )
    pacing = PacingConfig(rate=1e6, max_rate=1e6, burst=1000)
    async with (
        FakeProvider(daemon=False) as fake,
        Pool(fake, PoolConfig(name="tenants", delete_backoff=0.01, pacing=pacing)) as pool,
    ):
        service = Service(pool, settings)
        made = gave_up = 0

        async def connected() -> None:
            await asyncio.Event().wait()

        async def gone() -> None:
            return None

        async def cycles(count: int) -> None:
            nonlocal made, gave_up
            for n in range(count):
                made += 1
                tenant = keys[made % TENANTS].tenant
                session, _ = service.open_session(tenant, None)
                spec = SandboxSpec(image="busybox", labels={"task": f"t{made}"})
                request = AcquireRequest(spec=spec, session=session)
                if n % 10 == 9:
                    with pytest.raises(ClientGone):
                        await service.acquire(tenant, request, gone)
                    gave_up += 1
                else:
                    record = await service.acquire(tenant, request, connected)
                    service.release(tenant, record.id)
                service.close_session(tenant, session)
            await _settled(pool)

        await cycles(WARM_UP)
        tables = _tables(service, pool, pool._pacer)
        before = _tracked()
        await cycles(SERVICE_CYCLES)
        after = _tracked()

        assert gave_up >= SERVICE_CYCLES // 10
        assert after - before < SERVICE_CYCLES // 10, (before, after)
        assert _tables(service, pool, pool._pacer) == tables
        assert service.queue_depths() == {}
        # The limit still counts: what a tenant holds is counted, and let go of.
        tenant = keys[0].tenant
        session, _ = service.open_session(tenant, None)
        held = [
            await service.acquire(tenant, AcquireRequest(spec=spec, session=session), connected)
            for spec in (SandboxSpec(image="busybox"), SandboxSpec(image="alpine"))
        ]
        with pytest.raises(ApiError, match="holds or waits for 2 sandboxes"):
            await service.acquire(
                tenant, AcquireRequest(spec=SandboxSpec(image="busybox"), session=session), gone
            )
        for record in held:
            service.release(tenant, record.id)
        other, _ = service.open_session(tenant, None)
        await service.acquire(
            tenant, AcquireRequest(spec=SandboxSpec(image="busybox"), session=other), connected
        )


def _tables(*owners: object, depth: int = 1) -> dict[str, int]:
    """How many entries each table (dict, set, list, deque) of ``owners`` holds, and of
    the pool's and the service's objects they keep (the service's tally, say)."""
    tables: dict[str, int] = {}
    for owner in owners:
        for name, value in vars(owner).items():
            where = f"{type(owner).__name__}.{name}"
            if isinstance(value, dict | set | list | deque):
                tables[where] = len(value)
            elif depth and type(value).__module__.startswith(_OURS) and hasattr(value, "__dict__"):
                inner = _tables(value, depth=depth - 1)
                tables.update({f"{where}.{k}": n for k, n in inner.items()})
    return tables


_OURS = ("sandman.pool.", "sandman.server.", "sandman.client.")
