"""A long run keeps nothing per sandbox: 10,000 acquire/release cycles leave the
client's memory and tables as they were (issue 15). Counted in objects the
garbage collector tracks, not in time."""

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
from sandman.testing import FakeProvider
from tests.support import Delegating

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

CYCLES = 10_000
WARM_UP = 300


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

            async def cycles(count: int) -> dict[str, float]:
                timeline: dict[str, float] = {}
                for _ in range(count):
                    async with client.sandbox("busybox") as sb:
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


def _tables(*owners: object) -> dict[str, int]:
    """How many entries each table (dict, set, list, deque) of ``owners`` holds."""
    return {
        f"{type(owner).__name__}.{name}": len(value)
        for owner in owners
        for name, value in vars(owner).items()
        if isinstance(value, dict | set | list | deque)
    }
