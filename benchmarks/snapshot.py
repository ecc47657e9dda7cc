"""Snapshots and forks on the local provider (crun, btrfs layers): what a fork costs
against a plain create, whether a snapshot's cost grows with the tree, what 16 forks of
a 1 GiB tree take on disk, a restore's first command, a GRPO-shaped run, and pause.

Every ratio is of samples taken side by side in this one run (interleaved where two
things are compared), so a noisy machine moves both sides alike.

    python benchmarks/snapshot.py            # the issue's sizes (about two minutes)
    python benchmarks/snapshot.py --small    # a quick run (CI runs it for leftovers)
    KUBECONFIG=/var/lib/sandman-kube/sandman.kubeconfig \\
        python benchmarks/snapshot.py --kubernetes   # the kubernetes provider's files

With ``--kubernetes`` it measures pods on one node (the hack/kube harness's real node
unless ``--node``), with this tree's daemon imported there unless ``--daemon-image``:
a fork's create->ready against a plain create's, a 10 MiB against a 1 GiB snapshot, a
files restore's first command, and a paused pod's CPU (read from its cgroup when the
node is this host). Last line: ``fork_ratio=<x> snapshot_size_ratio=<x>
restore_first_exec_p50_ms=<ms> pause_cpu_ms=<ms> leftover=<n> provider=kubernetes``
(leftover: the run's pods and snapshot files).

Last line: ``fork_ratio=<x> snapshot_size_ratio=<x> disk_16_forks_gib=<g>
restore_first_exec_p50_ms=<ms> grpo_speedup=<x> leftover=<n>``, then what it adds:
the memory restore (``restore_memory``: p50 ms from a fork's restore from a memory
snapshot of a process holding 200 MiB to its first command's answer, on gVisor with its
own network stack; ``na(no runsc)`` without runsc) and pause's CPU. ``leftover`` counts
the gVisor provider's too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import leftover, new_cgroup_parent, progress, timed

import sandman
from sandman.daemon import daemon_path
from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import PoolConfig
from sandman.providers.local import LocalProvider
from sandman.settings import KubernetesConfig, LocalConfig

SPEC: dict[str, Any] = {"memory": "256Mi", "pids": 256, "disk": "3Gi"}
# What the sandboxes are made of: the local store's busybox, or (--kubernetes) a spec.
TARGET: str | SandboxSpec = "busybox"
GIB = 2**30


async def sh(sb: sandman.AsyncSandbox, script: str, timeout: float = 600) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=timeout)
    if result.exit_code != 0:
        raise RuntimeError(f"{script!r} failed ({result.exit_code}): {result.stderr}")
    return result.stdout


def fill(mib: int) -> str:
    """A tree of ``mib`` MiB in 1 MiB files under /root/tree."""
    return f"mkdir -p /root/tree && i=0; while [ $i -lt {mib} ]; do " \
           f"head -c 1048576 /dev/urandom > /root/tree/f$i; i=$((i+1)); done"  # fmt: skip


async def fork_ratio(client: sandman.AsyncClient, rounds: int) -> tuple[float, float, float]:
    """p50 create->ready of a plain sandbox and of a fork of a prepared one, interleaved."""
    async with client.sandbox(TARGET, **SPEC) as parent:
        await sh(parent, fill(8))
        snap = await parent.snapshot()
        plain, forked = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            sb = await client.acquire(TARGET, **SPEC)
            plain.append(time.perf_counter() - started)
            await sb.release()
            started = time.perf_counter()
            sb = await client.acquire(snapshot=snap)
            forked.append(time.perf_counter() - started)
            await sb.release()
        await client.delete_snapshot(snap)
    p_plain, p_fork = statistics.median(plain), statistics.median(forked)
    return p_fork / p_plain, p_plain, p_fork


async def snapshot_cost(
    client: sandman.AsyncClient, small_mib: int, large_mib: int, rounds: int, disk: Path
) -> tuple[float, float, float, float]:
    """p50 snapshot time of a small and a large tree (interleaved), and the disk the large
    one's parent, its snapshot and 16 forks (each writing 1 MiB) take together, in GiB."""
    async with (
        client.sandbox(TARGET, **SPEC) as small,
        client.sandbox(TARGET, **SPEC) as large,
    ):
        await sh(small, fill(small_mib))
        os.sync()
        before = _used(disk)
        await sh(large, fill(large_mib))
        # Written back first: a snapshot flushes what its layer has dirty, which is the
        # cost of the write, not of keeping the tree.
        os.sync()
        times: dict[str, list[float]] = {"small": [], "large": []}
        for _ in range(rounds):
            for name, sb in (("small", small), ("large", large)):
                started = time.perf_counter()
                snap = await sb.snapshot()
                times[name].append(time.perf_counter() - started)
                await client.delete_snapshot(snap)
        forks = await large.fork(16)
        try:
            await asyncio.gather(
                *(sh(f, "head -c 1048576 /dev/urandom > /root/mine") for f in forks)
            )
            os.sync()
            used = (_used(disk) - before) / GIB
        finally:
            await asyncio.gather(*(f.release() for f in forks))
    p_small, p_large = statistics.median(times["small"]), statistics.median(times["large"])
    return p_large / p_small, p_small, p_large, used


def _used(path: Path) -> int:
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


async def restore_first_exec(client: sandman.AsyncClient, rounds: int) -> float:
    """p50 from a files restore's start to its first command's answer, in ms."""
    async with client.sandbox(TARGET, **SPEC) as sb:
        await sh(sb, fill(4))
        snap = await sb.snapshot()
        samples = []
        for _ in range(rounds):
            await sh(sb, "rm -rf /root/tree")
            started = time.perf_counter()
            await sb.restore(snap)
            await sb.exec(["true"])
            samples.append(time.perf_counter() - started)
        await client.delete_snapshot(snap)
    return statistics.median(samples) * 1000


async def calibrate(client: sandman.AsyncClient, target: float) -> int:
    """Loop iterations of busybox sh that take about ``target`` CPU seconds here."""
    async with client.sandbox(TARGET, **SPEC) as sb:
        n = 200_000
        took = await timed(lambda: sh(sb, _spin(n)))
    return max(1000, int(n * target / took))


def _spin(n: int) -> str:
    return f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); done"


def setup(iterations: int) -> str:
    """A checkout (2,000 small files) and an install (CPU for a while)."""
    return (
        "mkdir -p /repo && cd /repo && i=0; while [ $i -lt 2000 ]; do echo $i > f$i; "
        f"i=$((i+1)); done; {_spin(iterations)}"
    )


async def grpo(
    client: sandman.AsyncClient, iterations: int, group: int, commands: int
) -> tuple[float, float]:
    """Seconds to the group's last first command: prepared once and forked, then cold
    (``group`` creates, each running the setup, at once). Each sandbox then runs
    ``commands`` commands."""

    async def rollout(sb: sandman.AsyncSandbox, first: list[float], started: float) -> None:
        await sh(sb, "ls /repo | wc -l")
        first.append(time.perf_counter() - started)
        for i in range(commands - 1):
            await sh(sb, f"echo {i} >> /repo/log")

    started = time.perf_counter()
    firsts: list[float] = []
    async with client.sandbox(TARGET, **SPEC) as parent:
        await sh(parent, setup(iterations))
        forks = await parent.fork(group)
        try:
            await asyncio.gather(*(rollout(f, firsts, started) for f in forks))
        finally:
            await asyncio.gather(*(f.release() for f in forks))
    forked = max(firsts)

    async def cold(first: list[float]) -> None:
        async with client.sandbox(TARGET, **SPEC) as sb:
            await sh(sb, setup(iterations))
            await rollout(sb, first, started)

    started = time.perf_counter()
    firsts = []
    await asyncio.gather(*(cold(firsts) for _ in range(group)))
    return forked, max(firsts)


async def pause_cpu(client: sandman.AsyncClient) -> int:
    """CPU nanoseconds a paused sandbox spinning in a loop used over half a second."""
    async with client.sandbox(TARGET, **SPEC) as sb:
        await sh(sb, "(while :; do :; done) >/dev/null 2>&1 &")
        usage = next(Path("/sys/fs/cgroup/cpuacct").glob(f"**/{sb.id}/cpuacct.usage"))
        await sb.pause()
        before = int(usage.read_text())
        await asyncio.sleep(0.5)
        used = int(usage.read_text()) - before
        await sb.resume()
    return used


# A busybox shell holding about 200 MiB in a variable, then waiting.
HOLD_200_MIB = "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo held; sleep 1000000"


async def memory_restore(state: Path, rounds: int, mib: int) -> tuple[str, int]:
    """On gVisor: a memory snapshot of a sandbox whose process holds ``mib`` MiB, then
    ``rounds`` sandboxes restored from it, one after another; p50 ms from each acquire
    to its first command's answer (``na(...)`` without runsc), and what was left."""
    if shutil.which("runsc") is None:
        return "na(no runsc)", 0
    config = LocalConfig(
        state_dir=state, runtime="runsc", runsc_network="sandbox", disk=None,
        cgroup_parent=new_cgroup_parent(),
    )  # fmt: skip
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_rootfs_tar(state / "busybox.tar"), name="busybox")
    hold = HOLD_200_MIB.replace("200000000", str(mib * 1_000_000))
    try:
        async with sandman.local(config) as client:
            async with client.sandbox("busybox", memory="1Gi", pids=256) as sb:
                process = await sb.spawn(["sh", "-c", hold])
                while "held" not in (await sb.read_output(process.id, wait=5)).stdout:
                    pass
                started = time.perf_counter()
                snap = await sb.snapshot(memory=True)
                took = time.perf_counter() - started
            print(
                f"memory snapshot of a {mib} MB process: {took:.2f} s "
                f"(checkpoint, files, restore in place), {snap.size / 2**20:.1f} MiB kept"
            )
            samples = []
            for _ in range(rounds):
                started = time.perf_counter()
                fork = await client.acquire(snapshot=snap)
                await fork.exec(["true"])
                samples.append(time.perf_counter() - started)
                if (await fork.poll(process.id)).running is not True:
                    raise RuntimeError("the restored process is not running")
                await fork.release()
            await client.delete_snapshot(snap)
    finally:
        await provider.aclose()
    # gVisor's processes of a deleted sandbox may take a moment more to exit.
    for _ in range(200):
        left = leftover(provider)
        if not left:
            break
        await asyncio.sleep(0.05)
    left += len(await provider.snapshots())
    p50 = statistics.median(samples) * 1000
    print(f"memory restore to first exec p50: {p50:.0f} ms ({rounds} forks; {left} left)")
    return f"{p50:.0f}", left


async def run(args: argparse.Namespace, state: Path) -> str:
    config = LocalConfig(state_dir=state, cgroup_parent=new_cgroup_parent())
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_rootfs_tar(state / "busybox.tar"), name="busybox")
    small = args.small
    steps = 7
    try:
        async with sandman.local(config) as client:
            ratio, p_plain, p_fork = await fork_ratio(client, 3 if small else 10)
            print(f"create->ready p50: plain {p_plain * 1000:.0f} ms, fork {p_fork * 1000:.0f} ms")
            progress(1, steps)
            large = 64 if small else 1024
            size_ratio, p_s, p_l, disk = await snapshot_cost(
                client, 10, large, 3 if small else 5, state / "disk"
            )
            print(
                f"snapshot p50: 10 MiB tree {p_s * 1000:.1f} ms, {large} MiB tree {p_l * 1000:.1f} ms"
            )
            print(f"disk for a {large} MiB tree, its snapshot and 16 forks: {disk:.3f} GiB")
            progress(2, steps)
            restore_ms = await restore_first_exec(client, 3 if small else 10)
            print(f"files restore to first exec p50: {restore_ms:.0f} ms")
            progress(3, steps)
            iterations = await calibrate(client, 1.0 if small else args.setup_seconds)
            forked, cold = await grpo(client, iterations, 2 if small else 8, 3 if small else 20)
            print(f"GRPO group: prepared once and forked {forked:.1f} s, cold {cold:.1f} s")
            progress(4, steps)
            cpu = await pause_cpu(client)
            print(f"paused for 0.5 s, spinning: {cpu / 1e6:.3f} ms of CPU (running: ~500)")
            progress(5, steps)
    finally:
        await provider.aclose()
    left = leftover(provider) + len(await provider.snapshots())
    print(f"left by crun's steps: {left}")
    (state / "gvisor").mkdir()
    restore_memory, left_gvisor = await memory_restore(
        state / "gvisor", 3 if small else 10, 20 if small else 200
    )
    left += left_gvisor
    progress(6, steps)
    progress(steps, steps)
    return (
        f"fork_ratio={ratio:.2f} snapshot_size_ratio={size_ratio:.2f} "
        f"disk_16_forks_gib={disk:.3f} restore_first_exec_p50_ms={restore_ms:.0f} "
        f"grpo_speedup={cold / forked:.2f} leftover={left} "
        f"restore_memory={restore_memory} pause_cpu_ms={cpu / 1e6:.3f}"
    )


# -- Kubernetes (--kubernetes): pods on a real node, snapshots kept by the pool ---------

HARNESS = Path("/var/lib/sandman-kube")
REPO = Path(__file__).resolve().parents[1]


def _harness_env() -> dict[str, str]:
    env = HARNESS / "env"
    if not env.exists():
        return {}
    return dict(line.split("=", 1) for line in env.read_text().splitlines() if "=" in line)


@contextlib.contextmanager
def _daemon_image(env: dict[str, str], given: str | None) -> Iterator[str]:
    """``given``, or this tree's sandmand imported into the hack/kube node (whose own daemon
    image is that of the tree it was started from) under a name of this run's."""
    if given:
        yield given
        return
    name = f"sandman.local/sandmand:bench-{uuid.uuid4().hex[:8]}"
    ctr = [env["SANDMAN_KUBE_CTR"], "--address", f"{env['SANDMAN_KUBE_DIR']}/containerd/containerd.sock",
           "--namespace", "k8s.io"]  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "root"
        root.mkdir()
        shutil.copy2(daemon_path(), root / "sandmand")
        (root / "image-id").write_text(name)  # a digest of its own
        archive = Path(work) / "sandmand.tar"
        subprocess.run(
            [sys.executable, str(REPO / "hack/kube/images/oci_archive.py"), str(root),
             str(archive), name, "Entrypoint", "--", "/sandmand"], check=True,
        )  # fmt: skip
        subprocess.run([*ctr, "images", "import", str(archive)], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run([*ctr, "images", "rm", "--sync", name], check=False, capture_output=True)


async def snapshot_times(
    client: sandman.AsyncClient, small_mib: int, large_mib: int, rounds: int
) -> tuple[float, float, float, int]:
    """p50 snapshot time of a small and a large tree (interleaved), and what the large one's
    snapshot keeps on the pool's host, in bytes."""
    async with client.sandbox(TARGET, **SPEC) as small, client.sandbox(TARGET, **SPEC) as large:
        await sh(small, fill(small_mib))
        await sh(large, fill(large_mib))
        times: dict[str, list[float]] = {"small": [], "large": []}
        kept = 0
        for _ in range(rounds):
            for name, sb in (("small", small), ("large", large)):
                started = time.perf_counter()
                snap = await sb.snapshot()
                times[name].append(time.perf_counter() - started)
                kept = snap.size if name == "large" else kept
                await client.delete_snapshot(snap)
    p_small, p_large = statistics.median(times["small"]), statistics.median(times["large"])
    return p_large / p_small, p_small, p_large, kept


async def pause_cpu_pod(client: sandman.AsyncClient, config: KubernetesConfig) -> float | None:
    """CPU ms a paused pod spinning in a loop used over 2 s, its daemon included, read
    from the pod's cgroup on this host; None when the pod runs elsewhere."""
    from sandman.providers.kubernetes import KubernetesProvider

    async with client.sandbox(TARGET, **SPEC) as sb:
        await sh(sb, "(while :; do :; done) >/dev/null 2>&1 &")
        provider = KubernetesProvider(config)
        try:
            uid = (await provider.api.get_pod(sb.id))["metadata"]["uid"]
        finally:
            await provider.aclose()
        found = list(Path("/sys/fs/cgroup").glob(f"cpuacct/*/kubepods/**/pod{uid}/cpuacct.usage"))
        if not found:
            return None
        await sb.pause()
        before = int(found[0].read_text())
        await asyncio.sleep(2)
        used = int(found[0].read_text()) - before
        await sb.resume()
    return used / 1e6


async def run_kubernetes(args: argparse.Namespace, state: Path) -> str:
    """Fork vs plain create, small vs large snapshot, a restore's first command: pods on
    the node ``--node`` (default: the hack/kube harness's real node)."""
    global TARGET, SPEC
    env = _harness_env()
    node = args.node or env.get("SANDMAN_KUBE_REAL_NODE")
    if not node:
        raise SystemExit("--kubernetes needs --node (or a hack/kube harness)")
    TARGET = SandboxSpec(
        image=args.image, cpu=1, memory="512Mi",
        kubernetes=KubernetesOptions(
            cpu_request=0.05, memory_request="32Mi", ephemeral_storage="4Gi",
            node_selector={"kubernetes.io/hostname": node},
        ),
    )  # fmt: skip
    SPEC = {}
    small = args.small
    pool = f"bench-snap-{uuid.uuid4().hex[:8]}"
    with _daemon_image(env, args.daemon_image) as image:
        config = KubernetesConfig(
            kubeconfig=args.kubeconfig, daemon_image=image, snapshot_dir=state / "snapshots"
        )
        async with sandman.kubernetes(config, pool=PoolConfig(name=pool)) as client:
            ratio, p_plain, p_fork = await fork_ratio(client, 3 if small else 10)
            print(f"create->ready p50: plain {p_plain * 1000:.0f} ms, fork {p_fork * 1000:.0f} ms")
            progress(1, 3)
            large = 64 if small else 1024
            size_ratio, p_s, p_l, kept = await snapshot_times(client, 10, large, 3 if small else 5)
            print(
                f"snapshot p50: 10 MiB tree {p_s * 1000:.0f} ms, {large} MiB tree "
                f"{p_l * 1000:.0f} ms ({kept / 2**20:.0f} MiB kept on the pool's host)"
            )
            progress(2, 3)
            restore_ms = await restore_first_exec(client, 3 if small else 10)
            print(f"files restore to first exec p50: {restore_ms:.0f} ms")
            pause_ms = await pause_cpu_pod(client, config)
            shown = "not on this host" if pause_ms is None else f"{pause_ms:.1f} ms of CPU"
            print(f"paused for 2 s, spinning: {shown}, daemon included (running: ~2000)")
            progress(3, 3)
        from sandman.providers.kubernetes import KubernetesProvider

        provider = KubernetesProvider(config)
        try:
            left = len(await provider.list(labels={"sandman.io/pool": pool}))
        finally:
            await provider.aclose()
    left += sum(1 for p in (state / "snapshots").rglob("*") if p.is_file())
    return (
        f"fork_ratio={ratio:.2f} snapshot_size_ratio={size_ratio:.2f} "
        f"restore_first_exec_p50_ms={restore_ms:.0f} "
        f"pause_cpu_ms={'na' if pause_ms is None else f'{pause_ms:.3f}'} leftover={left} "
        "provider=kubernetes"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a quick run at small sizes")
    parser.add_argument(
        "--setup-seconds", type=float, default=30.0, help="the GRPO run's install, CPU seconds"
    )
    parser.add_argument("--state-dir", type=Path, help="an empty directory (default: a new one)")
    parser.add_argument(
        "--kubernetes", action="store_true",
        help="measure the kubernetes provider instead (files: fork, snapshot, restore; pause)",
    )  # fmt: skip
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--node", help="--kubernetes: the node to run on (default: the harness's)")
    parser.add_argument("--image", default="sandman.local/busybox:1.35", help="--kubernetes")
    parser.add_argument(
        "--daemon-image",
        help="--kubernetes: default: this tree's sandmand, imported into the hack/kube node",
    )
    args = parser.parse_args()
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="smb-", dir="/tmp"))
    try:
        line = asyncio.run(run_kubernetes(args, state) if args.kubernetes else run(args, state))
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    print(line)
    return 0 if line.split("leftover=")[1].split()[0] == "0" else 1


if __name__ == "__main__":
    sys.exit(main())
