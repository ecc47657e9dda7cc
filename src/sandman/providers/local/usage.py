"""What a local sandbox has used, from the kernel's own accounting.

CPU: the sandbox's cpuacct cgroup (``cpuacct.usage``, ns; v1) or its cpu.stat
(``usage_usec``; v2). Memory: the memory cgroup's peak and current usage. Disk: the
quota group of its btrfs layer (none without one). Network: the counters of the host
side of its veth pair (what the host received is what the sandbox sent). Each read is
a few small files: a figure that cannot be read (its cgroup already gone) is None.

Average memory has no counter in the kernel: `MemoryMeter` samples each sandbox's
memory use (one small file each) every few seconds and keeps the time-weighted mean.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandman.models import Usage
from sandman.providers.local.disk import DiskPool
from sandman.providers.local.network import names

__all__ = ["MemoryMeter", "read_usage"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NET = Path("/sys/class/net")


def read_usage(
    parent: str, sandbox_id: str, disk: DiskPool, meter: MemoryMeter | None = None
) -> Usage:
    """The usage of the sandbox under the cgroup parent ``parent`` (blocking: call it in
    a thread); its average memory from ``meter``, which this read samples too."""
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
    average = meter.observe(sandbox_id, now) if meter is not None and now is not None else None
    used = disk.usage(sandbox_id)
    host_if = names(sandbox_id)[1]
    return Usage(
        cpu_seconds=cpu_seconds,
        memory_peak_bytes=peak,
        memory_bytes=now,
        memory_average_bytes=average,
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


@dataclass
class _Mean:
    first: float
    last: float
    value: int
    area: float = 0.0  # byte-seconds since ``first``

    def average(self) -> int:
        span = self.last - self.first
        return self.value if span <= 0 else round(self.area / span)


class MemoryMeter:
    """Each sandbox's average memory while it lived: the time-weighted mean of samples
    of its memory cgroup's usage (each held until the next), taken at most every
    ``interval`` seconds by `sample` (the provider's listings) and at every
    `read_usage`. Costs one small read per sandbox per interval, and a few numbers per
    sandbox."""

    def __init__(self, parent: str, *, interval: float = 5.0) -> None:
        self._parent = parent.strip("/")
        self.interval = interval
        self._means: dict[str, _Mean] = {}
        self._sampled = -interval

    def observe(self, sandbox_id: str, value: int, at: float | None = None) -> int:
        """Take ``value`` bytes as the sandbox's use from now (``at``) on; its average."""
        at = time.monotonic() if at is None else at
        mean = self._means.get(sandbox_id)
        if mean is None:
            mean = self._means[sandbox_id] = _Mean(at, at, value)
        elif at > mean.last:
            mean.area += mean.value * (at - mean.last)
            mean.last, mean.value = at, value
        return mean.average()

    def forget(self, sandbox_id: str) -> None:
        """Drop a deleted sandbox's mean."""
        self._means.pop(sandbox_id, None)

    def due(self) -> bool:
        """Whether ``interval`` has passed since the last `sample`."""
        return time.monotonic() - self._sampled >= self.interval

    def sample(self, sandbox_ids: Iterable[str]) -> None:
        """Read each sandbox's memory use now (blocking: call it in a thread); forget the
        sandboxes not named."""
        self._sampled = time.monotonic()
        ids = set(sandbox_ids)
        for gone in self._means.keys() - ids:
            self.forget(gone)
        for sandbox_id in ids:
            group = _CGROUP_ROOT / "memory" / self._parent / sandbox_id
            value = _number(group / "memory.usage_in_bytes")
            if value is None:
                value = _number(_CGROUP_ROOT / self._parent / sandbox_id / "memory.current")
            if value is not None:
                self.observe(sandbox_id, value)
