"""Density and create latency of the local provider (crun) with a tiny busybox image.

1. Creates and deletes 20 sandboxes one at a time: their create->ready p50
   is ``create_p50_ms``.
2. Starts N sandboxes at concurrency C; prints the time until all are ready,
   create->ready p50/p95 under load, and host memory per sandbox (the
   kernel's MemAvailable before and after, divided by N).
3. Deletes them all at concurrency C; prints the time and what was left.

Last line: ``ready=<n>/<N> create_p50_ms=<x> mem_per_sandbox_mib=<y> leftover=<z>``
(leftover counts sandbox dirs, runtime containers, cgroups, mounts and processes).

``--disk off`` runs without the per-sandbox disk limit (``LocalConfig.disk=None``);
the default is the provider's (10 GiB, a btrfs subvolume with a quota per sandbox).
``--seccomp default,unconfined`` runs it all once per filter, one after the
other in the same run, for a before/after comparison (``--disk on,off`` too).

Run as root: ``.venv/bin/python benchmarks/density.py 1000 [-c 8] [--disk on,off] [--seccomp default,unconfined]``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import leftover as count_leftover
from _common import new_cgroup_parent, quantile

from sandman.errors import SandboxError
from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

SPEC = SandboxSpec(image="busybox", memory="64Mi", pids=64, cpu=0.5)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def _create_ready(provider: LocalProvider, spec: SandboxSpec) -> tuple[SandboxInfo, float]:
    started = time.perf_counter()
    info = await provider.create(spec)
    assert info.endpoint is not None
    client = info.endpoint.client()
    try:
        await client.wait_ready(timeout=120)
    finally:
        await client.aclose()
    return info, time.perf_counter() - started


async def run(
    n: int, concurrency: int, state: Path, disk: bool = True, seccomp: str = "default"
) -> str:
    spec = SPEC.model_copy(update={"seccomp": seccomp})
    cgroup_parent = new_cgroup_parent()
    config = LocalConfig(state_dir=state, cgroup_parent=cgroup_parent)
    if not disk:
        config = config.model_copy(update={"disk": None})
    provider = LocalProvider(config)
    tar = busybox_rootfs_tar(state / "busybox.tar")
    await provider.images.import_archive(tar, name="busybox")
    lines: list[str] = []

    serial: list[float] = []
    for _ in range(20):
        info, seconds = await _create_ready(provider, spec)
        serial.append(seconds)
        await provider.delete(info.id)
    create_p50 = statistics.median(serial) * 1e3
    lines.append(
        f"serial       create_ready_p50_ms={create_p50:.1f} p95_ms={quantile(serial, 0.95) * 1e3:.1f}"
    )

    gate = asyncio.Semaphore(concurrency)
    infos: list[SandboxInfo] = []
    latencies: list[float] = []
    failures: list[str] = []

    async def one() -> None:
        async with gate:
            try:
                info, seconds = await _create_ready(provider, spec)
            except SandboxError as exc:  # report, don't stop the burst
                failures.append(repr(exc))
                return
            infos.append(info)
            latencies.append(seconds)

    mem_before = _mem_available()
    started = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(n)))
    except BaseException:
        # Never leave a burst behind, whatever went wrong.
        await asyncio.gather(*(provider.delete(i.id) for i in await provider.list()))
        raise
    all_ready = time.perf_counter() - started
    await asyncio.sleep(2)  # let page cache and slab settle before reading memory
    mem_per = (mem_before - _mem_available()) / max(1, len(infos)) / 2**20
    if latencies:
        lines.append(
            f"burst        n={n} concurrency={concurrency} all_ready_s={all_ready:.2f} "
            f"rate_per_s={len(infos) / all_ready:.1f} create_ready_p50_ms={statistics.median(latencies) * 1e3:.1f} "
            f"p95_ms={quantile(latencies, 0.95) * 1e3:.1f} mem_per_sandbox_mib={mem_per:.2f}"
        )
    if failures:
        lines.append(f"failures     {len(failures)} first={failures[0]}")

    async def drop(info: SandboxInfo) -> None:
        async with gate:
            await provider.delete(info.id)

    started = time.perf_counter()
    await asyncio.gather(*(drop(info) for info in await provider.list()))
    deleted = time.perf_counter() - started
    await provider.aclose()  # unmounts the disk filesystem: none of its layers is left
    leftover = count_leftover(provider) + len(provider.disk.names()) + provider.disk.mounted()
    lines.append(f"delete       n={len(infos)} seconds={deleted:.2f} leftover={leftover}")
    remove_cgroup_parent(cgroup_parent)
    lines.append(
        f"seccomp={seccomp} ready={len(infos)}/{n} create_p50_ms={create_p50:.1f} "
        f"mem_per_sandbox_mib={mem_per:.2f} leftover={leftover}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=100, help="sandboxes in the burst")
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    parser.add_argument(
        "--disk", default="on", help="per-sandbox disk limit: on, off, or both (on,off)"
    )
    parser.add_argument(
        "--seccomp", default="default", help="filters to compare, comma-separated (spec.seccomp)"
    )
    args = parser.parse_args()
    for disk in args.disk.split(","):
        for seccomp in args.seccomp.split(","):
            state = Path(tempfile.mkdtemp(prefix="smb-", dir="/tmp"))
            try:
                print(f"# disk={disk} seccomp={seccomp}", flush=True)
                result = run(args.n, args.concurrency, state, disk == "on", seccomp)
                print(asyncio.run(result), flush=True)
            finally:
                shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
