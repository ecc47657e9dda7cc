"""What the Kubernetes provider's cluster tests share: specs, settings, waiting, and
an admin client that sweeps a test's pods."""

from __future__ import annotations

import ssl
from typing import Any, TypeVar

import httpx

from sandman.models import KubernetesOptions, SandboxSpec
from sandman.settings import KubernetesConfig
from tests.kube.conftest import KubeCluster

BUSYBOX = "sandman.local/busybox:1.35"
POOL = "sandman.io/pool"
T = TypeVar("T")


def real_node_spec(cluster: KubeCluster, **fields: Any) -> SandboxSpec:
    """A small busybox sandbox pinned to the real node (KWOK nodes run nothing)."""
    return SandboxSpec(
        image=BUSYBOX,
        cpu=0.5,
        memory="128Mi",
        kubernetes=KubernetesOptions(
            cpu_request=0.05,
            memory_request="32Mi",
            ephemeral_storage="256Mi",
            node_selector={"kubernetes.io/hostname": cluster.real_node},
        ),
        **fields,
    )


KWOK = KubernetesOptions(
    cpu_request=0.001,
    memory_request="1Mi",
    node_selector={"type": "kwok"},
    tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
)


def config_for(cluster: KubeCluster, **fields: Any) -> KubernetesConfig:
    return KubernetesConfig(kubeconfig=cluster.kubeconfig, namespace=cluster.namespace, **fields)


class Admin:
    """The harness's admin identity: sees and removes whatever a test left."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self.http = httpx.AsyncClient(
            base_url=cluster.server,
            verify=ssl.create_default_context(cafile=str(cluster.ca)),
            headers={"Authorization": f"Bearer {cluster.admin_token}"},
            timeout=30,
        )
        self.pods = f"/api/v1/namespaces/{cluster.namespace}/pods"

    async def names(self, pool: str) -> list[str]:
        response = await self.http.get(self.pods, params={"labelSelector": f"{POOL}={pool}"})
        response.raise_for_status()
        return [p["metadata"]["name"] for p in response.json()["items"]]

    async def pod(self, name: str) -> dict[str, Any] | None:
        response = await self.http.get(f"{self.pods}/{name}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    async def delete(self, name: str) -> None:
        await self.http.delete(f"{self.pods}/{name}", params={"gracePeriodSeconds": 0})

    async def sweep(self, pool: str) -> list[str]:
        """Delete every pod of the pool; returns their names."""
        left = await self.names(pool)
        for name in left:
            await self.delete(name)
        return left
