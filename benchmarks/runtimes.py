"""The local provider's runtimes side by side: crun (or runc) vs runsc (gVisor).

For each runtime, in one run and interleaved so that both see the same
machine: create->ready of a busybox sandbox (one at a time, ``-n`` of them,
each deleted after), then ``-e`` no-op execs (``true``) on one sandbox.

Last lines, one per runtime, then the ratios:

    runtime=<r> create_p50_ms=<x> noop_exec_median_ms=<y> leftover=<z>
    runsc_vs_crun create_ratio=<x/x'> noop_exec_ratio=<y/y'>

Run as root: ``.venv/bin/python benchmarks/runtimes.py [-n 20] [-e 500] [--runtimes crun,runsc]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal, cast

from _common import leftover, new_cgroup_parent, timed

from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

SPEC = SandboxSpec(image="busybox", memory="64Mi", pids=64, cpu=1)
Runtime = Literal["crun", "runc", "runsc"]


async def _create_ready(provider: LocalProvider) -> float:
    started = time.perf_counter()
    info = await provider.create(SPEC)
    try:
        assert info.endpoint is not None
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=120)
        return time.perf_counter() - started
    finally:
        await provider.delete(info.id)


async def _noop_execs(provider: LocalProvider, n: int) -> list[float]:
    info = await provider.create(SPEC)
    try:
        assert info.endpoint is not None
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=120)
            for _ in range(20):  # warm-up
                await client.exec(["true"])
            return [await timed(lambda: client.exec(["true"])) for _ in range(n)]
    finally:
        await provider.delete(info.id)


async def run(runtimes: list[Runtime], creates: int, execs: int, state: Path) -> str:
    tar = busybox_rootfs_tar(state / "busybox.tar")
    providers: dict[Runtime, LocalProvider] = {}
    for runtime in runtimes:
        config = LocalConfig(
            state_dir=state / runtime, runtime=runtime, cgroup_parent=new_cgroup_parent()
        )
        providers[runtime] = LocalProvider(config)
        await providers[runtime].images.import_archive(tar, name="busybox")
    create: dict[Runtime, list[float]] = {r: [] for r in runtimes}
    for _ in range(creates):
        for runtime, provider in providers.items():
            create[runtime].append(await _create_ready(provider))
    noop: dict[Runtime, list[float]] = {r: [] for r in runtimes}
    for _ in range(5):  # interleaved in rounds
        for runtime, provider in providers.items():
            noop[runtime] += await _noop_execs(provider, max(1, execs // 5))
    lines = []
    medians: dict[Runtime, tuple[float, float]] = {}
    for runtime, provider in providers.items():
        c, e = statistics.median(create[runtime]) * 1e3, statistics.median(noop[runtime]) * 1e3
        medians[runtime] = (c, e)
        await provider.network.reset()
        await provider.aclose()  # unmounts the disk filesystem
        lines.append(
            f"runtime={runtime} create_p50_ms={c:.1f} noop_exec_median_ms={e:.3f} "
            f"leftover={leftover(provider)}"
        )
        remove_cgroup_parent(provider.config.cgroup_parent)
    if len(runtimes) == 2:
        (base, bc), (other, oc) = medians.items()
        lines.append(
            f"{other}_vs_{base} create_ratio={oc[0] / bc[0]:.2f} noop_exec_ratio={oc[1] / bc[1]:.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20, help="creates per runtime")
    parser.add_argument("-e", type=int, default=500, help="no-op execs per runtime")
    parser.add_argument("--runtimes", default="crun,runsc")
    args = parser.parse_args()
    runtimes = [cast(Runtime, r) for r in args.runtimes.split(",")]
    with tempfile.TemporaryDirectory(prefix="sm-rt-", dir="/tmp") as tmp:
        print(asyncio.run(run(runtimes, args.n, args.e, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
