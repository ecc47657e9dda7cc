"""What a local sandbox has used, from the kernel's own accounting.

CPU: the sandbox's cpuacct cgroup (``cpuacct.usage``, ns; v1) or its cpu.stat
(``usage_usec``; v2). Memory: the memory cgroup's peak and current usage. Disk: the
quota group of its btrfs layer (none without one). Network: the counters of the host
side of its veth pair (what the host received is what the sandbox sent). Each read is
a few small files: a figure that cannot be read (its cgroup already gone) is None.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from sandman.models import Usage
from sandman.providers.local.disk import DiskPool
from sandman.providers.local.network import names

__all__ = ["read_usage"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NET = Path("/sys/class/net")


def read_usage(parent: str, sandbox_id: str, disk: DiskPool) -> Usage:
    """The usage of the sandbox under the cgroup parent ``parent`` (blocking: call it in
    a thread)."""
    group = f"{parent.strip('/')}/{sandbox_id}"
    unified = _CGROUP_ROOT / "unified" / group
    if not unified.is_dir():
        unified = _CGROUP_ROOT / group
    cpu = _number(_CGROUP_ROOT / "cpuacct" / group / "cpuacct.usage")
    cpu_seconds = cpu / 1e9 if cpu is not None else _v2_cpu(unified)
    peak = _number(_CGROUP_ROOT / "memory" / group / "memory.max_usage_in_bytes")
    now = _number(_CGROUP_ROOT / "memory" / group / "memory.usage_in_bytes")
    if peak is None:
        peak = _number(unified / "memory.peak")
        now = _number(unified / "memory.current")
    used = disk.usage(sandbox_id)
    host_if = names(sandbox_id)[1]
    return Usage(
        cpu_seconds=cpu_seconds,
        memory_peak_bytes=peak,
        memory_bytes=now,
        disk_bytes=used[0] if used is not None else None,
        # The host side's receive counter is what the sandbox sent, and the other way.
        net_rx_bytes=_number(_NET / host_if / "statistics" / "tx_bytes"),
        net_tx_bytes=_number(_NET / host_if / "statistics" / "rx_bytes"),
        at=time.time(),
    )


def _number(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().split()[0])
    return None


def _v2_cpu(group: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in (group / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    return None
