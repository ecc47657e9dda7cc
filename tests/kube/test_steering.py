"""Steering toward nodes that hold the image, on the hack/kube cluster.

The harness's ordinary identity ``sandman`` has a namespaced Role (pods,
pods/exec, events) and no node reads: with it, steering turns itself off
with one warning and the create goes on. The steered create therefore runs
as the admin identity, standing in for one granted ``deploy/node-reader/``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sandman.models import SandboxSpec
from sandman.providers.kubernetes import KubernetesProvider
from sandman.settings import KubernetesConfig
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

STEERING_LOG = "sandman.providers.kubernetes.steering"


def pinned_by_affinity(cluster: KubeCluster) -> SandboxSpec:
    """Busybox (which the real node holds), pinned to the real node by the caller's own
    required affinity: the one steering must keep."""
    required = {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [cluster.real_node]}]}]}  # fmt: skip
    spec = real_node_spec(cluster)
    assert spec.kubernetes is not None
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    kubernetes = spec.kubernetes.model_copy(update={"node_selector": {}, "affinity": affinity})
    return spec.model_copy(update={"kubernetes": kubernetes})


def preferred_nodes(pod: dict[str, Any]) -> list[list[str]]:
    node = (pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    return [
        expression["values"]
        for term in node.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        for expression in term["preference"].get("matchFields") or []
        if expression["key"] == "metadata.name"
    ]


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_a_pod_is_steered_to_the_node_holding_its_image(
    kube_cluster: KubeCluster, real_node: str, admin: Admin, pool_name: str
) -> None:
    config = KubernetesConfig(
        kubeconfig=kube_cluster.admin_kubeconfig,
        namespace=kube_cluster.namespace,
        prefer_nodes_with_image=True,
        start_timeout=120,
    )
    provider = KubernetesProvider(config)
    try:
        info = await provider.create(pinned_by_affinity(kube_cluster), labels={POOL: pool_name})
        pod = await admin.pod(info.id)
        assert pod is not None
        assert preferred_nodes(pod) == [[real_node]]
        affinity = pod["spec"]["affinity"]["nodeAffinity"]
        assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"
        ][0]["values"] == [real_node]
        assert pod["spec"]["nodeName"] == real_node
        assert provider.node_images is not None and provider.node_images.enabled
        await provider.delete(info.id)
    finally:
        await provider.aclose()


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_without_node_reads_steering_is_off_and_creates_go_on(
    kube_cluster: KubeCluster,
    real_node: str,
    admin: Admin,
    pool_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    provider = KubernetesProvider(
        config_for(kube_cluster, prefer_nodes_with_image=True, start_timeout=120)
    )
    try:
        with caplog.at_level(logging.WARNING, logger=STEERING_LOG):
            for _ in range(2):
                info = await provider.create(
                    pinned_by_affinity(kube_cluster), labels={POOL: pool_name}
                )
                pod = await admin.pod(info.id)
                assert pod is not None
                assert preferred_nodes(pod) == []
                assert pod["spec"]["nodeName"] == real_node
                await provider.delete(info.id)
        warnings = [r for r in caplog.records if r.name == STEERING_LOG]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "may not list nodes" in warnings[0].getMessage()
        assert provider.node_images is not None and not provider.node_images.enabled
    finally:
        await provider.aclose()
