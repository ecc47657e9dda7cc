"""The local provider's runtimes side by side: crun (or runc) vs runsc (gVisor).

Variants (``--runtimes``, comma-separated, the first is the base of the ratios):

- ``crun``, ``runc``: the OCI runtime on PATH; ``crun_nouserns``: crun without a user
  namespace per sandbox (``LocalConfig.userns=False``), to tell what it costs;
- ``runsc_ptrace``: the runsc on PATH (Debian 12's, 2022) with the provider's
  defaults: ptrace platform, host network stack (``runsc`` is another name for it);
- ``runsc_systrap``: ``hack/gvisor/.bin/runsc`` (gVisor's current ``go`` branch,
  built by ``hack/gvisor/build``) on systrap with gVisor's own network stack;
- to tell the platform's share from the network stack's, the built runsc also as
  ``runsc_systrap_hostinet`` (systrap, host network stack) and ``runsc_new_ptrace``
  (ptrace, gVisor's network stack).

For each, in one run and interleaved so that all see the same machine:
create->ready of a busybox sandbox (one at a time, ``-n`` of them, each deleted
after), then ``-e`` no-op execs (``true``) on one sandbox, in five rounds; then
``-m`` idle sandboxes held at once per variant, whose memory is measured after
they settle: what each one's memory cgroup is charged (``mem_mib``: user and
kernel memory, what its limit counts; gVisor's own kernel and gofer included)
and the proportional set size of the processes in it (``pss_mib``).

One line per variant, then the ratios to the base, then all figures on one line:

    runtime=<v> create_p50_ms=<x> noop_exec_p50_ms=<y> mem_mib=<m> pss_mib=<p> leftover=<z>
    <v>_vs_<base> create_ratio=<x/x'> noop_exec_ratio=<y/y'> mem_ratio=<m/m'>
    crun_create_ms=<x> crun_exec_ms=<y> crun_mem_mib=<m> runsc_systrap_create_ms=<x> ...

``leftover`` counts what the variant left behind (mounts, processes, files in the
state directory): 0 expected. Each runsc runs with the provider's default flags
(the built one gets ``--gofer-network-namespace=new``, which Debian's refuses).

Run as root: ``.venv/bin/python benchmarks/runtimes.py [-n 20] [-e 500] [-m 5]
[--runtimes crun,runsc_ptrace,runsc_systrap] [--built-runsc PATH] [--compare-runsc PATH]``
(``hack/gvisor/build`` first).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import leftover, new_cgroup_parent, timed

from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

SPEC = SandboxSpec(image="busybox", memory="64Mi", pids=64, cpu=1)
BUILT_RUNSC = Path(__file__).resolve().parents[1] / "hack" / "gvisor" / ".bin" / "runsc"
RUNSC_PTRACE: dict[str, Any] = {"runtime": "runsc"}
BUILT: dict[str, Any] = {"runtime": "runsc", "runtime_path": str(BUILT_RUNSC)}
VARIANTS: dict[str, dict[str, Any]] = {
    "crun": {"runtime": "crun"},
    "crun_nouserns": {"runtime": "crun", "userns": False},
    "runc": {"runtime": "runc"},
    "runsc": RUNSC_PTRACE,
    "runsc_ptrace": RUNSC_PTRACE,
    "runsc_systrap": {**BUILT, "runsc_platform": "systrap", "runsc_network": "sandbox"},
    "runsc_systrap_hostinet": {**BUILT, "runsc_platform": "systrap", "runsc_network": "host"},
    "runsc_new_ptrace": {**BUILT, "runsc_platform": "ptrace", "runsc_network": "sandbox"},
}
SETTLE = 2.0  # seconds idle sandboxes are left before their memory is read


async def _ready(info: SandboxInfo) -> None:
    assert info.endpoint is not None
    async with info.endpoint.client() as client:
        await client.wait_ready(timeout=120)


async def _create_ready(provider: LocalProvider) -> float:
    started = time.perf_counter()
    info = await provider.create(SPEC)
    try:
        await _ready(info)
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


def _memory_dir(provider: LocalProvider, sandbox_id: str) -> Path:
    parent = provider.config.cgroup_parent.strip("/")
    v1 = Path("/sys/fs/cgroup/memory") / parent / sandbox_id
    return v1 if v1.is_dir() else Path("/sys/fs/cgroup") / parent / sandbox_id


def _charged(cgroup: Path) -> int:
    """What the memory cgroup is charged, in bytes (v1 or v2)."""
    for name in ("memory.usage_in_bytes", "memory.current"):
        if (cgroup / name).exists():
            return int((cgroup / name).read_text())
    return 0


def _pss(cgroup: Path) -> int:
    """The proportional set size of the cgroup's processes together, in bytes."""
    total = 0
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass  # gone meanwhile
    return total


async def _idle_memory(
    providers: dict[str, LocalProvider], held: int
) -> dict[str, tuple[float, float]]:
    """(cgroup charge, PSS) medians in MiB of ``held`` idle sandboxes per variant."""
    infos: dict[str, list[SandboxInfo]] = {name: [] for name in providers}
    try:
        for _ in range(held):
            for name, provider in providers.items():
                info = await provider.create(SPEC)
                infos[name].append(info)
                await _ready(info)
        await asyncio.sleep(SETTLE)
        result = {}
        for name, provider in providers.items():
            cgroups = [_memory_dir(provider, info.id) for info in infos[name]]
            result[name] = (
                statistics.median(_charged(c) for c in cgroups) / 2**20,
                statistics.median(_pss(c) for c in cgroups) / 2**20,
            )
        return result
    finally:
        for name, provider in providers.items():
            for info in infos[name]:
                await provider.delete(info.id)


async def run(variants: list[str], creates: int, execs: int, held: int, state: Path) -> str:
    tar = busybox_rootfs_tar(state / "busybox.tar")
    providers: dict[str, LocalProvider] = {}
    for name in variants:
        # ".d": no state dir may be a prefix of another's (``leftover`` matches mounts by it).
        config = LocalConfig(
            state_dir=state / f"{name}.d", cgroup_parent=new_cgroup_parent(), **VARIANTS[name]
        )
        providers[name] = LocalProvider(config)
        await providers[name].images.import_archive(tar, name="busybox")
    create: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(creates):
        for name, provider in providers.items():
            create[name].append(await _create_ready(provider))
    noop: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):  # interleaved in rounds
        for name, provider in providers.items():
            noop[name] += await _noop_execs(provider, max(1, execs // 5))
    memory = await _idle_memory(providers, held) if held else {}
    lines, figures, last = [], {}, []
    for name, provider in providers.items():
        c, e = statistics.median(create[name]) * 1e3, statistics.median(noop[name]) * 1e3
        m, p = memory.get(name, (0.0, 0.0))
        figures[name] = (c, e, m)
        await provider.network.reset()
        await provider.aclose()  # unmounts the disk filesystem
        lines.append(
            f"runtime={name} create_p50_ms={c:.1f} noop_exec_p50_ms={e:.3f} "
            f"mem_mib={m:.1f} pss_mib={p:.1f} leftover={leftover(provider)}"
        )
        remove_cgroup_parent(provider.config.cgroup_parent)
        last.append(f"{name}_create_ms={c:.1f} {name}_exec_ms={e:.3f} {name}_mem_mib={m:.1f}")
    base, (bc, be, bm) = next(iter(figures.items()))
    for name, (c, e, m) in list(figures.items())[1:]:
        mem_ratio = f"{m / bm:.2f}" if bm else "n/a"
        lines.append(
            f"{name}_vs_{base} create_ratio={c / bc:.2f} noop_exec_ratio={e / be:.2f} "
            f"mem_ratio={mem_ratio}"
        )
    lines.append(" ".join(last))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20, help="creates per variant")
    parser.add_argument("-e", type=int, default=500, help="no-op execs per variant")
    parser.add_argument("-m", type=int, default=5, help="idle sandboxes held per variant")
    parser.add_argument("--runtimes", default="crun,runsc_ptrace,runsc_systrap")
    parser.add_argument(
        "--built-runsc",
        type=Path,
        default=BUILT_RUNSC,
        help="the runsc the built variants run (to compare another build)",
    )
    parser.add_argument(
        "--compare-runsc",
        type=Path,
        help="another runsc: each built variant also runs with it, as <variant>_cmp, "
        "interleaved with the rest (before and after a change to the build)",
    )
    args = parser.parse_args()
    # A forked child's fd table is sized by its parent's highest open fd, and exec keeps
    # it: a high fd inherited from the caller (a CI runner's or a tool's pipe) gives every
    # runsc a table that hides what the sentry's own growth of it costs
    # (hack/gvisor/prewarmer). A service has no such fd: neither does this run.
    os.closerange(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    variants = args.runtimes.split(",")
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown runtimes {unknown}: choose from {sorted(VARIANTS)}")
    built = args.built_runsc.resolve()
    if any(VARIANTS[name].get("runtime_path") for name in variants) and not built.exists():
        parser.error(f"{built} is missing: run hack/gvisor/build first")
    for settings in VARIANTS.values():
        if settings.get("runtime_path"):
            settings["runtime_path"] = str(built)
    if args.compare_runsc is not None:
        other = args.compare_runsc.resolve()
        if not other.exists():
            parser.error(f"{other} is missing")
        paired = []
        for name in variants:
            paired.append(name)
            if VARIANTS[name].get("runtime_path"):
                VARIANTS[f"{name}_cmp"] = {**VARIANTS[name], "runtime_path": str(other)}
                paired.append(f"{name}_cmp")
        variants = paired
    with tempfile.TemporaryDirectory(prefix="sm-rt-", dir="/tmp") as tmp:
        print(asyncio.run(run(variants, args.n, args.e, args.m, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
