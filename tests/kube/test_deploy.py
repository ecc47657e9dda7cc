"""deploy/ on the harness cluster: it renders, applies, grants exactly the pod verbs, and goes.

The manifests are applied through an overlay into a scratch namespace (so the
test never touches the harness's own ``sandman`` namespace), with the
Deployment at 0 replicas: the service image is not built offline here, so
the test checks what the API server accepts and what RBAC allows, not a
running service.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kube.conftest import REPO, KubeCluster

pytestmark = [pytest.mark.kube, pytest.mark.timeout(240)]

DEPLOY = REPO / "deploy"
SERVICE_ACCOUNT = "sandman"
POD_VERBS = ("create", "delete", "get", "list", "watch")
GONE_TIMEOUT = 120.0


def kubectl(
    cluster: KubeCluster, *argv: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run kubectl as the cluster admin."""
    proc = subprocess.run(
        [str(cluster.kubectl), "--kubeconfig", str(cluster.admin_kubeconfig), *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(argv)} failed: {proc.stderr}")
    return proc


def can_i(cluster: KubeCluster, namespace: str, verb: str, resource: str, in_ns: str) -> bool:
    """Whether the deployed service account may `verb` `resource` (``pods/exec`` names a
    subresource) in namespace `in_ns`."""
    # kubectl reads "pods/exec" as TYPE/NAME, so pass the subresource as a flag.
    resource, _, subresource = resource.partition("/")
    proc = kubectl(
        cluster, "auth", "can-i", verb, resource, f"--subresource={subresource}", "-n", in_ns,
        f"--as=system:serviceaccount:{namespace}:{SERVICE_ACCOUNT}", check=False,
    )  # fmt: skip
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"can-i {verb} {resource}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A kustomize overlay of deploy/ into a fresh namespace name, Deployment at 0 replicas."""
    namespace = f"sandman-deploy-test-{secrets.token_hex(3)}"
    base = os.path.relpath(DEPLOY, tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"namespace: {namespace}\n"
        f"resources: [{base}]\n"
        "replicas: [{name: sandman, count: 0}]\n"
    )
    yield namespace, tmp_path


@pytest.fixture
def applied(kube_cluster: KubeCluster, overlay: tuple[str, Path]) -> Iterator[dict[str, Any]]:
    """deploy/ applied into the overlay's namespace; deleted (and checked gone) afterwards."""
    namespace, path = overlay
    try:
        proc = kubectl(kube_cluster, "apply", "-k", str(path), "-o", "json")
        yield {"namespace": namespace, "objects": json.loads(proc.stdout)["items"]}
    finally:
        kubectl(kube_cluster, "delete", "-k", str(path), "--ignore-not-found", "--wait=false")
        deadline = time.monotonic() + GONE_TIMEOUT
        while kubectl(kube_cluster, "get", "namespace", namespace, check=False).returncode == 0:
            assert time.monotonic() < deadline, f"namespace {namespace} still there"
            time.sleep(0.5)


def test_deploy_renders(kube_cluster: KubeCluster) -> None:
    rendered = kubectl(kube_cluster, "kustomize", str(DEPLOY)).stdout
    kinds = [
        line.split(":", 1)[1].strip() for line in rendered.splitlines() if line.startswith("kind:")
    ]
    assert sorted(kinds) == sorted(
        ["Namespace", "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "NetworkPolicy",
         "Deployment", "Service"]
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
    }
    for obj in applied["objects"]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]

    # Exactly the pod verbs, in its own namespace only.
    for verb in POD_VERBS:
        assert can_i(kube_cluster, namespace, verb, "pods", namespace), verb
    denied = [
        ("update", "pods"), ("patch", "pods"), ("deletecollection", "pods"),
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
    assert rule["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"sandman.io/client": "true"}}}
    ]
    egress = policies["sandman-sandboxes-egress"]
    assert egress["policyTypes"] == ["Egress"]
    assert {"key": "sandman.io/egress", "operator": "In", "values": ["allow"]} in egress[
        "podSelector"
    ]["matchExpressions"]
    assert egress["egress"] == [{}]

    # The Deployment runs the service as that service account, and its pods
    # are clients of the sandboxes.
    deployment = json.loads(
        kubectl(kube_cluster, "-n", namespace, "get", "deployment", "sandman", "-o", "json").stdout
    )
    pod = deployment["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    assert pod["metadata"]["labels"]["sandman.io/client"] == "true"
    assert pod["spec"]["containers"][0]["args"][:3] == ["serve", "--provider", "kubernetes"]
    assert deployment["spec"]["replicas"] == 0
