"""``sandman prepare`` on the harness's real node, pulling from a real registry on loopback.

Debian's ``docker-registry`` runs on 127.0.0.1 (the node's containerd runs in
the host's network namespace and, for a loopback registry, speaks plain HTTP
without any configuration). The test pushes an image made for this run (a
layer nobody else has, so the node really fetches blobs), lets ``prepare``
pull it onto ``sandman-node``, and checks containerd's store, the node's
``status.images`` and that steering then prefers that node. A missing image
is reported per node with the kubelet's reason, quickly. The registry, the
namespace, the pods and the image on the node are all removed afterwards.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sandman.cli import build
from sandman.providers.kubernetes.placement import image_affinity, nodes_with_image
from tests.images import builders
from tests.images.registry_server import REGISTRY_BINARY, Registry, push, start_registry
from tests.kube import node_images
from tests.kube.conftest import KubeCluster
from tests.kube.deployment import kubectl, scratch_namespace

pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]

NODE_STATUS_TIMEOUT = 90.0  # the kubelet reports images with its node status (~10 s)
FAILURE_WITHIN = 30.0  # a missing image is reported at the first ErrImagePull


@dataclass(frozen=True)
class Pushed:
    reference: str
    layer_digest: str


def node_image_names(cluster: KubeCluster) -> set[str]:
    return set(node_images.image_refs(cluster))


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    if not Path(REGISTRY_BINARY).is_file() or shutil.which("skopeo") is None:
        pytest.skip("needs docker-registry and skopeo (scripts/setup installs them)")
    running = start_registry(tmp_path / "registry")
    try:
        yield running
    finally:
        running.stop()
        assert running.process.poll() is not None
        assert not running.root.exists()


@pytest.fixture
def pushed(
    registry: Registry, tmp_path: Path, kube_cluster: KubeCluster, real_node: str
) -> Iterator[Pushed]:
    """An image only this run has, in the registry; removed from the node afterwards."""
    nonce = secrets.token_hex(8)
    layer = builders.layer_tar([builders.file("sandman-prepare-test", nonce.encode())])
    layout = builders.sample_oci([layer], ref_name="1").write_dir(tmp_path / "layout")
    reference = push(layout, "1", registry, f"sandman-test/prepare-{nonce}")
    repo = reference.rsplit(":", 1)[0]
    try:
        yield Pushed(reference, builders.sha256(builders.gz(layer)))
    finally:
        removed = node_images.remove(kube_cluster, repo)
        assert not set(removed) & set(node_images.image_refs(kube_cluster))
        layer_digest = builders.sha256(builders.gz(layer))
        assert layer_digest not in node_images.ctr(kube_cluster, "content", "ls", "-q").split()


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    with scratch_namespace(kube_cluster, "sandman-prepare-test") as name:
        yield name


def prepare(cluster: KubeCluster, namespace: str, node: str, *images: str) -> tuple[int, str]:
    """Run ``sandman prepare`` as the admin (it lists nodes); exit code and all output."""
    result = CliRunner().invoke(
        build(),
        ["prepare", *images, "--nodes", f"kubernetes.io/hostname={node}",
         "--kubeconfig", str(cluster.admin_kubeconfig), "--namespace", namespace,
         "--timeout", "120"],
    )  # fmt: skip
    return result.exit_code, result.output


def pods_left(cluster: KubeCluster, namespace: str) -> list[Any]:
    out = kubectl(
        cluster, "-n", namespace, "get", "pods", "-l", "sandman.io/prepare", "-o", "json"
    ).stdout
    items: list[Any] = json.loads(out)["items"]
    return items


def test_prepare_pulls_onto_the_real_node_and_steering_follows(
    kube_cluster: KubeCluster, real_node: str, pushed: Pushed, namespace: str
) -> None:
    assert pushed.reference not in node_image_names(kube_cluster)

    code, output = prepare(kube_cluster, namespace, real_node, pushed.reference)
    assert code == 0, output
    assert "1/1 pulled, 0 failed" in output
    assert pods_left(kube_cluster, namespace) == []

    # containerd holds the image, and fetched the layer only this run has.
    assert pushed.reference in node_image_names(kube_cluster)
    assert pushed.layer_digest in node_images.ctr(kube_cluster, "content", "ls", "-q").split()

    # The kubelet reports it in the node's status, which is what steering reads.
    deadline = time.monotonic() + NODE_STATUS_TIMEOUT
    while True:
        nodes = json.loads(kubectl(kube_cluster, "get", "nodes", "-o", "json").stdout)["items"]
        if nodes_with_image(pushed.reference, nodes) == [real_node]:
            break
        assert time.monotonic() < deadline, "the node never reported the image"
        time.sleep(1)

    # A pod that could go to any node (it tolerates the KWOK nodes' taint) is
    # scheduled onto the node that holds its image.
    term = image_affinity(pushed.reference, nodes)
    assert term is not None
    steered = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "steered"},
        "spec": {
            "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}},
            "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists"}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": pushed.reference, "command": ["/none"]}],
        },
    }  # fmt: skip
    kubectl(kube_cluster, "-n", namespace, "create", "-f", "-", stdin=json.dumps(steered))
    try:
        deadline = time.monotonic() + 60
        where = ("-n", namespace, "get", "pod", "steered", "-o", "jsonpath={.spec.nodeName}")
        while not (node := kubectl(kube_cluster, *where).stdout):
            assert time.monotonic() < deadline, "the steered pod was never scheduled"
            time.sleep(0.5)
        assert node == real_node
    finally:
        kubectl(kube_cluster, "-n", namespace, "delete", "pod", "steered", "--grace-period=0")


def test_prepare_reports_a_missing_image_per_node_quickly(
    kube_cluster: KubeCluster, real_node: str, registry: Registry, namespace: str
) -> None:
    missing = f"{registry.host}/sandman-test/absent-{secrets.token_hex(4)}:1"
    started = time.monotonic()
    code, output = prepare(kube_cluster, namespace, real_node, missing)
    elapsed = time.monotonic() - started
    assert code == 1, output
    assert f"FAILED  {missing}  on {real_node}: ErrImagePull" in output
    assert "not found" in output
    assert "0/1 pulled, 1 failed" in output
    assert elapsed < FAILURE_WITHIN, f"took {elapsed:.1f} s"
    assert pods_left(kube_cluster, namespace) == []
