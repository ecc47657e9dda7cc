"""`benchmarks/density.py` run once at a small size, so that it cannot rot: the curve's
checkpoints all measured, nothing left. Its figures are not checked (no timed tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sandman
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = needs_root_and_crun

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "density.py"


def test_the_density_curve_runs_to_its_top_and_leaves_nothing() -> None:
    source = Path(sandman.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--curve", "0,100,200", "--probe", "5"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines if line.startswith("held=")] == [
        "held=0",
        "held=100",
        "held=200",
    ]
    last = dict(field.split("=", 1) for field in lines[-1].split())
    assert last["ready"] == "200/200" and last["leftover"] == "0", lines[-1]
    assert float(last["ratio"]) > 0 and float(last["mem_per_sandbox_mib"]) > 0
