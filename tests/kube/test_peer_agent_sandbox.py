"""``benchmarks/peers/agent_sandbox.py --quick`` at a small size, so that the comparison
with kubernetes-sigs/agent-sandbox cannot rot: Sandman's burst always, agent-sandbox's
only where its controller is already built on this machine (a fresh machine never
builds it: 10+ minutes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kube.conftest import REPO, SETUP_TIMEOUT, KubeCluster

pytestmark = [pytest.mark.kube, pytest.mark.timeout(SETUP_TIMEOUT + 600)]

SCRIPT = REPO / "benchmarks" / "peers" / "agent_sandbox.py"
LAST = re.compile(
    r"^sandman_t100=(?P<ours>[\d.]+) agent_sandbox_t100=(?P<theirs>[\d.]+|skipped) "
    r"ratio=(?P<ratio>[\d.]+|skipped)$"
)


MACHINE_CACHE = Path("/var/cache/sandman/peers")


@pytest.mark.parametrize("built", [False, True], ids=["not-built", "built"])
def test_quick_mode_runs_the_arms_it_can_and_leaves_nothing(
    kube_cluster: KubeCluster, tmp_path: Path, built: bool
) -> None:
    # Not built: an empty cache (as on a fresh machine), Sandman's arm only.
    cache = MACHINE_CACHE if built else tmp_path
    if built and not (cache / "agent-sandbox-v0.5.6" / "agent-sandbox-controller").is_file():
        pytest.skip(f"agent-sandbox is not built in {cache} (the benchmark without --quick does)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--requests", "20", "--clients", "4",
         "--cache", str(cache), "--kubeconfig", str(kube_cluster.kubeconfig),
         "--admin-kubeconfig", str(kube_cluster.admin_kubeconfig)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    output = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    lines = proc.stdout.strip().splitlines()
    last = LAST.match(lines[-1])
    assert last is not None, output
    phases = [line for line in lines if re.match(r"^(sandman|agent-sandbox): ", line)]
    assert len(phases) == (2 if built else 1), output
    for line in phases:
        assert "ready=20/20 failures=0" in line, output
        assert "leftover=0" in line, output
    assert (last["theirs"] == "skipped") == (not built), output
    # Nothing of the run is left on the cluster: its namespace, CRDs, ClusterRoles.
    kubectl = [str(kube_cluster.kubectl), "--kubeconfig", str(kube_cluster.admin_kubeconfig)]
    namespaces = subprocess.run(
        [*kubectl, "get", "namespaces", "-l", "bench.sandman.io/run=peer", "-o", "name"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert namespaces.strip() == "", namespaces
    crds = subprocess.run(
        [*kubectl, "get", "crd", "-o", "name"], capture_output=True, text=True, check=True
    ).stdout
    assert "agents.x-k8s.io" not in crds, crds
    roles = subprocess.run(
        [*kubectl, "get", "clusterroles", "-o", "name"], capture_output=True, text=True, check=True
    ).stdout
    assert "agent-sandbox-controller" not in roles, roles
