"""What the benchmarks share: quantiles and timing, progress for ``sandman bench``, and
each local-provider run's own cgroup parent.

A run gives the provider a fresh parent under ``/sandman-bench`` so that what it
leaves is told apart from any other run's; at the end the benchmark counts and
removes that parent in every cgroup hierarchy (v1 and hybrid hosts have several).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandman.providers.local import LocalProvider

CGROUP_ROOT = Path("/sys/fs/cgroup")


def new_cgroup_parent() -> str:
    """A cgroup parent for one run: ``/sandman-bench/<8 hex>``."""
    return f"/sandman-bench/{uuid.uuid4().hex[:8]}"


def cgroup_parent_dirs(parent: str) -> list[Path]:
    """The directories of the cgroup parent ``parent``, one a hierarchy that has it."""
    return [d for h in CGROUP_ROOT.iterdir() if (d := h / parent.strip("/")).is_dir()]


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` (nearest rank)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    """Seconds one ``await call()`` takes."""
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


def progress(done: int, total: int) -> None:
    """``progress DONE TOTAL`` on stderr, for ``sandman bench``'s bar (when it asks)."""
    if os.environ.get("SANDMAN_BENCH_PROGRESS") == "1":
        sys.stderr.write(f"progress {done} {total}\n")
        sys.stderr.flush()


def leftover(provider: LocalProvider) -> int:
    """What a local provider's run left: sandbox dirs, runtime containers, cgroups,
    and processes whose mounts name the state dir (the disk filesystem once closed)."""
    state = provider.config.state_dir
    count = len(list((state / "sandboxes").iterdir()))
    runtime = state / "runtime" / provider.config.runtime
    count += len(list(runtime.iterdir())) if runtime.exists() else 0
    for parent in cgroup_parent_dirs(provider.config.cgroup_parent):
        count += sum(1 for p in parent.iterdir() if p.is_dir())
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(state) in (proc / "mountinfo").read_text():
                count += 1
        except OSError:
            pass
    return count
