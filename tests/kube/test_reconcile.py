"""A pool process killed with SIGKILL mid-burst leaves pods; the next pool of that name
adopts or deletes every one of them, and nothing is left once the leases pass.

The burst runs on KWOK nodes in pod-readiness mode, so that it is large and
cheap: the reconciler sees the same pods, labels and states either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.providers.kubernetes import KubernetesProvider
from sandman.settings import KubernetesConfig
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import Admin
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

BURST = 40
KILL_AFTER = 10
LEASE = 5.0

# The pool process: a burst of acquires; it prints each sandbox it gets.
CHILD = """
import asyncio, sys
from pathlib import Path
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from sandman.settings import KubernetesConfig

kubeconfig, namespace, pool_name, burst = sys.argv[1:5]
kwok = KubernetesOptions(
    cpu_request=0.001, memory_request="1Mi", node_selector={"type": "kwok"},
    tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
)
spec = SandboxSpec(image="sandman.local/busybox:1.35", kubernetes=kwok)

async def main():
    config = KubernetesConfig(
        kubeconfig=Path(kubeconfig), namespace=namespace, readiness="pod", owner_lease=3
    )
    async with Pool(KubernetesProvider(config), PoolConfig(name=pool_name)) as pool:
        session = pool.open_session(lease=3600)
        async def one():
            record = await pool.acquire(spec, session=session)
            print("ready", record.id, flush=True)
        await asyncio.gather(*(one() for _ in range(int(burst))))
        print("done", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.timeout(SETUP_TIMEOUT + 300)
async def test_a_pool_killed_mid_burst_leaves_nothing_after_a_restart(
    kube_cluster: KubeCluster, admin: Admin
) -> None:
    pool_name = f"t7r-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(kube_cluster.kubeconfig), kube_cluster.namespace,
         pool_name, str(BURST)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    events: list[PoolEvent] = []
    try:
        assert child.stdout is not None
        ready: list[str] = []

        def read_until_enough() -> None:
            assert child.stdout is not None
            deadline = time.monotonic() + 120
            while len(ready) < KILL_AFTER and time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                if line.startswith("ready "):
                    ready.append(line.split()[1])

        await anyio.to_thread.run_sync(read_until_enough)
        assert len(ready) >= KILL_AFTER, (ready, child.poll(), child.stderr and child.stderr.read())
        # Mid-burst: some sandboxes handed out, others still being created.
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        left_by_the_dead = await admin.names(pool_name)
        assert set(ready) <= set(left_by_the_dead)
        # Killed mid-burst: more pods exist than the dead pool ever handed out.
        assert len(left_by_the_dead) > len(ready)

        # The dead pool's Lease (3 s) must be judged dead before its pods are adopted:
        # a short grace keeps that wait short.
        config = KubernetesConfig(
            kubeconfig=kube_cluster.kubeconfig, namespace=kube_cluster.namespace,
            readiness="pod", owner_grace=1.0,
        )  # fmt: skip
        provider = KubernetesProvider(config)
        pool_config = PoolConfig(
            name=pool_name, lease=LEASE, adopt_orphans=True, reconcile_interval=1.0
        )
        try:
            async with Pool(provider, pool_config, hook=events.append) as pool:
                adopted = {e.sandbox_id for e in events if e.name == "reconcile.adopted"}
                orphans = {e.sandbox_id for e in events if e.name == "reconcile.orphan"}
                # Every pod the dead pool left is either adopted (running, unexpired:
                # its session gets one lease to come back) or deleted.
                assert set(left_by_the_dead) <= adopted | orphans
                assert set(ready) <= adopted
                assert not adopted & orphans

                async def none_left() -> bool:
                    return not await admin.names(pool_name) and not pool.list()

                # No session heartbeats: once the lease passes, everything goes. Pods
                # whose create was accepted after the first list are found by the
                # periodic reconcile.
                await wait_for("the pool's pods to be gone", LEASE + 90, none_left)
                expired = {e.detail["session"] for e in events if e.name == "session.expired"}
                assert expired, "the adopted session should have expired"
        finally:
            await provider.aclose()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
        left = await admin.sweep(pool_name)
        assert not left, f"pods left behind: {left}"
