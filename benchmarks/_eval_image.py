"""The evaluation benchmarks' images: a build script of ``examples/eval`` run into a state dir.

The eval tests' ``built()`` (tests/eval/conftest.py) does the same as a pytest
fixture's body: it owns a temporary state dir and asserts. Here the caller
owns the state dir, and a failed build ends the benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "eval"
DEMO = EXAMPLES / "build.py"
"""The demo: one Debian image holding four small repositories."""
HONEST = EXAMPLES / "honest" / "build.py"
"""The honest corpus's two projects, built from their sdists."""


def build(script: Path, state_dir: Path) -> dict[str, str]:
    """Run ``script`` into ``state_dir``; the JSON line it prints (image, image_id, instances...)."""
    done = subprocess.run(
        [sys.executable, str(script), "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{script} failed:\n{done.stderr}")
    built: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    return built
