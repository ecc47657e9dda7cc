"""The chaos suite's Kubernetes faults that owners on the backend are for (see
`tests.chaos.kube`): a pool's process SIGKILLed (its pods reaped through its Lease by
the other pool's reconcile), the API server cut off for longer than a Lease and its
grace (no live pool taken for dead). Each must come out clean: nothing leaked, lost or
untyped, no client stuck. ``benchmarks/chaos.py --provider kubernetes`` draws these
and pods deleted or evicted behind the pools' backs at random."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.kube import OWNER_GRACE, OWNER_LEASE, plan_for, run_iteration
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster

pytestmark = [
    pytest.mark.kube, pytest.mark.chaos, pytest.mark.anyio,
    pytest.mark.timeout(SETUP_TIMEOUT + 180),
]  # fmt: skip

SEED = 14


@pytest.fixture(scope="module")
def chaos_work() -> Iterator[Path]:
    """Where failing iterations keep their logs (named in the failure message)."""
    yield Path(tempfile.mkdtemp(prefix="sandman-kube-chaos-tests-"))


@pytest.mark.parametrize(
    ("fault", "params"),
    [
        pytest.param(
            "kill-client", {"when": "hold", "reaper": "pool"}, id="kill-client-reaped-by-pool"
        ),
        pytest.param("cut-api", {"duration": 7.0}, id="cut-api-7s"),
    ],
)
async def test_kubernetes_fault(
    fault: str, params: dict[str, Any], kube_cluster: KubeCluster, chaos_work: Path
) -> None:
    plan = plan_for(SEED, 0, fault=fault, at=0.5, **params)
    outcome = await run_iteration(plan, kube_cluster, chaos_work)
    assert not outcome.failed, outcome.details()
    if fault == "kill-client":
        assert any("reaped by pool" in note for note in outcome.notes), outcome.notes
    if fault == "cut-api":
        # Longer than a Lease lasts and its grace, between owners that are Leases: a judge
        # that counted the outage against the holders would have reaped their pods.
        assert params["duration"] > OWNER_LEASE + OWNER_GRACE
        assert not any("has no Lease owner" in note for note in outcome.notes), outcome.notes
