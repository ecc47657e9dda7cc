"""What an acquire served by a warm spare costs: the hand-over alone, with and without
recording it on the sandbox (`PoolConfig.record_hand_over`, one `Provider.relabel`).

A pool keeps one ready spare of a tiny busybox sandbox; each sample acquires it
(timed), then releases it and waits (untimed) until the spare is ready again. The
same number of bare `Provider.relabel` calls is timed too. Modes are interleaved
so both see the same machine. Last line:

    recorded_median_ms=<x> unrecorded_median_ms=<y> relabel_median_ms=<z>

Local provider (root, crun): ``.venv/bin/python benchmarks/handover.py -n 200``.
Kubernetes: ``--kubeconfig PATH [--namespace NS]``: pods go to KWOK nodes (simulated,
e.g. hack/kube with ``SANDMAN_KUBE_REAL_NODE=0``); readiness is the pod's Ready condition.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from _common import new_cgroup_parent, quantile

from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.base import Provider

RECORDS = any(f.name == "record_hand_over" for f in dataclasses.fields(PoolConfig))


def _line(name: str, samples: list[float]) -> str:
    return (
        f"{name:<11} median_ms={statistics.median(samples) * 1e3:.3f} "
        f"p95_ms={quantile(samples, 0.95) * 1e3:.3f} n={len(samples)}"
    )


async def _one_acquire(pool: Pool, spec: SandboxSpec, session: str) -> tuple[float, float]:
    """The acquire's seconds, then those of one bare relabel of what it got."""
    async with asyncio.timeout(120):
        while pool.stats().get("ready", 0) < 1:  # noqa: ASYNC110 - polls the pool's own count
            await asyncio.sleep(0.002)
    started = time.perf_counter()
    record = await pool.acquire(spec, session=session, timeout=60)
    elapsed = time.perf_counter() - started
    if record.timeline.get("create_called", 0) > record.timeline.get("queued", 0) + 0.5:
        raise RuntimeError("not served by a spare")
    started = time.perf_counter()
    await pool.provider.relabel(record.id, {"sandman-bench": "1"})
    relabel = time.perf_counter() - started
    pool.release(record.id)
    return elapsed, relabel


async def measure(provider: Provider, spec: SandboxSpec, n: int) -> str:
    name = f"handover-{uuid.uuid4().hex[:6]}"
    modes = [True, False] if RECORDS else [False]
    pools = {}
    for record in modes:
        extra = {"record_hand_over": record} if RECORDS else {}
        config = PoolConfig(name=f"{name}-{int(record)}", ready_timeout=120, **extra)  # type: ignore[arg-type]
        pools[record] = Pool(provider, config)
    samples: dict[bool, list[float]] = {mode: [] for mode in modes}
    relabels: list[float] = []
    try:
        sessions = {}
        for mode, pool in pools.items():
            await pool.start()
            pool.warm(spec, 1)
            sessions[mode] = pool.open_session(lease=3600)
        for i in range(n + 5):
            for mode, pool in pools.items():
                elapsed, relabel = await _one_acquire(pool, spec, sessions[mode])
                if i >= 5:
                    samples[mode].append(elapsed)
                    relabels.append(relabel)
    finally:
        for pool in pools.values():
            await pool.aclose()
    for mode in modes:
        print(_line("recorded" if mode else "unrecorded", samples[mode]))
    print(_line("relabel", relabels))
    recorded = statistics.median(samples[True]) * 1e3 if RECORDS else float("nan")
    return (
        f"recorded_median_ms={recorded:.3f} "
        f"unrecorded_median_ms={statistics.median(samples[False]) * 1e3:.3f} "
        f"relabel_median_ms={statistics.median(relabels) * 1e3:.3f}"
    )


async def local(n: int) -> str:
    from sandman.providers.local import LocalProvider
    from sandman.providers.local.host import remove_cgroup_parent
    from sandman.settings import LocalConfig

    state = Path(tempfile.mkdtemp(prefix="sm-ho-", dir="/tmp"))
    parent = new_cgroup_parent()
    provider = LocalProvider(LocalConfig(state_dir=state, cgroup_parent=parent))
    try:
        tar = busybox_rootfs_tar(state / "busybox.tar")
        await provider.images.import_archive(tar, name="busybox")
        return await measure(provider, SandboxSpec(image="busybox"), n)
    finally:
        await provider.aclose()
        remove_cgroup_parent(parent)
        shutil.rmtree(state, ignore_errors=True)


async def kubernetes(n: int, kubeconfig: str, namespace: str | None) -> str:
    from sandman.models import KubernetesOptions
    from sandman.providers.kubernetes import KubernetesProvider
    from sandman.providers.kubernetes import pods as pod_specs
    from sandman.settings import KubernetesConfig

    settings: dict[str, object] = {
        "kubeconfig": kubeconfig, "readiness": "pod", "annotations": pod_specs.KWOK_NO_DELAY,
    }  # fmt: skip
    if namespace:
        settings["namespace"] = namespace
    provider = KubernetesProvider(KubernetesConfig.model_validate(settings))
    kwok = KubernetesOptions(
        cpu_request=0.001, memory_request="1Mi", node_selector={"type": "kwok"},
        tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
    )  # fmt: skip
    spec = SandboxSpec(image="sandman.local/busybox:1.35", cpu=0.1, memory="64Mi", kubernetes=kwok)
    try:
        return await measure(provider, spec, n)
    finally:
        await provider.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200, help="samples per mode")
    parser.add_argument("--kubeconfig", help="measure on this cluster instead of locally")
    parser.add_argument("--namespace")
    args = parser.parse_args()
    if args.kubeconfig:
        print(asyncio.run(kubernetes(args.n, args.kubeconfig, args.namespace)))
    else:
        print(asyncio.run(local(args.n)))


if __name__ == "__main__":
    main()
