"""deploy/networkpolicy.yaml enforced on the harness's real node.

hack/kube/up runs kube-router's network-policy controller for the real node
(the CNI bridge plugin alone ignores NetworkPolicies). Each test applies the
policies directly into a scratch namespace of its own (never ``sandman``),
with sandboxes made by the Kubernetes provider (as admin, in that namespace)
and plain busybox pods as clients. Every path asserted blocked is first shown
open without the policies, so a test fails if nothing is enforced; connections
are made from inside the pods with busybox ``nc`` (exit 0: connected).

Skipped unless the harness says it enforces policies (``SANDMAN_KUBE_NETPOL=1``
in its env file, or in the environment for a harness started before it wrote
that); with ``1`` the tests fail when nothing enforces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import pytest

import sandman
from sandman.client import AsyncSandbox
from sandman.pool import PoolConfig
from sandman.settings import KubernetesConfig
from tests.kube.conftest import REPO, SETUP_TIMEOUT, KubeCluster
from tests.kube.deployment import kubectl, scratch_namespace
from tests.kube.support import BUSYBOX, real_node_spec

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 300)]

POLICIES = REPO / "deploy" / "networkpolicy.yaml"
METADATA = "169.254.169.254"
CONNECT_TIMEOUT = 3  # nc -w: a dropped SYN reads as blocked after this long
CONVERGE = 60.0  # a policy (or pod) change until the node's rules follow it
POD_READY = 120.0
NODE_PORTS = range(30000, 32768)  # kube-router lets pods reach these on the node


@pytest.fixture
def enforced(kube_cluster: KubeCluster, real_node: str) -> str:
    """The real node's address, on a harness that enforces NetworkPolicies."""
    env_file = kube_cluster.state_dir / "env"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    setting = os.environ.get("SANDMAN_KUBE_NETPOL") or env.get("SANDMAN_KUBE_NETPOL")
    if setting != "1":
        pytest.skip("the harness does not enforce NetworkPolicies (SANDMAN_KUBE_NETPOL)")
    node = json.loads(kubectl(kube_cluster, "get", "node", real_node, "-o", "json").stdout)
    [address] = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    return str(address)


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A scratch namespace, deleted (and checked gone) afterwards with all it holds."""
    with scratch_namespace(kube_cluster, "sandman-netpol-test") as name:
        yield name


def plain_pod(cluster: KubeCluster, namespace: str, name: str, labels: dict[str, str]) -> None:
    """A busybox pod (not a sandbox) on the real node, Ready."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": cluster.real_node},
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "c", "image": BUSYBOX, "command": ["sleep", "3600"],
                            "imagePullPolicy": "Never"}],
        },
    }  # fmt: skip
    kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(manifest))
    kubectl(
        cluster, "-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}",
        f"--timeout={int(POD_READY)}s",
    )  # fmt: skip


def pod_ip(cluster: KubeCluster, namespace: str, name: str) -> str:
    pod = json.loads(kubectl(cluster, "-n", namespace, "get", "pod", name, "-o", "json").stdout)
    return str(pod["status"]["podIP"])


def _connected(exit_code: int, stderr: str, what: str) -> bool:
    """nc's answer: connected, or refused / timed out; anything else is the test's fault."""
    if exit_code == 0:
        return True
    if "can't connect" in stderr or "timed out" in stderr:
        return False
    raise AssertionError(f"{what}: nc failed otherwise ({exit_code}): {stderr}")


def nc_argv(host: str, port: int) -> list[str]:
    # -e true: hang up as soon as connected (busybox nc has no -z).
    return ["nc", "-w", str(CONNECT_TIMEOUT), host, str(port), "-e", "true"]


def from_pod(
    cluster: KubeCluster, namespace: str, name: str, host: str, port: int
) -> Callable[[], Awaitable[bool]]:
    """Whether the plain pod `name` connects to host:port (one try per call)."""

    async def check() -> bool:
        proc = await anyio.to_thread.run_sync(
            lambda: kubectl(cluster, "-n", namespace, "exec", name, "--", *nc_argv(host, port),
                            check=False)
        )  # fmt: skip
        return _connected(proc.returncode, proc.stderr, f"{name} -> {host}:{port}")

    return check


def from_sandbox(sb: AsyncSandbox, host: str, port: int) -> Callable[[], Awaitable[bool]]:
    """Whether the sandbox connects to host:port; the provider's own exec (it dials the
    daemon from the node) must keep working throughout."""

    async def check() -> bool:
        result = await sb.exec(nc_argv(host, port))
        return _connected(result.exit_code, result.stderr, f"{sb.id} -> {host}:{port}")

    return check


async def converge(what: str, check: Callable[[], Awaitable[bool]], *, open_: bool) -> None:
    """Wait until `check` says open (or blocked); fail after CONVERGE seconds."""
    deadline = time.monotonic() + CONVERGE
    while (got := await check()) != open_:
        if time.monotonic() > deadline:
            state = "open" if got else "blocked"
            raise AssertionError(f"{what}: still {state} after {CONVERGE} s")
        await anyio.sleep(0.5)


@contextlib.asynccontextmanager
async def listener(host: str) -> AsyncIterator[int]:
    """A TCP listener on host (which pods would otherwise reach): accepts and hangs up."""

    async def serve(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    port = int(server.sockets[0].getsockname()[1])
    assert port not in NODE_PORTS, f"port {port} is in the node-port range kube-router opens"
    try:
        yield port
    finally:
        server.close()
        await server.wait_closed()


@contextlib.contextmanager
def metadata_address() -> Iterator[None]:
    """169.254.169.254 on an interface of this machine, so a refusal means the policy.

    A bridge with no port: this kernel has no dummy links, and a local address
    answers on any interface that is up."""
    link = f"snp{secrets.token_hex(3)}"
    subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{METADATA}/32", "dev", link], check=True)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        yield
    finally:
        subprocess.run(["ip", "link", "del", link], check=False)


def apply_policies(cluster: KubeCluster, namespace: str) -> None:
    kubectl(cluster, "-n", namespace, "apply", "-f", str(POLICIES))


def config_in(cluster: KubeCluster, namespace: str) -> KubernetesConfig:
    """The provider as admin in the scratch namespace (its own identity's Role covers
    only ``sandman``, where the policies would reach other tests' sandboxes)."""
    return KubernetesConfig(kubeconfig=cluster.admin_kubeconfig, namespace=namespace)


def pool(namespace: str) -> PoolConfig:
    return PoolConfig(name=f"np-{namespace[-6:]}")


async def test_only_clients_reach_a_sandboxs_daemon(
    kube_cluster: KubeCluster, enforced: str, namespace: str
) -> None:
    config = config_in(kube_cluster, namespace)
    port = config.daemon_port
    plain_pod(kube_cluster, namespace, "client", {"sandman.io/client": "true"})
    plain_pod(kube_cluster, namespace, "stranger", {})
    spec = real_node_spec(kube_cluster)
    async with (
        sandman.kubernetes(config, pool=pool(namespace)) as client,
        client.sandbox(spec, timeout=120) as target,
        client.sandbox(spec, timeout=120) as neighbour,
    ):
        ip = pod_ip(kube_cluster, namespace, target.id)
        paths = {
            "sandbox -> another sandbox's daemon": from_sandbox(neighbour, ip, port),
            "client pod -> sandbox daemon": from_pod(kube_cluster, namespace, "client", ip, port),
            "unlabelled pod -> sandbox daemon": from_pod(
                kube_cluster, namespace, "stranger", ip, port
            ),
        }
        # Without the policies every path is open: a refusal below is theirs.
        for what, check in paths.items():
            await converge(f"{what} (no policy)", check, open_=True)

        apply_policies(kube_cluster, namespace)
        await converge("sandbox -> another sandbox's daemon", paths[
            "sandbox -> another sandbox's daemon"], open_=False)  # fmt: skip
        await converge("unlabelled pod -> sandbox daemon", paths[
            "unlabelled pod -> sandbox daemon"], open_=False)  # fmt: skip
        await converge("client pod -> sandbox daemon", paths[
            "client pod -> sandbox daemon"], open_=True)  # fmt: skip
        # The provider reaches its sandboxes from the node under the policies.
        assert (await target.exec("echo ok")).stdout.strip() == "ok"

        # And it was the policies: without them the neighbour connects again.
        kubectl(kube_cluster, "-n", namespace, "delete", "-f", str(POLICIES))
        await converge("sandbox -> another sandbox's daemon (policies deleted)", paths[
            "sandbox -> another sandbox's daemon"], open_=True)  # fmt: skip


async def test_egress_reaches_neither_api_server_nor_metadata_nor_node_unless_allowed(
    kube_cluster: KubeCluster, enforced: str, namespace: str
) -> None:
    node_ip = enforced
    config = config_in(kube_cluster, namespace)
    spec = real_node_spec(kube_cluster, network="egress")
    with metadata_address():
        async with (
            # The API server binds 127.0.0.1 and advertises the node's address: a
            # listener there stands in for one that pods could reach.
            listener(node_ip) as api_port,
            listener(METADATA) as metadata_port,
            # A registry on the node, as an operator might run one for task images.
            listener(node_ip) as registry_port,
            sandman.kubernetes(config, pool=pool(namespace)) as client,
            client.sandbox(spec, timeout=120) as sb,
        ):
            api = from_sandbox(sb, node_ip, api_port)
            metadata = from_sandbox(sb, METADATA, metadata_port)
            registry = from_sandbox(sb, node_ip, registry_port)
            for what, check in (("api", api), ("metadata", metadata), ("registry", registry)):
                await converge(f"egress sandbox -> {what} (no policy)", check, open_=True)

            apply_policies(kube_cluster, namespace)
            await converge("egress sandbox -> API server address", api, open_=False)
            await converge("egress sandbox -> 169.254.169.254", metadata, open_=False)
            await converge("egress sandbox -> registry on the node", registry, open_=False)

            # The operator's own policy for the registry, as deploy/networkpolicy.yaml's
            # comment describes: policies add up; only that address and port open.
            allow = {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "operator-registry", "namespace": namespace},
                "spec": {
                    "podSelector": {"matchExpressions": [
                        {"key": "sandman.io/pool", "operator": "Exists"}]},
                    "policyTypes": ["Egress"],
                    "egress": [{"to": [{"ipBlock": {"cidr": f"{node_ip}/32"}}],
                                "ports": [{"protocol": "TCP", "port": registry_port}]}],
                },
            }  # fmt: skip
            kubectl(kube_cluster, "apply", "-f", "-", stdin=json.dumps(allow))
            await converge("egress sandbox -> registry, operator allowed", registry, open_=True)
            assert not await api(), "the registry's policy opened the API server's port"
            assert not await metadata(), "the registry's policy opened 169.254.169.254"
