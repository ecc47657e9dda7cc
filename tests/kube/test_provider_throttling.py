"""A burst far over API Priority and Fairness limits: 429s become waiting, not failures.

The ordinary identity ``sandman`` is not exempt from Priority and Fairness.
The pool starts as if nothing limited it (every request may create at once,
hundreds of connections), so the API server answers 429 with Retry-After;
the pool's pacer backs off and retries, and every sandbox arrives. KWOK
nodes in pod-readiness mode keep the burst cheap.
"""

from __future__ import annotations

import uuid

import anyio
import pytest

from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig, PoolEvent
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import KWOK, Admin, config_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

BURST = 800


@pytest.mark.timeout(SETUP_TIMEOUT + 600)
async def test_a_burst_over_the_limits_waits_instead_of_failing(
    kube_cluster: KubeCluster, admin: Admin
) -> None:
    pool_name = f"t7t-{uuid.uuid4().hex[:8]}"
    config = config_for(
        kube_cluster, readiness="pod", max_connections=BURST, annotations=KWOK_NO_DELAY
    )
    provider = KubernetesProvider(config)
    # Unlimited to begin with: all of the burst may be sent at once.
    pacing = PacingConfig(rate=5000, burst=BURST, max_rate=5000, window=BURST, max_window=BURST)
    events: list[PoolEvent] = []
    spec = SandboxSpec(image="sandman.local/busybox:1.35", kubernetes=KWOK)
    failures: list[BaseException] = []
    try:
        async with Pool(
            provider, PoolConfig(name=pool_name, pacing=pacing), hook=events.append
        ) as pool:
            session = pool.open_session(lease=3600)  # nobody heartbeats here

            async def one() -> None:
                try:
                    await pool.acquire(spec, session=session, timeout=400)
                except errors.SandboxError as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as group:
                for _ in range(BURST):
                    group.start_soon(one)
            throttled = [
                e for e in events if e.name == "create.failed" and e.detail["kind"] == "throttled"
            ]
            assert throttled, "the burst was meant to exceed the identity's limits"
            assert "429" in throttled[0].detail["error"]
            assert failures == []
            assert len(pool.list(session=session)) == BURST
            # The pacer backed off from where it started.
            assert pool.stats()["pacing_rate"] < pacing.rate
    finally:
        await provider.aclose()
        left = await admin.sweep(pool_name)
        assert not left, f"{len(left)} pods left behind"
