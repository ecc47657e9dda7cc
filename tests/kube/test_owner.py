"""A pool process is the owner of its pods through a Lease: when it is SIGKILLed, its
Lease expires and exactly its pods are reaped (by `sandman gc --kubernetes` or another
pool's reconcile), never a live pool's; a clean close deletes its Lease; the API server
away for a while makes no live pool look dead.

The pods run on KWOK nodes in pod-readiness mode: cheap, and the owners are the same.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path

import anyio
import pytest

from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.pool.owner import LABEL_OWNER
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from sandman.settings import KubernetesConfig
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import KWOK, Admin, config_for, config_via, cut_proxy
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 240)]

REPO = Path(__file__).resolve().parents[2]
LEASE = 3  # seconds: the shortest a KubernetesConfig allows
GRACE = 2.0
SPEC_IMAGE = "sandman.local/busybox:1.35"

# The pool process: acquires COUNT sandboxes, says which, and holds them.
CHILD = """
import asyncio, sys
from pathlib import Path
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from sandman.settings import KubernetesConfig

kubeconfig, namespace, pool_name, count, lease = sys.argv[1:6]
kwok = KubernetesOptions(
    cpu_request=0.001, memory_request="1Mi", node_selector={"type": "kwok"},
    tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
)
spec = SandboxSpec(image="sandman.local/busybox:1.35", kubernetes=kwok)

async def main():
    config = KubernetesConfig(
        kubeconfig=Path(kubeconfig), namespace=namespace, readiness="pod", owner_lease=int(lease),
        annotations=KWOK_NO_DELAY,
    )
    async with Pool(KubernetesProvider(config), PoolConfig(name=pool_name)) as pool:
        print("owner", pool.owner, flush=True)
        session = pool.open_session(lease=3600)
        records = await asyncio.gather(
            *(pool.acquire(spec, session=session) for _ in range(int(count)))
        )
        print("ready", *(r.id for r in records), flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@contextmanager
def pool_process(
    cluster: KubeCluster, pool_name: str, count: int
) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cluster.kubeconfig), cluster.namespace, pool_name,
         str(count), str(LEASE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()


async def held_by(child: subprocess.Popen[str]) -> tuple[str, list[str]]:
    """The child's owner value and the sandboxes it holds, once it holds them all."""

    def read() -> tuple[str, list[str]]:
        assert child.stdout is not None
        owner, ready = "", list[str]()
        deadline = time.monotonic() + 120
        while not ready and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if line.startswith("owner "):
                owner = line.split()[1]
            elif line.startswith("ready "):
                ready = line.split()[1:]
        return owner, ready

    owner, ready = await anyio.to_thread.run_sync(read)
    assert owner and ready, (child.poll(), child.stderr and child.stderr.read())
    return owner, ready


def kwok_config(cluster: KubeCluster, **fields: object) -> KubernetesConfig:
    return config_for(
        cluster, readiness="pod", owner_lease=LEASE, owner_grace=GRACE,
        annotations=KWOK_NO_DELAY, **fields,
    )  # fmt: skip


@asynccontextmanager
async def live_pool(
    config: KubernetesConfig,
    name: str,
    count: int,
    events: list[PoolEvent],
    *,
    reap_dead_owners: bool | None = None,
) -> AsyncIterator[tuple[Pool, list[str]]]:
    """A pool in this process holding ``count`` sandboxes."""
    from sandman.models import SandboxSpec

    provider = KubernetesProvider(config)
    spec = SandboxSpec(image=SPEC_IMAGE, kubernetes=KWOK)
    try:
        settings = PoolConfig(name=name, reconcile_interval=1.0, reap_dead_owners=reap_dead_owners)
        async with Pool(provider, settings, hook=events.append) as live:
            session = live.open_session(lease=3600)
            records = await asyncio.gather(
                *(live.acquire(spec, session=session) for _ in range(count))
            )
            yield live, [r.id for r in records]
    finally:
        await provider.aclose()


def gc(cluster: KubeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from sandman.cli import main; main()", "gc", "--kubernetes",
         "--kubeconfig", str(cluster.kubeconfig), "--namespace", cluster.namespace, *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip


async def sweep(admin: Admin, *pools: str) -> None:
    for pool in pools:
        await admin.sweep(pool)


async def test_gc_reaps_exactly_the_pods_of_a_killed_pool_process(
    kube_cluster: KubeCluster, admin: Admin
) -> None:
    dead_pool, live_name = f"t14d-{uuid.uuid4().hex[:6]}", f"t14l-{uuid.uuid4().hex[:6]}"
    events: list[PoolEvent] = []
    try:
        with pool_process(kube_cluster, dead_pool, 3) as child:
            owner, dead_pods = await held_by(child)
            assert owner.startswith("k.")
            lease = await admin.lease(owner[2:])
            assert lease is not None and lease["spec"]["leaseDurationSeconds"] == LEASE
            assert set(await admin.owned_by(owner)) == set(dead_pods)
            # This live pool leaves others' pods to gc here.
            config = kwok_config(kube_cluster)
            async with live_pool(config, live_name, 2, events, reap_dead_owners=False) as (
                live, live_pods,
            ):  # fmt: skip
                assert live.owner != owner and live.owner.startswith("k.")
                assert set(await admin.owned_by(live.owner)) == set(live_pods)
                # Before the kill, gc touches neither.
                early = await anyio.to_thread.run_sync(lambda: gc(kube_cluster))
                assert early.returncode == 0, early.stderr
                assert not set(dead_pods + live_pods) & set(early.stdout.split()), early.stdout

                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)

                async def expired() -> bool:
                    lease = await admin.lease(owner[2:])
                    assert lease is not None
                    renewed = datetime.fromisoformat(lease["spec"]["renewTime"]).timestamp()
                    return renewed + LEASE < time.time()

                await wait_for("the killed owner's Lease to expire", LEASE * 3, expired)
                # It waits until the expired Lease has stayed unchanged a while, then reaps.
                done = await anyio.to_thread.run_sync(lambda: gc(kube_cluster))
                assert done.returncode == 0, done.stderr
                reaped = {line.split()[1].rstrip(":") for line in done.stdout.splitlines()
                          if line.startswith("reaped sb-")}  # fmt: skip
                assert reaped == set(dead_pods), done.stdout
                assert f"owner dead (lease {owner[2:]})" in done.stdout
                assert await admin.names(dead_pool) == []
                assert sorted(await admin.names(live_name)) == sorted(live_pods)
                # The dead owner's Lease went with its last pod; the live one's stays.
                assert await admin.lease(owner[2:]) is None
                assert await admin.lease(live.owner[2:]) is not None
                assert all(r.state == "leased" for r in live.list())
    finally:
        await sweep(admin, dead_pool, live_name)


async def test_a_live_pools_reconcile_reaps_a_killed_pool_process_pods(
    kube_cluster: KubeCluster, admin: Admin
) -> None:
    dead_pool, live_name = f"t14d-{uuid.uuid4().hex[:6]}", f"t14l-{uuid.uuid4().hex[:6]}"
    events: list[PoolEvent] = []
    try:
        with pool_process(kube_cluster, dead_pool, 3) as child:
            owner, dead_pods = await held_by(child)
            async with live_pool(kwok_config(kube_cluster), live_name, 2, events) as (
                live, live_pods,
            ):  # fmt: skip
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)
                started = time.monotonic()

                async def reaped() -> bool:
                    return not await admin.names(dead_pool) and await admin.lease(owner[2:]) is None

                await wait_for("the dead owner's pods and Lease to go", 60, reaped)
                # Not before its Lease could have been judged dead.
                assert time.monotonic() - started >= GRACE
                orphaned = {e.sandbox_id for e in events if e.name == "reconcile.orphan"}
                assert orphaned == set(dead_pods)
                assert sorted(await admin.names(live_name)) == sorted(live_pods)
                assert {r.id for r in live.list() if r.state == "leased"} == set(live_pods)
    finally:
        await sweep(admin, dead_pool, live_name)


async def test_a_clean_close_deletes_the_lease_and_renewal_moves_it(
    kube_cluster: KubeCluster, admin: Admin
) -> None:
    name = f"t14c-{uuid.uuid4().hex[:6]}"
    events: list[PoolEvent] = []
    try:
        async with live_pool(kwok_config(kube_cluster), name, 1, events) as (live, _):
            lease_name = live.owner[2:]
            first = await admin.lease(lease_name)
            assert first is not None
            assert first["spec"]["holderIdentity"].endswith(f"/{os.getpid()}")
            assert first["metadata"]["labels"][LABEL_OWNER] == live.owner

            async def renewed() -> bool:
                now = await admin.lease(lease_name)
                return now is not None and now["spec"]["renewTime"] != first["spec"]["renewTime"]

            await wait_for("a renewal", LEASE * 2, renewed)
        assert await admin.lease(lease_name) is None
        assert await admin.names(name) == []
    finally:
        await sweep(admin, name)


async def test_the_api_server_away_for_longer_than_a_lease_makes_no_live_pool_look_dead(
    kube_cluster: KubeCluster, admin: Admin, tmp_path: Path
) -> None:
    """Both pools reach the API server through one proxy, cut for longer than the Lease
    and its grace: when it is back, the watching pool must not reap the other's pods
    before that one has had its chance to renew."""
    holder_name, watcher_name = f"t14h-{uuid.uuid4().hex[:6]}", f"t14w-{uuid.uuid4().hex[:6]}"
    events: list[PoolEvent] = []
    try:
        async with cut_proxy(kube_cluster) as proxy:
            holder_config = config_via(proxy, kube_cluster, tmp_path / "holder.token",
                                       readiness="pod", owner_lease=LEASE, owner_grace=GRACE,
                                       annotations=KWOK_NO_DELAY)  # fmt: skip
            watcher_config = config_via(proxy, kube_cluster, tmp_path / "watcher.token",
                                        readiness="pod", owner_lease=LEASE, owner_grace=GRACE,
                                       annotations=KWOK_NO_DELAY)  # fmt: skip
            async with (
                live_pool(holder_config, holder_name, 2, []) as (holder, held),
                live_pool(watcher_config, watcher_name, 1, events) as (watcher, _),
            ):
                lease_name = holder.owner[2:]
                proxy.sever()
                await anyio.sleep(LEASE + GRACE + 3)  # the outage itself: no condition to wait on
                proxy.restore()
                before = await admin.lease(lease_name)
                assert before is not None

                async def renewed_after() -> bool:
                    now = await admin.lease(lease_name)
                    return (
                        now is not None and now["spec"]["renewTime"] != before["spec"]["renewTime"]
                    )

                await wait_for("the holder to renew after the outage", LEASE * 3, renewed_after)
                # Several of the watcher's reconciles, each past the Lease and its grace.
                deadline = time.monotonic() + LEASE + GRACE + 3
                while time.monotonic() < deadline:
                    assert sorted(await admin.names(holder_name)) == sorted(held)
                    await anyio.sleep(0.5)
                assert not [e for e in events if e.name == "reconcile.orphan"]
                assert {r.id for r in holder.list() if r.state == "leased"} == set(held)
                assert watcher.owner != holder.owner
    finally:
        await sweep(admin, holder_name, watcher_name)
