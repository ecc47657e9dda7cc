"""What the local-provider benchmarks share: each run's own cgroup parent, and finding it again.

The run gives the provider a fresh parent under ``/sandman-bench`` so that what it
leaves is told apart from any other run's; at the end the benchmark counts and
removes that parent in every cgroup hierarchy (v1 and hybrid hosts have several).
"""

from __future__ import annotations

import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def new_cgroup_parent() -> str:
    """A cgroup parent for one run: ``/sandman-bench/<8 hex>``."""
    return f"/sandman-bench/{uuid.uuid4().hex[:8]}"


def cgroup_parent_dirs(parent: str) -> list[Path]:
    """The directories of the cgroup parent ``parent``, one a hierarchy that has it."""
    return [d for h in CGROUP_ROOT.iterdir() if (d := h / parent.strip("/")).is_dir()]
