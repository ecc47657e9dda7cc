"""Every example runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.providers.local.conftest import needs_root_and_crun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_daemon_demo() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "daemon_demo.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "a shell remembers cd and export" in done.stdout
    assert "ran it: 45" in done.stdout
    assert "sandmand stopped (exit 0)" in done.stdout


LOCAL_EXAMPLES = {
    "local_demo.py": [
        "the answer is 42", "sees the file: False", "exit 137 (OOM-killed)", "sandboxes left: 0",
    ],
    "grpo_fork.py": [
        "rewards of the group: [1.0, 0.0, 1.0, 0.0]",
        "as it was: def add(a, b): return a - b",
        "snapshots left: 0, sandboxes left: 0",
    ],
}  # fmt: skip


@needs_root_and_crun
@pytest.mark.parametrize("example", sorted(LOCAL_EXAMPLES))
def test_a_local_example_runs_and_leaves_nothing(example: str) -> None:
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / example), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        for said in LOCAL_EXAMPLES[example]:
            assert said in done.stdout, done.stdout
        assert list((state / "sandboxes").iterdir()) == []
        # Nor the state dir's disk filesystem (mounted on the host while in use).
        assert f" {state}/" not in Path("/proc/self/mountinfo").read_text()
    finally:
        shutil.rmtree(state, ignore_errors=True)
