"""deploy/ on the harness, for the tests that apply it (`test_deploy`, `test_rolling_update`,
`test_network_policy`, `test_prepare`): kubectl as the admin, scratch namespaces,
kustomize overlays into them, and the Deployment
serving for real from the service image (`service_image` fixture in conftest).

The harness has no kube-proxy and its API server listens on 127.0.0.1 only, so the
serving overlay runs the service pod on the node's network (``hostNetwork``), on a free
port: the host reaches it at ``127.0.0.1:<port>``, the same address whichever replica
runs (a rolled Deployment's next pod binds the port its predecessor freed), and the
service reaches the API server there.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.kube.conftest import REPO, KubeCluster

DEPLOY = REPO / "deploy"
GONE_TIMEOUT = 120.0
SERVICE_READY_TIMEOUT = 180.0


def kubectl(
    cluster: KubeCluster, *argv: str, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run kubectl as the cluster admin."""
    proc = subprocess.run(
        [str(cluster.kubectl), "--kubeconfig", str(cluster.admin_kubeconfig), *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        input=stdin,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(argv)} failed: {proc.stderr}")
    return proc


def write_overlay(path: Path, namespace: str, extra: str = "") -> Path:
    """A kustomize overlay of deploy/ at `path` into `namespace`, plus `extra` YAML."""
    path.mkdir(parents=True, exist_ok=True)
    base = os.path.relpath(DEPLOY, path)  # kustomize refuses absolute paths
    (path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        f"namespace: {json.dumps(namespace)}\n"
        f"resources: [{base}]\n" + extra
    )
    return path


def serving_overlay(
    path: Path, namespace: str, cluster: KubeCluster, image: str, port: int, env: dict[str, str]
) -> Path:
    """The overlay that runs the Deployment for real on the harness: `image`, on the node's
    network at `port`, reaching the API server on 127.0.0.1; `env` added to the container."""
    name, tag = image.rsplit(":", 1)
    api_port = cluster.server.rsplit(":", 1)[1]
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": api_port, **env}
    adds = "".join(
        "    - {op: add, path: /spec/template/spec/containers/0/env/-, value: "
        f"{{name: {k}, value: {json.dumps(v)}}}}}\n"
        for k, v in env.items()
    )
    return write_overlay(
        path, namespace,
        f"images: [{{name: sandman, newName: {name}, newTag: {tag}}}]\n"
        "patches:\n"
        "- target: {kind: Deployment, name: sandman}\n"
        "  patch: |\n"
        "    - {op: add, path: /spec/template/spec/hostNetwork, value: true}\n"
        f"    - {{op: replace, path: /spec/template/spec/containers/0/ports/0/containerPort, value: {port}}}\n"
        f"    - {{op: replace, path: /spec/template/spec/containers/0/args/6, value: '{port}'}}\n"
        + adds,
    )  # fmt: skip


def create_namespace(cluster: KubeCluster, namespace: str, api_key: str) -> None:
    """The namespace and the Secret of API keys (tenant ``tests``) the Deployment needs."""
    kubectl(cluster, "create", "namespace", namespace)
    kubectl(cluster, "-n", namespace, "create", "secret", "generic", "sandman-api-keys",
            f"--from-literal=keys=tests:{api_key}")  # fmt: skip


def delete_namespace(cluster: KubeCluster, namespace: str) -> None:
    """Delete ``namespace`` with all it holds, and wait until it is gone."""
    kubectl(cluster, "delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
    deadline = time.monotonic() + GONE_TIMEOUT
    while kubectl(cluster, "get", "namespace", namespace, check=False).returncode == 0:
        assert time.monotonic() < deadline, f"namespace {namespace} still there"
        time.sleep(0.5)


@contextlib.contextmanager
def scratch_namespace(cluster: KubeCluster, prefix: str) -> Iterator[str]:
    """A namespace of the test's own, deleted (and checked gone) afterwards."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    kubectl(cluster, "create", "namespace", name)
    try:
        yield name
    finally:
        delete_namespace(cluster, name)


@contextlib.contextmanager
def deployed(cluster: KubeCluster, path: Path, namespace: str) -> Iterator[list[dict[str, Any]]]:
    """The overlay at `path` applied; its namespace deleted (and checked gone) afterwards."""
    try:
        proc = kubectl(cluster, "apply", "-k", str(path), "-o", "json")
        yield json.loads(proc.stdout)["items"]
    finally:
        delete_namespace(cluster, namespace)


def service_pods(cluster: KubeCluster, namespace: str) -> list[dict[str, Any]]:
    """The Deployment's pods (terminating ones too)."""
    listed = kubectl(cluster, "-n", namespace, "get", "pods", "-l",
                     "app.kubernetes.io/name=sandman", "-o", "json").stdout  # fmt: skip
    items: list[dict[str, Any]] = json.loads(listed)["items"]
    return items


def wait_serving(cluster: KubeCluster, namespace: str, *, not_pod: str | None = None) -> str:
    """Wait until exactly one service pod exists and is ready (other than `not_pod`, the one
    a roll replaces); its name."""
    deadline = time.monotonic() + SERVICE_READY_TIMEOUT
    while True:
        pods = service_pods(cluster, namespace)
        if len(pods) == 1 and pods[0]["metadata"]["name"] != not_pod:
            conditions = pods[0].get("status", {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return str(pods[0]["metadata"]["name"])
        assert time.monotonic() < deadline, kubectl(
            cluster, "-n", namespace, "logs", "deployment/sandman", check=False
        ).stdout
        time.sleep(0.2)


def sandbox_pods(cluster: KubeCluster, namespace: str, pool: str = "sandman") -> list[str]:
    """The names of the pool's sandbox pods (a consistent list: straight from etcd)."""
    listed = kubectl(cluster, "-n", namespace, "get", "pods", "-l", f"sandman.io/pool={pool}",
                     "-o", "jsonpath={.items[*].metadata.name}").stdout  # fmt: skip
    return listed.split()
