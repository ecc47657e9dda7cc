"""The Kubernetes scale benchmarks run once at a small size, so they cannot rot
(``k8s_burst.py`` did once: its run label fell under the reserved ``sandman.io/``).
Their figures are not checked here; what is: every sandbox held, none failed, none
left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster

pytestmark = [pytest.mark.kube, pytest.mark.timeout(SETUP_TIMEOUT + 600)]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(cluster: KubeCluster, script: str, *args: str) -> str:
    """The benchmark's output (stdout); fails with its stderr if it exits non-zero."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    done = subprocess.run(
        [sys.executable, BENCHMARKS / script, *args,
         "--admin-kubeconfig", str(cluster.admin_kubeconfig)],
        cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def last_line(output: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", output.strip().splitlines()[-1]))


def test_k8s_scale_holds_them_all_through_the_pool_and_the_service(
    kube_cluster: KubeCluster,
) -> None:
    output = run_benchmark(
        kube_cluster, "k8s_scale.py",
        "--sandboxes", "60", "--via", "both", "--hold", "1", "--service-clients", "8",
    )  # fmt: skip
    result = last_line(output)
    assert result["held"] == "60/60", output
    assert result["failures"] == "0", output
    assert result["leftover"] == "0", output
    for seen in ("pool: reconcile pass", "pool: watch_lag", "service: GET /v1/dashboard",
                 "service: GET /metrics"):  # fmt: skip
        assert seen in output, output


def test_k8s_burst_runs_paced_without_failures(kube_cluster: KubeCluster) -> None:
    output = run_benchmark(
        kube_cluster, "k8s_burst.py",
        "--requests", "40", "--clients", "4", "--rate-pods", "20", "--skip-unpaced",
    )  # fmt: skip
    result = last_line(output)
    assert result["paced_failures"] == "0", output
    assert result["leftover"] == "0", output
