"""Every example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
