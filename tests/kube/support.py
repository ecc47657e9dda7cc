"""What the Kubernetes provider's cluster tests share: specs, settings, waiting, and
an admin client that sweeps a test's pods."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from sandman.models import KubernetesOptions, SandboxSpec
from sandman.providers.kubernetes import KubernetesProvider
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


@contextlib.asynccontextmanager
async def provider_for(cluster: KubeCluster, **fields: Any) -> AsyncIterator[KubernetesProvider]:
    """A provider on the cluster with these settings, closed after the block."""
    provider = KubernetesProvider(config_for(cluster, **fields))
    try:
        yield provider
    finally:
        await provider.aclose()


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
        self.leases = f"/apis/coordination.k8s.io/v1/namespaces/{cluster.namespace}/leases"

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

    async def lease(self, name: str) -> dict[str, Any] | None:
        """A Lease of the namespace; None when there is none."""
        response = await self.http.get(f"{self.leases}/{name}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    async def owner_leases(self) -> list[str]:
        """The names of Sandman's owner Leases in the namespace."""
        response = await self.http.get(
            self.leases, params={"labelSelector": "app.kubernetes.io/managed-by=sandman"}
        )
        response.raise_for_status()
        return [item["metadata"]["name"] for item in response.json()["items"]]

    async def delete_lease(self, name: str) -> None:
        await self.http.delete(f"{self.leases}/{name}")

    async def owned_by(self, owner: str) -> list[str]:
        """The pods that name ``owner`` (``sandman.io/owner``)."""
        response = await self.http.get(
            self.pods, params={"labelSelector": f"sandman.io/owner={owner}"}
        )
        response.raise_for_status()
        return [p["metadata"]["name"] for p in response.json()["items"]]


class CutProxy:
    """A TCP proxy to the API server that can be cut: every connection through it closed,
    and new ones closed as soon as they are made (as an API server away would)."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 443
        self.url = ""
        self.cut = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"https://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    def sever(self) -> None:
        """Cut: close every connection, refuse new ones until `restore`."""
        self.cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.cut = False

    async def aclose(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def cut_proxy(cluster: KubeCluster) -> AsyncIterator[CutProxy]:
    proxy = CutProxy(cluster.server)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.aclose()


def config_via(
    proxy: CutProxy, cluster: KubeCluster, token_file: Path, **fields: Any
) -> KubernetesConfig:
    """The ordinary identity's settings, through ``proxy``."""
    token_file.write_text(cluster.token)
    return KubernetesConfig(
        server=proxy.url, token_file=token_file, ca_file=cluster.ca,
        namespace=cluster.namespace, **fields,
    )  # fmt: skip
