"""`benchmarks/snapshot.py` at its small size: it runs through, and leaves no sandbox,
snapshot, cgroup or mount. Its figures are not checked (no timed tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sandman
from tests.providers.local.conftest import needs_root_and_crun
from tests.test_benchmark_burst import held_under, state_dir

pytestmark = [needs_root_and_crun, pytest.mark.timeout(600)]

__all__ = ["state_dir"]  # the fixture, shared

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "snapshot.py"


def test_the_snapshot_benchmark_runs_and_leaves_nothing(state_dir: Path) -> None:
    source = Path(sandman.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
    }
    (state_dir / "run").mkdir()
    command = [sys.executable, str(SCRIPT), "--small", "--state-dir", str(state_dir / "run")]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=540, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    last = dict(field.split("=", 1) for field in done.stdout.strip().splitlines()[-1].split())
    assert set(last) >= {"fork_ratio", "snapshot_size_ratio", "disk_16_forks_gib",
                         "restore_first_exec_p50_ms", "grpo_speedup", "leftover"}  # fmt: skip
    assert last["leftover"] == "0", done.stdout[-2000:]
    assert held_under(state_dir) == []
    assert not list((state_dir / "run" / "snapshots").iterdir())
