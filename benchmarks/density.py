"""Density curve of the local provider (crun) with a tiny busybox image, idle sandboxes.

Through a `Pool` (as a user would): grows the set of held sandboxes to each
checkpoint of ``--curve`` (e.g. ``0,1000,2000,5000,10000``; a bare ``N`` means
``0,N``), at concurrency C, and at each checkpoint measures with a probe of
``--probe`` sandboxes made one at a time while the others are held:

- ``create_p50_ms``/``p95_ms``: acquire -> daemon ready;
- ``delete_p50_ms``: release -> gone (the pool's delete: container, cgroups, files);
- ``cpu_ms_per_create``: CPU of this process (pool, provider) and of its children
  (crun, the overlay helper) per probe create + delete, from ``os.times()``;
- ``mem_per_held_mib``: the kernel's MemAvailable at checkpoint 0 minus now, per
  held sandbox, with its parts (anon, slab, percpu, page tables, kernel stacks; on a
  shared machine these move with others' work too), what the sandboxes' memory cgroups
  are charged per sandbox (theirs alone) and the daemons' proportional set size (PSS)
  sampled from a few;
- what else grows with the count: host mount table lines, this process's open
  descriptors, threads on the host, one `Pool.reconcile` (``reconcile_ms``: it lists
  every sandbox; ``cold``: the first pass after the growth, which reads each new
  sandbox's files; ``crun_list``: the runtime's own list, part of each) and one
  `Pool.stats`.

One line per checkpoint (``held=<n> ...``), then the delete of everything held
(``delete n=<n> seconds=<s> leftover=<z>``: sandbox dirs, runtime containers,
cgroups, mounts and processes left). A create that fails is tried again (each
failure printed, their count on each line); ten in a row are the wall: printed, the
curve ends there and everything is still deleted. So is the host's MemAvailable falling
below ``--min-available-gib`` (2): the memory wall, met before the OOM killer is.

Exits 1 if the curve stopped at a wall or something was left. Last line: ``ready=<held>/<target> create_p50_ms=<x at 0> create_p50_top_ms=<y at the
top checkpoint> ratio=<y/x> mem_per_sandbox_mib=<at the top> leftover=<z>``.

``--disk off`` runs without the per-sandbox disk limit (``LocalConfig.disk=None``);
the default is the provider's (10 GiB, a btrfs subvolume with a quota per sandbox).
``--views own`` gives each sandbox its own tmpfs /dev and /dev/shm and its own sysfs
(``LocalConfig.dev_tmpfs``, ``own_sysfs``), the default ``shared`` none.
``--seccomp default,unconfined`` runs it all once per filter, one after the
other in the same run, for a before/after comparison (``--disk on,off`` and
``--views shared,own`` too).

The kernel's memory that grows with the square of the count: each memory cgroup (one
a sandbox) holds a shrinker slot per superblock on the host, 1 KiB (kmalloc-1k) per 64.
Each line gives ``superblocks`` (those one held sandbox has that another and the host
have not) and ``shrinker_model_kib`` (held x superblocks / 64: what that adds to
kmalloc-1k per held sandbox) beside the measured ``top_slabs_kib``.

Run as root: ``.venv/bin/python benchmarks/density.py --curve 0,1000,2000,5000,10000 [-c 8]``
(``ulimit -n`` must exceed the top checkpoint: the pool holds a descriptor per sandbox;
``sandman doctor --sandboxes N`` tells what else the host must allow for N).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _common import leftover as count_leftover
from _common import new_cgroup_parent, progress, quantile

from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig, PoolEvent, Record
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

SPEC = SandboxSpec(image="busybox", memory="64Mi", pids=64, cpu=0.5)
_WALL = 10  # creates failed in a row: the host holds no more
_MEMINFO = ("MemAvailable", "AnonPages", "Slab", "Percpu", "PageTables", "KernelStack")


def _meminfo() -> dict[str, int]:
    """The fields of /proc/meminfo this benchmark follows, in bytes."""
    values: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in _MEMINFO:
            values[name] = int(rest.split()[0]) * 1024
    return values


def _slabs() -> dict[str, int]:
    """Bytes in each slab cache (``num_objs * objsize``); empty where slabinfo is unreadable."""
    sizes: dict[str, int] = {}
    try:
        lines = Path("/proc/slabinfo").read_text().splitlines()[2:]
    except OSError:
        return sizes
    for line in lines:
        fields = line.split()
        sizes[fields[0]] = int(fields[2]) * int(fields[3])
    return sizes


def _pss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _charged(cgroup_parent: str) -> int:
    """What the sandboxes' memory cgroups are charged (user and kernel memory), in bytes."""
    for name in ("memory.usage_in_bytes", "memory.current"):  # v1, v2
        for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
            path = root / cgroup_parent.strip("/") / name
            if path.exists():
                return int(path.read_text())
    return 0


def _superblocks(pid: int) -> set[str]:
    """The device numbers of the filesystems under a process's mounts: one a superblock."""
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return set()
    return {line.split()[2] for line in text.splitlines()}


def _own_superblocks(held: list[Record]) -> int:
    """Superblocks the first held sandbox has that the second and the host have not."""
    pids = [r.info.endpoint.pid for r in held[:2] if r.info and r.info.endpoint]
    if len(pids) < 2 or None in pids:
        return 0
    one, other = (_superblocks(p) for p in pids if p is not None)
    return len(one - other - _superblocks(os.getpid()))


def _threads() -> int:
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _Deletes:
    """Tells when a released sandbox is gone, from the pool's events."""

    def __init__(self) -> None:
        self.gone: dict[str, asyncio.Event] = {}

    def hook(self, event: PoolEvent) -> None:
        if event.name == "delete.complete" and event.sandbox_id is not None:
            done = self.gone.get(event.sandbox_id)
            if done is not None:
                done.set()


async def _probe(
    pool: Pool, spec: SandboxSpec, session: str, deletes: _Deletes, count: int
) -> dict[str, float]:
    creates: list[float] = []
    removes: list[float] = []
    cpu = _cpu()
    for _ in range(count):
        started = time.perf_counter()
        record = await pool.acquire(spec, session=session, timeout=120)
        creates.append(time.perf_counter() - started)
        gone = deletes.gone[record.id] = asyncio.Event()
        started = time.perf_counter()
        pool.release(record.id)
        await asyncio.wait_for(gone.wait(), 120)
        removes.append(time.perf_counter() - started)
        del deletes.gone[record.id]
    return {
        "create_p50_ms": statistics.median(creates) * 1e3,
        "create_p95_ms": quantile(creates, 0.95) * 1e3,
        "delete_p50_ms": statistics.median(removes) * 1e3,
        "cpu_ms_per_create": (_cpu() - cpu) / count * 1e3,
    }


async def _grow(
    pool: Pool,
    spec: SandboxSpec,
    session: str,
    held: list[Record],
    target: int,
    concurrency: int,
    failures: list[str],
    min_available: float,
) -> str | None:
    """Acquire until ``target`` are held, each failed create tried again; returns the
    wall: the last failure once ``_WALL`` creates in a row have failed, or the host's
    MemAvailable under ``min_available`` bytes."""
    gate = asyncio.Semaphore(concurrency)
    in_a_row = 0
    floor: list[str] = []

    async def one() -> None:
        nonlocal in_a_row
        async with gate:
            while in_a_row < _WALL and not floor:
                available = _meminfo()["MemAvailable"]
                if available < min_available:
                    # The host's own wall, reached before the kernel's OOM killer picks
                    # a victim (on a shared machine, maybe not one of ours).
                    floor.append(f"MemAvailable {available / 2**30:.2f} GiB < the floor")
                    return
                try:
                    held.append(await pool.acquire(spec, session=session, timeout=300))
                except Exception as exc:  # noqa: BLE001 - counted; enough in a row are the wall
                    failures.append(repr(exc))
                    print(f"failed       held={len(held)} {exc!r}", file=sys.stderr, flush=True)
                    in_a_row += 1
                    continue
                in_a_row = 0
                if len(held) % 100 == 0:
                    progress(len(held), target)
                return

    await asyncio.gather(*(one() for _ in range(target - len(held))))
    if floor:
        return floor[0]
    return failures[-1] if in_a_row >= _WALL else None


async def run(
    curve: list[int],
    concurrency: int,
    probe: int,
    state: Path,
    disk: bool,
    seccomp: str,
    min_available: float = 2 * 2**30,
    own_views: bool = False,
) -> tuple[str, bool]:
    """The curve's lines, and whether it reached its top and left nothing."""
    spec = SPEC.model_copy(update={"seccomp": seccomp})
    cgroup_parent = new_cgroup_parent()
    config = LocalConfig(
        state_dir=state, cgroup_parent=cgroup_parent, dev_tmpfs=own_views, own_sysfs=own_views
    )
    if not disk:
        config = config.model_copy(update={"disk": None})
    provider = LocalProvider(config)
    tar = busybox_rootfs_tar(state / "busybox.tar")
    await provider.images.import_archive(tar, name="busybox")
    deletes = _Deletes()
    pool = Pool(
        provider,
        PoolConfig(
            name=f"density-{uuid.uuid4().hex[:8]}",
            lease=1e9,
            lifetime=1e9,
            record_hand_over=False,
            pacing=PacingConfig(rate=500.0, burst=64, max_window=4096),
        ),
        hook=deletes.hook,
    )
    await pool.start()
    session = pool.open_session()
    held: list[Record] = []
    lines: list[str] = []
    points: list[tuple[int, dict[str, float]]] = []
    wall: str | None = None
    failures: list[str] = []
    base, base_slabs = _meminfo(), _slabs()
    try:
        for target in curve:
            started = time.perf_counter()
            wall = await _grow(
                pool, spec, session, held, target, concurrency, failures, min_available
            )
            grew = time.perf_counter() - started
            if wall is not None:
                # Measured there too: the top of the curve is where the host stopped it.
                lines.append(f"wall         held={len(held)} target={target} error={wall}")
                print(lines[-1], file=sys.stderr, flush=True)
            await asyncio.sleep(2 if held else 0)  # let page cache and slab settle
            now = _meminfo()
            n = max(1, len(held))
            per = {
                k: (base[k] - now[k] if k == "MemAvailable" else now[k] - base[k]) / n / 2**20
                for k in _MEMINFO
            }
            pss = [
                p
                for r in held[:: max(1, len(held) // 20)]
                if r.info
                and r.info.endpoint
                and r.info.endpoint.pid
                and (p := _pss(r.info.endpoint.pid))
            ]
            # The first pass reads each new sandbox's files, the second what changed.
            t0 = time.perf_counter()
            await pool.reconcile()
            cold_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            await pool.reconcile()
            reconcile_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            await provider._runtime.states()  # its share of the pass
            runtime_list_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            pool.stats()
            stats_ms = (time.perf_counter() - t0) * 1e3
            try:
                result = await _probe(pool, spec, session, deletes, probe)
            except Exception as exc:  # noqa: BLE001 - at the wall a probe may fail too
                lines.append(f"probe failed held={len(held)} error={exc!r}")
                break
            points.append((len(held), {**result, "mem": per["MemAvailable"] if held else 0.0}))
            line = (
                f"held={len(held)} create_p50_ms={result['create_p50_ms']:.1f} "
                f"p95_ms={result['create_p95_ms']:.1f} delete_p50_ms={result['delete_p50_ms']:.1f} "
                f"cpu_ms_per_create={result['cpu_ms_per_create']:.1f} failed={len(failures)} "
                f"grow_rate_per_s={(len(held) - (points[-2][0] if len(points) > 1 else 0)) / grew if grew > 0.5 else 0:.1f} "
                f"reconcile_ms={reconcile_ms:.1f} (cold={cold_ms:.1f} {provider.config.runtime}_list={runtime_list_ms:.1f}) "
                f"stats_ms={stats_ms:.2f} "
            )
            if held:
                line += (
                    f"mem_per_held_mib={per['MemAvailable']:.2f} (anon={per['AnonPages']:.2f} "
                    f"slab={per['Slab']:.2f} percpu={per['Percpu']:.2f} pagetables={per['PageTables']:.2f} "
                    f"kstack={per['KernelStack']:.2f} cgroup={_charged(cgroup_parent) / n / 2**20:.2f} daemon_pss={statistics.median(pss) / 2**20 if pss else 0:.2f}) "
                )
                own = _own_superblocks(held)
                line += f"superblocks={own} shrinker_model_kib={len(held) * own / 64:.0f} "
                slabs = _slabs()
                grown = sorted(
                    ((slabs.get(k, 0) - v, k) for k, v in base_slabs.items()), reverse=True
                )
                line += (
                    "top_slabs_kib="
                    + ",".join(f"{k}:{d / n / 1024:.0f}" for d, k in grown[:5])
                    + " "
                )
            line += (
                f"mounts={len(Path('/proc/self/mountinfo').read_text().splitlines())} "
                f"fds={len(os.listdir('/proc/self/fd'))} threads={_threads()}"
            )
            lines.append(line)
            print(line, file=sys.stderr, flush=True)
            if wall is not None:
                break
    finally:
        n = len(held)
        started = time.perf_counter()
        await pool.aclose(timeout=600)
        deleted = time.perf_counter() - started
        await provider.aclose()  # unmounts the disk filesystem: none of its layers is left
        leftover = count_leftover(provider) + len(provider.disk.names()) + provider.disk.mounted()
        remove_cgroup_parent(cgroup_parent)
    lines.append(f"delete       n={n} seconds={deleted:.2f} leftover={leftover}")
    first = points[0][1]["create_p50_ms"] if points else float("nan")
    top_n, top = points[-1] if points else (0, {"create_p50_ms": float("nan"), "mem": 0.0})
    lines.append(
        f"seccomp={seccomp} ready={top_n}/{curve[-1]} create_p50_ms={first:.1f} "
        f"create_p50_top_ms={top['create_p50_ms']:.1f} ratio={top['create_p50_ms'] / first:.2f} "
        f"mem_per_sandbox_mib={top['mem']:.2f} leftover={leftover}"
    )
    return "\n".join(lines), leftover == 0 and wall is None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=None, help="top of the curve: 0,N")
    parser.add_argument("--curve", help="held counts to measure at, comma-separated, rising")
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    parser.add_argument("--probe", type=int, default=20, help="sandboxes per probe")
    parser.add_argument(
        "--min-available-gib",
        type=float,
        default=2.0,
        help="stop growing when the host's MemAvailable falls below this (the wall)",
    )
    parser.add_argument(
        "--disk", default="on", help="per-sandbox disk limit: on, off, or both (on,off)"
    )
    parser.add_argument(
        "--seccomp", default="default", help="filters to compare, comma-separated (spec.seccomp)"
    )
    parser.add_argument(
        "--views",
        default="shared",
        help="/dev, /dev/shm and /sys: shared (no superblock of their own), own, or both",
    )
    args = parser.parse_args()
    if args.curve:
        curve = [int(x) for x in args.curve.split(",")]
    else:
        curve = [0, 100 if args.n is None else args.n]
    if curve != sorted(curve) or curve[0] < 0:
        parser.error("--curve must be rising counts >= 0")
    clean = True
    runs = [
        (disk, seccomp, views)
        for disk in args.disk.split(",")
        for seccomp in args.seccomp.split(",")
        for views in args.views.split(",")
    ]
    for disk, seccomp, views in runs:
        state = Path(tempfile.mkdtemp(prefix="smb-", dir="/tmp"))
        try:
            print(f"# disk={disk} seccomp={seccomp} views={views} curve={curve}", flush=True)
            result = run(
                curve,
                args.concurrency,
                args.probe,
                state,
                disk == "on",
                seccomp,
                args.min_available_gib * 2**30,
                own_views=views == "own",
            )
            text, ok = asyncio.run(result)
            print(text, flush=True)
            clean = clean and ok
        finally:
            shutil.rmtree(state, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
