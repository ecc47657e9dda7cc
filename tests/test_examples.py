"""Every example runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.providers.local.conftest import needs_root_and_crun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_daemon_demo() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "daemon_demo.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "shell session remembers cd and export" in done.stdout
    assert "ran it: 45" in done.stdout
    assert "sandmand stopped (exit 0)" in done.stdout


@needs_root_and_crun
def test_local_demo() -> None:
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "local_demo.py"), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "the answer is 42" in done.stdout
        assert "sees the file: False" in done.stdout
        assert "exit 137 (OOM-killed)" in done.stdout
        assert "sandboxes left: 0" in done.stdout
        assert list((state / "sandboxes").iterdir()) == []
        # Nor the state dir's disk filesystem (mounted on the host while in use).
        assert f" {state}/" not in Path("/proc/self/mountinfo").read_text()
    finally:
        shutil.rmtree(state, ignore_errors=True)


@needs_root_and_crun
def test_grpo_fork() -> None:
    state = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "grpo_fork.py"), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "rewards of the group: [1.0, 0.0, 1.0, 0.0]" in done.stdout
        assert "as it was: def add(a, b): return a - b" in done.stdout
        assert "snapshots left: 0, sandboxes left: 0" in done.stdout
        assert f" {state}/" not in Path("/proc/self/mountinfo").read_text()
    finally:
        shutil.rmtree(state, ignore_errors=True)
