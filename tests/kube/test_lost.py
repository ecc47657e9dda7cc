"""Sandboxes the cluster takes away: each becomes lost with its reason, its holder's next
call raises `SandboxLost` saying so, and ``sandman_sandboxes_lost_total`` counts it.

On the real node: a real OOM (the kernel's OOM killer in the pod's memory cgroup) and an
eviction through the eviction API. On KWOK nodes each test makes for itself (tainted
and labelled so no one else's pod lands there; deleted afterwards): a drain (cordon,
then evict each pod, as ``kubectl drain`` does), a preemption by a pod of a higher
PriorityClass on a full node, the node deleted (the pod garbage collector deletes its
pods after its 40 s quarantine, marking them ``DeletionByPodGC``), and and the node
NotReady (the node lifecycle controller taints it ``not-ready:NoExecute``, and the taint
manager evicts its pods once `KubernetesConfig.node_lost_after` has passed; a node that
stops answering is tainted ``unreachable`` instead, 50 s after its last heartbeat).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sandman import errors
from sandman.client import AsyncClient, InProcessBackend
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from sandman.server.metrics import Metrics
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import BUSYBOX, Admin, config_for, provider_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 480)]

# A shared cluster under a burst of other tests' pods can take minutes to start one.
START_WITHIN = 240.0
LOST_WITHIN = 90.0  # a watch event away, but the kubelet may take a sync to kill a container
# The pod garbage collector checks every 20 s and deletes a missing node's pods once it
# has been missing for 40 s.
NODE_LOST_WITHIN = 150.0
NODE_READY_WITHIN = 60.0
# The node lifecycle controller's next check (5 s), then the pods' tolerationSeconds
# (`KubernetesConfig.node_lost_after`, 5 s here).
NODE_AWAY_WITHIN = 120.0  # well under the 300 s the pods would wait without it
TEST_TAINT = "sandman.io/test-node"


def lost_counts(metrics: Metrics, pool: str) -> dict[str, float]:
    """``sandman_sandboxes_lost_total`` of the pool, by reason, but those at 0."""
    counts = {
        reason: metrics.registry.get_sample_value(
            "sandman_sandboxes_lost_total", {"pool": pool, "reason": reason}
        )
        for reason in errors.SandboxLost.REASONS
    }
    return {reason: count for reason, count in counts.items() if count}


@contextlib.asynccontextmanager
async def counted_pool(
    provider: KubernetesProvider, name: str
) -> AsyncIterator[tuple[Pool, Metrics]]:
    """A pool whose events feed the service's metrics, as `sandman serve` wires them."""
    async with Pool(provider, PoolConfig(name=name)) as pool:
        metrics = Metrics(pool)
        pool.add_hook(metrics.hook)
        yield pool, metrics


async def lost_as(pool: Pool, sandbox_id: str, within: float) -> errors.SandboxLost:
    """The `SandboxLost` the holder's next question gets, once the pool knows."""

    async def told() -> errors.SandboxLost | None:
        try:
            await pool.check(sandbox_id)
        except errors.SandboxLost as exc:
            return exc
        return None

    return await wait_for(f"sandbox {sandbox_id} to be lost", within, told, interval=0.5)


# -- the real node ---------------------------------------------------------------------------


@pytest.fixture
async def real_provider(
    kube_cluster: KubeCluster, real_node: str
) -> AsyncIterator[KubernetesProvider]:
    async with provider_for(kube_cluster) as provider:
        yield provider


async def test_a_sandbox_the_oom_killer_ends_is_lost_as_oom(
    kube_cluster: KubeCluster, real_provider: KubernetesProvider, pool_name: str
) -> None:
    """The daemon makes the OOM killer prefer its commands (their oom_score_adj is 1000),
    so a memory hog dies and the sandbox lives on. Here the daemon (PID 1 of the
    container) is made as preferred, and the memory is taken by a file in /dev/shm (a
    tmpfs charged to the container, in no process's RSS): the daemon, the largest
    process, is the kernel's choice, the container ends ``OOMKilled``."""
    async with (
        counted_pool(real_provider, pool_name) as (pool, metrics),
        AsyncClient(InProcessBackend(pool, own_pool=False)) as client,
    ):
        sb = await client.acquire(
            real_node_spec(kube_cluster).model_copy(update={"memory": 48 * 2**20}),
            timeout=START_WITHIN,
        )
        assert (await sb.exec("true")).exit_code == 0
        await sb.spawn(
            "echo 1000 > /proc/1/oom_score_adj && head -c 60000000 /dev/zero > /dev/shm/fill"
        )
        lost = await lost_as(pool, sb.id, LOST_WITHIN)
        assert lost.reason == "oom", lost
        assert "OOMKilled" in str(lost)
        with pytest.raises(errors.SandboxLost, match=r"lost \(oom\)") as caught:
            await sb.exec("true", timeout=5)
        assert caught.value.reason == "oom"
        assert lost_counts(metrics, pool_name) == {"oom": 1}
        await sb.release()


async def test_a_sandbox_evicted_through_the_eviction_api_is_lost_as_evicted(
    kube_cluster: KubeCluster, real_provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    async with (
        counted_pool(real_provider, pool_name) as (pool, metrics),
        AsyncClient(InProcessBackend(pool, own_pool=False)) as client,
    ):
        sb = await client.acquire(real_node_spec(kube_cluster), timeout=START_WITHIN)
        assert (await sb.exec("true")).exit_code == 0
        await evict(admin, sb.id)
        lost = await lost_as(pool, sb.id, LOST_WITHIN)
        assert lost.reason == "evicted", lost
        assert "EvictionByEvictionAPI" in str(lost)

        async def told() -> errors.SandboxLost | None:
            try:
                await sb.exec("true", timeout=5)
            except errors.SandboxLost as exc:
                return exc
            return None  # calls go to the daemon: it answers until its container is killed

        said = await wait_for("the holder's next call to fail", LOST_WITHIN, told)
        assert said.reason == "evicted" and "lost (evicted)" in str(said)
        assert lost_counts(metrics, pool_name) == {"evicted": 1}
        await sb.release()


async def evict(admin: Admin, name: str) -> None:
    """POST pods/eviction, as ``kubectl drain`` does for each pod."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": admin.cluster.namespace},
    }
    response = await admin.http.post(f"{admin.pods}/{name}/eviction", json=body)
    assert response.status_code == 201, response.text


# -- KWOK nodes of a test's own -------------------------------------------------------------


class Node:
    """A KWOK node only this test's pods go to (its own taint and hostname)."""

    def __init__(self, admin: Admin, cpu: str) -> None:
        self.admin = admin
        self.name = f"sandman-test-{secrets.token_hex(4)}"
        self.cpu = cpu
        self.url = f"/api/v1/nodes/{self.name}"

    @property
    def options(self) -> KubernetesOptions:
        """Pod placement onto this node, and nowhere else."""
        return KubernetesOptions(
            cpu_request=0.6,
            memory_request="1Mi",
            node_selector={"kubernetes.io/hostname": self.name},
            tolerations=[
                {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"},
                {"key": TEST_TAINT, "operator": "Exists", "effect": "NoSchedule"},
            ],
        )

    async def create(self) -> None:
        resources = {"cpu": self.cpu, "memory": "4Gi", "pods": "10"}
        body = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": self.name,
                "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                # No type=kwok: the other tests' KWOK pods select that.
                "labels": {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux"},
            },
            "spec": {"taints": [
                {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"},
                {"key": TEST_TAINT, "value": self.name, "effect": "NoSchedule"},
            ]},
            "status": {"allocatable": resources, "capacity": resources},
        }  # fmt: skip
        response = await self.admin.http.post("/api/v1/nodes", json=body)
        response.raise_for_status()

        async def ready() -> bool:
            response = await self.admin.http.get(self.url)
            response.raise_for_status()
            body = response.json()
            conditions = body.get("status", {}).get("conditions") or []
            # The node lifecycle controller lifts its not-ready taint a moment after Ready.
            taints = {t["key"] for t in body["spec"].get("taints") or []}
            return taints <= {"kwok.x-k8s.io/node", TEST_TAINT} and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            )

        await wait_for(f"KWOK node {self.name} to be Ready, untainted", NODE_READY_WITHIN, ready)

    async def cordon(self) -> None:
        response = await self.admin.http.patch(
            self.url,
            json={"spec": {"unschedulable": True}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()

    async def fail(self) -> None:
        """Report the node NotReady, as a kubelet whose runtime is down does. KWOK lets go of
        it first (or its heartbeat would say Ready again); the node lifecycle controller
        then taints it ``node.kubernetes.io/not-ready:NoExecute``."""
        merge = {"Content-Type": "application/merge-patch+json"}
        response = await self.admin.http.patch(
            self.url, json={"metadata": {"annotations": {"kwok.x-k8s.io/node": None}}},
            headers=merge,
        )  # fmt: skip
        response.raise_for_status()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = {
            "type": "Ready", "status": "False", "reason": "KubeletNotReady",
            "message": "container runtime is down", "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }  # fmt: skip
        response = await self.admin.http.patch(
            f"{self.url}/status",
            json={"status": {"conditions": [ready]}},
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        response.raise_for_status()

    async def pods(self) -> list[str]:
        """Every pod bound to the node, in the test namespace (the only one that uses it)."""
        response = await self.admin.http.get(
            self.admin.pods, params={"fieldSelector": f"spec.nodeName={self.name}"}
        )
        response.raise_for_status()
        return [pod["metadata"]["name"] for pod in response.json()["items"]]

    async def delete(self) -> None:
        response = await self.admin.http.delete(self.url)
        assert response.status_code in (200, 404), response.text


@pytest.fixture
async def node(admin: Admin) -> AsyncIterator[Node]:
    """A KWOK node of one CPU: one sandbox (0.6 CPU requested) fills it."""
    made = Node(admin, cpu="1")
    await made.create()
    try:
        yield made
    finally:
        await made.delete()
        for name in await made.pods():  # the node's pods go with it only after the GC
            await admin.delete(name)


@pytest.fixture
async def kwok_provider(kube_cluster: KubeCluster) -> AsyncIterator[KubernetesProvider]:
    async with provider_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY) as provider:
        yield provider


async def test_a_drained_nodes_sandbox_is_lost_as_evicted(
    kwok_provider: KubernetesProvider, node: Node, pool_name: str
) -> None:
    spec = SandboxSpec(image=BUSYBOX, kubernetes=node.options)
    async with counted_pool(kwok_provider, pool_name) as (pool, metrics):
        session = pool.open_session(lease=600)
        record = await pool.acquire(spec, session=session, timeout=START_WITHIN)
        # kubectl drain: cordon, then evict each pod.
        await node.cordon()
        assert await node.pods() == [record.id]
        await evict(node.admin, record.id)
        lost = await lost_as(pool, record.id, LOST_WITHIN)
        assert lost.reason == "evicted", lost
        assert lost_counts(metrics, pool_name) == {"evicted": 1}


async def test_a_sandbox_preempted_by_a_higher_priority_pod_is_lost_as_preempted(
    kube_cluster: KubeCluster, admin: Admin, node: Node, pool_name: str
) -> None:
    low, high = (f"sandman-test-{level}-{secrets.token_hex(3)}" for level in ("low", "high"))
    classes = "/apis/scheduling.k8s.io/v1/priorityclasses"
    for name, value in ((low, 100), (high, 1000)):
        response = await admin.http.post(classes, json={
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": name}, "value": value,
        })  # fmt: skip
        response.raise_for_status()
    preemptor = f"sandman-test-preemptor-{secrets.token_hex(3)}"
    provider = KubernetesProvider(
        config_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY,
                   priority_class_name=low)
    )  # fmt: skip
    try:
        spec = SandboxSpec(image=BUSYBOX, kubernetes=node.options)
        async with counted_pool(provider, pool_name) as (pool, metrics):
            session = pool.open_session(lease=600)
            record = await pool.acquire(spec, session=session, timeout=START_WITHIN)
            victim = await admin.pod(record.id)
            assert victim is not None and victim["spec"]["priorityClassName"] == low
            assert victim["spec"]["priority"] == 100
            # The node is full (0.6 of its 1 CPU requested): a pod of the higher class
            # that must go there takes the sandbox's place.
            response = await admin.http.post(admin.pods, json=pinned_pod(preemptor, node, high))
            response.raise_for_status()
            lost = await lost_as(pool, record.id, LOST_WITHIN)
            assert lost.reason == "preempted", lost
            assert "PreemptionByScheduler" in str(lost)
            assert lost_counts(metrics, pool_name) == {"preempted": 1}

            async def placed() -> bool:
                pod = await admin.pod(preemptor)
                return bool(pod and pod["spec"].get("nodeName") == node.name)

            await wait_for("the preemptor to take the node", LOST_WITHIN, placed)
    finally:
        await provider.aclose()
        await admin.delete(preemptor)
        for name in (low, high):
            await admin.http.delete(f"{classes}/{name}")


async def test_a_priority_class_that_does_not_exist_is_a_config_error(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster, readiness="pod"))
    spec = SandboxSpec(
        image=BUSYBOX, kubernetes=KubernetesOptions(priority_class_name="sandman-no-such-class")
    )
    try:
        with pytest.raises(errors.ConfigError, match="'sandman-no-such-class' does not exist"):
            await provider.create(spec, labels={"sandman.io/pool": pool_name})
    finally:
        await provider.aclose()
    assert await admin.names(pool_name) == []


def pinned_pod(name: str, node: Node, priority_class: str) -> dict[str, Any]:
    options = node.options
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": KWOK_NO_DELAY},
        "spec": {
            "priorityClassName": priority_class,
            "nodeSelector": options.node_selector,
            "tolerations": options.tolerations,
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "c", "image": BUSYBOX,
                "resources": {"requests": {"cpu": "600m", "memory": "1Mi"},
                              "limits": {"cpu": "600m", "memory": "16Mi"}},
            }],
        },
    }  # fmt: skip


@pytest.mark.timeout(SETUP_TIMEOUT + START_WITHIN + NODE_LOST_WITHIN + 120)
async def test_the_sandbox_of_a_deleted_node_is_lost_as_node_lost(
    kwok_provider: KubernetesProvider, node: Node, pool_name: str
) -> None:
    spec = SandboxSpec(image=BUSYBOX, kubernetes=node.options)
    async with counted_pool(kwok_provider, pool_name) as (pool, metrics):
        session = pool.open_session(lease=600)
        record = await pool.acquire(spec, session=session, timeout=START_WITHIN)
        await node.delete()
        lost = await lost_as(pool, record.id, NODE_LOST_WITHIN)
        assert lost.reason == "node_lost", lost
        assert "DeletionByPodGC" in str(lost)
        assert lost_counts(metrics, pool_name) == {"node_lost": 1}


@pytest.mark.timeout(SETUP_TIMEOUT + START_WITHIN + NODE_AWAY_WITHIN + 120)
async def test_the_sandbox_of_a_node_gone_not_ready_is_lost_as_node_lost(
    kube_cluster: KubeCluster, admin: Admin, node: Node, pool_name: str
) -> None:
    provider = KubernetesProvider(
        config_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY, node_lost_after=5)
    )
    try:
        spec = SandboxSpec(image=BUSYBOX, kubernetes=node.options)
        async with counted_pool(provider, pool_name) as (pool, metrics):
            session = pool.open_session(lease=600)
            record = await pool.acquire(spec, session=session, timeout=START_WITHIN)
            pod = await admin.pod(record.id)
            assert pod is not None
            waits = {t["key"]: t.get("tolerationSeconds") for t in pod["spec"]["tolerations"]}
            assert waits["node.kubernetes.io/not-ready"] == 5  # not the admission's 300
            await node.fail()
            lost = await lost_as(pool, record.id, NODE_AWAY_WITHIN)
            assert lost.reason == "node_lost", lost
            assert "DeletionByTaintManager" in str(lost)
            assert lost_counts(metrics, pool_name) == {"node_lost": 1}
    finally:
        await provider.aclose()
