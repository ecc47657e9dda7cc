"""What a deleted sandbox must not leave: containers, cgroups, mounts, processes, files.

Each test's provider uses its own cgroup parent, so anything found under it
belongs to that test.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_parents(provider: LocalProvider) -> list[Path]:
    parent = provider.config.cgroup_parent.strip("/")
    return [h / parent for h in CGROUP_ROOT.iterdir() if (h / parent).is_dir()]


def leftovers(provider: LocalProvider) -> list[str]:
    """Everything of the provider's sandboxes that still exists."""
    state = provider.config.state_dir.resolve()
    sandboxes = state / "sandboxes"
    found: list[str] = []
    if sandboxes.exists():
        found += [f"dir {p}" for p in sandboxes.iterdir()]
    runtime_state = state / "runtime" / provider.config.runtime
    if runtime_state.exists():
        found += [f"runtime state {p}" for p in runtime_state.iterdir()]
    for parent in _cgroup_parents(provider):
        found += [f"cgroup {p}" for p in parent.iterdir() if p.is_dir()]
    cgroup_parent = provider.config.cgroup_parent.rstrip("/") + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            mountinfo = (proc / "mountinfo").read_text()
            cgroups = (proc / "cgroup").read_text()
        except OSError:
            continue
        if str(sandboxes) in mountinfo:
            found.append(f"a mount of pid {proc.name} refers to {sandboxes}")
        if f":{cgroup_parent}" in cgroups:
            found.append(f"process {proc.name} in {cgroup_parent}")
    return found


async def assert_nothing_left(provider: LocalProvider) -> None:
    """Wait (with a deadline) until nothing is left, then remove the empty cgroup parents."""
    deadline = time.monotonic() + 10
    while (left := leftovers(provider)) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not left, left
    # Its own parent must go; the shared /sandman-test stays only while another run uses it.
    own = set(_cgroup_parents(provider))
    busy = remove_cgroup_parent(provider.config.cgroup_parent)
    assert not own & set(busy), busy
