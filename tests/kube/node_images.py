"""The real node's image store (containerd, in kubelet's ``k8s.io`` namespace), for tests."""

from __future__ import annotations

import subprocess

from tests.kube.conftest import KubeCluster


def ctr(cluster: KubeCluster, *argv: str) -> str:
    """``ctr`` on the real node's containerd, in kubelet's namespace; its stdout."""
    sock = cluster.state_dir / "containerd" / "containerd.sock"
    return subprocess.run(
        [str(cluster.ctr), "--address", str(sock), "--namespace", "k8s.io", *argv],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip


def image_refs(cluster: KubeCluster) -> dict[str, str]:
    """Every image name on the node and the manifest digest it points to."""
    lines = ctr(cluster, "images", "ls").splitlines()[1:]  # REF TYPE DIGEST SIZE ...
    return {fields[0]: fields[2] for fields in (line.split() for line in lines) if len(fields) > 2}


def remove(cluster: KubeCluster, *prefixes: str) -> list[str]:
    """Remove every name starting with one of `prefixes` and every other name of the same
    images (CRI adds ``sha256:<image id>``), waiting for containerd's GC; what was removed."""
    refs = image_refs(cluster)
    targets = {d for r, d in refs.items() if r.startswith(prefixes)}
    doomed = [r for r, d in refs.items() if d in targets]
    if doomed:
        ctr(cluster, "images", "rm", "--sync", *doomed)
    return doomed
