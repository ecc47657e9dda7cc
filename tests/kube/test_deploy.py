"""deploy/ on the harness cluster: it renders, applies, grants exactly the pod verbs, and goes.

The manifests are applied through overlays into scratch namespaces (never the
harness's own ``sandman``): once with the Deployment at 0 replicas to check
what the API server accepts and what RBAC allows, and once for real, with the
service image built offline (`tests.kube.service_image`), serving a sandbox
that it creates as its own service account.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandman
from tests.images.registry_server import free_port
from tests.kube.conftest import KubeCluster
from tests.kube.deployment import (
    DEPLOY,
    GONE_TIMEOUT,
    create_namespace,
    deployed,
    kubectl,
    sandbox_pods,
    serving_overlay,
    wait_serving,
    write_overlay,
)

pytestmark = [pytest.mark.kube, pytest.mark.timeout(240)]

SERVICE_ACCOUNT = "sandman"
POD_VERBS = ("create", "delete", "get", "list", "patch", "watch")
LEASE_VERBS = ("create", "delete", "get", "list", "patch")
RBAC_SETTLE_TIMEOUT = 30.0


def can_i(cluster: KubeCluster, namespace: str, verb: str, resource: str, in_ns: str) -> bool:
    """Whether the deployed service account may `verb` `resource` (``pods/exec`` names a
    subresource) in namespace `in_ns`."""
    account = f"system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}"
    return can_i_as(cluster, account, verb, resource, in_ns)


def can_i_as(
    cluster: KubeCluster, user: str, verb: str, resource: str, in_ns: str | None = None
) -> bool:
    """Whether `user` may `verb` `resource`: in namespace `in_ns`, or cluster-wide (None)."""
    # kubectl reads "pods/exec" as TYPE/NAME, so pass the subresource as a flag.
    resource, _, subresource = resource.partition("/")
    where = ["-n", in_ns] if in_ns else ["--all-namespaces"]
    proc = kubectl(
        cluster, "auth", "can-i", verb, resource, f"--subresource={subresource}", *where,
        f"--as={user}", check=False,
    )  # fmt: skip
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"can-i {verb} {resource}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


def wait_granted(
    cluster: KubeCluster, user: str, verb: str, resource: str, in_ns: str | None = None
) -> None:
    """Wait until the authorizer has seen a new binding (its RBAC cache lags a write)."""
    deadline = time.monotonic() + RBAC_SETTLE_TIMEOUT
    while not can_i_as(cluster, user, verb, resource, in_ns):
        assert time.monotonic() < deadline, f"{user} never got {verb} {resource}"
        time.sleep(0.2)


@pytest.fixture
def applied(kube_cluster: KubeCluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """deploy/ applied into a fresh namespace with the Deployment at 0 replicas."""
    namespace = f"sandman-deploy-test-{secrets.token_hex(3)}"
    path = write_overlay(tmp_path, namespace, "replicas: [{name: sandman, count: 0}]\n")
    with deployed(kube_cluster, path, namespace) as objects:
        yield {"namespace": namespace, "objects": objects}


def test_deploy_renders(kube_cluster: KubeCluster) -> None:
    rendered = kubectl(kube_cluster, "kustomize", str(DEPLOY)).stdout
    kinds = [
        line.split(":", 1)[1].strip() for line in rendered.splitlines() if line.startswith("kind:")
    ]
    assert sorted(kinds) == sorted(
        ["Namespace", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "NetworkPolicy",
         "Deployment", "Service", "PodDisruptionBudget"]
    )  # fmt: skip


def test_deploy_applies_with_least_privilege(
    kube_cluster: KubeCluster, applied: dict[str, Any]
) -> None:
    namespace = applied["namespace"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in applied["objects"]}
    assert kinds == {
        ("Namespace", namespace),
        ("ServiceAccount", "sandman"),
        ("Role", "sandman-provider"),
        ("RoleBinding", "sandman-provider"),
        ("NetworkPolicy", "sandman-sandboxes"),
        ("NetworkPolicy", "sandman-sandboxes-egress"),
        ("Deployment", "sandman"),
        ("Service", "sandman"),
        ("PodDisruptionBudget", "sandman"),
    }
    for obj in applied["objects"]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]

    # Exactly the pod verbs, in its own namespace only.
    account = f"system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}"
    wait_granted(kube_cluster, account, "create", "pods", namespace)
    for verb in POD_VERBS:
        assert can_i(kube_cluster, namespace, verb, "pods", namespace), verb
    # Its owner record: one Lease per pool process.
    for verb in LEASE_VERBS:
        assert can_i(kube_cluster, namespace, verb, "leases.coordination.k8s.io", namespace), verb
    denied = [
        ("update", "pods"), ("deletecollection", "pods"),
        ("watch", "leases.coordination.k8s.io"), ("deletecollection", "leases.coordination.k8s.io"),
        ("create", "pods/exec"), ("get", "pods/exec"), ("get", "pods/log"),
        ("create", "pods/eviction"), ("create", "pods/portforward"),
        ("get", "secrets"), ("list", "secrets"), ("get", "configmaps"),
        ("create", "services"), ("create", "deployments.apps"), ("list", "events"),
        ("create", "roles.rbac.authorization.k8s.io"), ("list", "nodes"),
    ]  # fmt: skip
    for verb, resource in denied:
        assert not can_i(kube_cluster, namespace, verb, resource, namespace), (verb, resource)
    for other in ("default", kube_cluster.namespace, "kube-system"):
        for verb in POD_VERBS:
            assert not can_i(kube_cluster, namespace, verb, "pods", other), (verb, other)
        assert not can_i(kube_cluster, namespace, "create", "leases.coordination.k8s.io", other)

    # The API server accepted both NetworkPolicies as written.
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in json.loads(
            kubectl(kube_cluster, "-n", namespace, "get", "networkpolicies", "-o", "json").stdout
        )["items"]
    }
    sandboxes = policies["sandman-sandboxes"]
    assert sandboxes["policyTypes"] == ["Ingress", "Egress"]
    assert sandboxes.get("egress", []) == []  # egress denied unless opted in
    [rule] = sandboxes["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "sandmand"}]
    # Clients, never a sandbox (what the policies mean: tests/providers/kubernetes/
    # test_networkpolicy.py; enforced on the real node: test_network_policy.py).
    no_sandbox = {"key": "sandman.io/pool", "operator": "DoesNotExist"}
    assert rule["from"] == [
        {"namespaceSelector": {}, "podSelector": {
            "matchLabels": {"sandman.io/client": "true"}, "matchExpressions": [no_sandbox]}}
    ]  # fmt: skip
    egress = policies["sandman-sandboxes-egress"]
    assert egress["policyTypes"] == ["Egress"]
    assert {"key": "sandman.io/egress", "operator": "In", "values": ["allow"]} in egress[
        "podSelector"
    ]["matchExpressions"]
    blocks = [p["ipBlock"] for r in egress["egress"] for p in r["to"] if "ipBlock" in p]
    assert {b["cidr"] for b in blocks} == {"0.0.0.0/0", "::/0"}
    excepted = {e for b in blocks for e in b["except"]}
    assert {"169.254.0.0/16", "10.0.0.0/8", "fe80::/10", "fc00::/7"} <= excepted

    # The Deployment runs the service as that service account, and its pods
    # are clients of the sandboxes.
    deployment = json.loads(
        kubectl(kube_cluster, "-n", namespace, "get", "deployment", "sandman", "-o", "json").stdout
    )
    pod = deployment["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    assert pod["metadata"]["labels"]["sandman.io/client"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["args"][:3] == ["serve", "--provider", "kubernetes"]
    # A roll leaves the sandboxes to the next replica, which starts once the old one stopped.
    assert container["args"][-2:] == ["--on-shutdown", "leave"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    probes = {k: container[k]["httpGet"]["path"]
              for k in ("startupProbe", "readinessProbe", "livenessProbe")}  # fmt: skip
    assert probes == {"startupProbe": "/v1/live", "readinessProbe": "/v1/ready",
                      "livenessProbe": "/v1/live"}  # fmt: skip
    assert deployment["spec"]["replicas"] == 0
    # Evictions are refused while it is ready (a roll moves it: pdb.yaml).
    pdb = json.loads(kubectl(kube_cluster, "-n", namespace, "get", "pdb", "sandman", "-o",
                             "json").stdout)["spec"]  # fmt: skip
    assert pdb["maxUnavailable"] == 0
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_node_reader_component_adds_node_reads_only(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    """The optional component lets the service read nodes (for steering) and nothing more."""
    suffix = secrets.token_hex(3)
    namespace = f"sandman-deploy-test-{suffix}"
    path = write_overlay(
        tmp_path, namespace,
        # ClusterRole names are cluster-wide. Quoted: "-123456" is a number in YAML.
        f"nameSuffix: {json.dumps('-' + suffix)}\n"
        f"components: [{os.path.relpath(DEPLOY / 'node-reader', tmp_path)}]\n"
        "replicas: [{name: sandman, count: 0}]\n",
    )  # fmt: skip
    cluster_wide = [f"clusterrole/sandman-node-reader-{suffix}",
                    f"clusterrolebinding/sandman-node-reader-{suffix}"]  # fmt: skip
    account = f"system:serviceaccount:{namespace}:sandman-{suffix}"
    try:
        with deployed(kube_cluster, path, namespace):
            wait_granted(kube_cluster, account, "list", "nodes")
            for verb in ("get", "list", "watch"):
                assert can_i_as(kube_cluster, account, verb, "nodes"), verb
            for verb, resource in [("update", "nodes"), ("patch", "nodes"), ("delete", "nodes"),
                                   ("get", "nodes/proxy"), ("list", "secrets"),
                                   ("list", "pods")]:  # fmt: skip
                assert not can_i_as(kube_cluster, account, verb, resource), (verb, resource)
            assert can_i_as(kube_cluster, account, "create", "pods", namespace)
    finally:
        kubectl(kube_cluster, "delete", "--ignore-not-found", *cluster_wide)
    for name in cluster_wide:
        assert kubectl(kube_cluster, "get", name, check=False).returncode != 0, name


# A cold cache builds the Debian base with debootstrap first (tests/images/debian.py).
@pytest.mark.timeout(1800)
def test_deployed_service_serves_sandboxes_with_only_its_role(
    kube_cluster: KubeCluster, service_image: str, tmp_path: Path
) -> None:
    """The Deployment runs for real and, as its service account, makes a sandbox pod."""
    namespace = f"sandman-deploy-test-{secrets.token_hex(3)}"
    port = free_port()
    key = secrets.token_hex(16)
    path = serving_overlay(tmp_path / "overlay", namespace, kube_cluster, service_image, port, {})
    create_namespace(kube_cluster, namespace, key)
    with deployed(kube_cluster, path, namespace):
        wait_serving(kube_cluster, namespace)

        async def use() -> tuple[str, list[str]]:
            async with (
                sandman.connect(f"http://127.0.0.1:{port}", api_key=key) as client,
                client.sandbox("sandman.local/busybox:1.35") as sandbox,
            ):
                result = await sandbox.exec("echo hello from $(hostname)", timeout=30)
                return result.stdout.strip(), sandbox_pods(kube_cluster, namespace)

        said, pods = asyncio.run(use())
        assert said.startswith("hello from ")
        assert pods != [], "no sandbox pod labelled with the deployment's pool"
        deadline = time.monotonic() + GONE_TIMEOUT
        while sandbox_pods(kube_cluster, namespace):
            assert time.monotonic() < deadline, "the released sandbox's pod is still there"
            time.sleep(0.5)
