"""Pause and resume of pods on the harness's real node (docs/snapshots.md, Kubernetes):
the pod's daemon stops every other process of it, and a hostile sandbox cannot keep
burning CPU meanwhile, measured from the host (the pod's cgroup and /proc).

Every sandbox runs the unmodified busybox image with this tree's daemon (imported
under a name of this module's); its pods carry the test's own pool name (the
``pool_name`` fixture fails the test if any is left).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import sandman
from sandman import errors
from sandman.pool import Pool, PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import Admin, config_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 600)]

CGROUP = Path("/sys/fs/cgroup")
TICK = os.sysconf("SC_CLK_TCK")
# A busy loop, and a spawner that forks all the time (a subshell each turn) and leaves
# short busy loops behind: what a pause must catch in the middle of a fork.
BUSY = "while :; do :; done"
SPAWNER = (
    "while :; do (:); sh -c 'i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done' & sleep 0.05; done"
)


def pod_cgroup(uid: str) -> Path:
    """The pod's cgroup directory of CPU accounting on this host (v1 or v2)."""
    root = os.environ.get("SANDMAN_KUBE_CGROUP_ROOT", "sandman-kube")
    for pattern in (f"cpuacct/{root}/kubepods/**/pod{uid}", f"{root}/kubepods/**/pod{uid}"):
        found = list(CGROUP.glob(pattern))
        if found:
            return found[0]
    raise AssertionError(f"no cgroup of pod {uid} under {CGROUP}")


def pod_usage(cgroup: Path) -> float:
    """The CPU seconds every process of the pod has used (daemon included)."""
    if (cgroup / "cpuacct.usage").exists():
        return int((cgroup / "cpuacct.usage").read_text()) / 1e9
    for line in (cgroup / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    raise AssertionError(f"no usage in {cgroup}")


def workload(cgroup: Path) -> dict[int, int]:
    """The pod's processes but the first of each container (the daemon, the pod's pause
    process), as the host sees them: host pid to CPU ticks used."""
    pids: set[int] = set()
    for procs in cgroup.rglob("cgroup.procs"):
        pids |= {int(p) for p in procs.read_text().split()}
    out = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        nspid = next(line for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid.split()[-1] != "1":
            fields = stat[stat.rindex(")") + 2 :].split()
            out[pid] = int(fields[11]) + int(fields[12])
    return out


def ran(before: dict[int, int], after: dict[int, int]) -> list[int]:
    """The pids that used CPU between the two, or are new (one that exited and was
    reaped meanwhile is not)."""
    return [pid for pid, ticks in after.items() if before.get(pid, -1) != ticks]


@contextlib.asynccontextmanager
async def admin_exec(cluster: KubeCluster, pod: str, script: str) -> AsyncIterator[None]:
    """``kubectl exec`` a script into the pod's task container as the admin: a process
    in the sandbox that its daemon did not start. Its client is killed after the block."""
    env = {**os.environ, "KUBECONFIG": str(cluster.admin_kubeconfig)}
    process = await asyncio.create_subprocess_exec(
        str(cluster.kubectl), "-n", cluster.namespace, "exec", pod, "-c", "sandbox", "--",
        "sh", "-c", script,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def test_a_paused_pod_uses_no_cpu_until_resumed(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, daemon_image: str
) -> None:
    config = config_for(kube_cluster, daemon_image=daemon_image)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        before = await admin.pod(sb.id)
        assert before is not None
        cgroup = pod_cgroup(before["metadata"]["uid"])
        await sb.spawn(["sh", "-c", BUSY])
        await sb.spawn(["sh", "-c", SPAWNER])

        async def busy() -> bool:
            start = pod_usage(cgroup)
            await asyncio.sleep(0.5)
            return pod_usage(cgroup) - start > 0.1

        await wait_for("the loops to burn CPU", 30, busy)

        await sb.pause()
        assert sb.paused
        with pytest.raises(errors.SandboxPaused):
            await sb.exec(["true"])
        # Not only the SDK's own check: the daemon refuses too (any client of it).
        with pytest.raises(errors.SandboxPaused):
            await sb._daemon.exec(["true"])
        procs, used = workload(cgroup), pod_usage(cgroup)
        assert len(procs) >= 3, procs
        await asyncio.sleep(3)
        after, used_after = workload(cgroup), pod_usage(cgroup)
        # Not one tick more for the workload, and no new process; the daemon's own
        # watch costs it next to nothing.
        assert not ran(procs, after), (procs, after)
        assert used_after - used < 0.05, f"paused 3 s, the pod used {used_after - used:.3f} s"

        # A process the daemon did not start (kubectl exec) continues everything and
        # burns: the daemon's watch stops it all again within a second or so.
        async with admin_exec(kube_cluster, sb.id, f"kill -CONT -1; {BUSY}"):

            async def escaped() -> bool:
                return bool(ran(procs, workload(cgroup)))

            await wait_for("the exec'd process to run", 30, escaped, interval=0.05)

            async def calm() -> bool:
                first = workload(cgroup)
                await asyncio.sleep(1)
                return not ran(first, workload(cgroup))

            await wait_for("everything to be stopped again", 10, calm)
            quiet_from = pod_usage(cgroup)
            await asyncio.sleep(2)
            assert pod_usage(cgroup) - quiet_from < 0.05

        # A pool restarted meanwhile finds it paused: the pause is the daemon's state.
        provider = KubernetesProvider(config)
        try:
            (info,) = [i for i in await provider.list() if i.id == sb.id]
            assert info.endpoint is not None
            async with info.endpoint.client() as daemon:
                with pytest.raises(errors.SandboxPaused):
                    await daemon.exec(["true"])
            with pytest.raises(errors.ConfigError, match="gVisor"):
                await provider.pause(sb.id, memory=True)
            await provider.pause(sb.id)  # paused already: nothing changes
        finally:
            await provider.aclose()

        await sb.resume()
        assert not sb.paused
        await wait_for("the loops to burn CPU again", 30, busy)
        result = await sb.exec(["sh", "-c", "ps -o comm | grep -c sh"])
        assert int(result.stdout) >= 2  # the loops of before, going on
        after_pod = await admin.pod(sb.id)
        assert after_pod is not None
        assert after_pod["metadata"]["uid"] == before["metadata"]["uid"]  # same pod
        await sb.resume()  # not paused: nothing changes
        sandbox_id = sb.id

    async def gone() -> bool:
        return await admin.pod(sandbox_id) is None

    await wait_for("the released sandbox's pod to go", 60, gone)


async def test_a_paused_pod_is_released_snapshotted_and_restored(
    kube_cluster: KubeCluster, pool_name: str, daemon_image: str, tmp_path: Path
) -> None:
    config = config_for(kube_cluster, daemon_image=daemon_image, snapshot_dir=tmp_path)
    async with (
        sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client,
        client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb,
    ):
        await sb.exec(["sh", "-c", "echo kept > /kept"])
        await sb.spawn(["sh", "-c", BUSY])
        await sb.pause()
        # Its files are read while it is paused (consistent: nothing writes).
        snap = await sb.snapshot()
        await sb.restore(snap)  # a new pod, not paused
        assert not sb.paused
        assert (await sb.exec(["cat", "/kept"])).stdout == "kept\n"
        await client.delete_snapshot(snap)
        await sb.pause()
        # Released while paused: its pod goes (the pool_name fixture checks).
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


async def test_a_pool_restarted_adopts_a_paused_pod_and_resumes_it(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, daemon_image: str
) -> None:
    config = config_for(kube_cluster, daemon_image=daemon_image)
    spec = real_node_spec(kube_cluster)
    first = KubernetesProvider(config)
    try:
        async with Pool(first, PoolConfig(name=pool_name)) as pool:
            session = pool.open_session()
            record = await pool.acquire(spec, session=session, timeout=180)
            assert record.info is not None and record.info.endpoint is not None
            async with record.info.endpoint.client() as daemon:
                await daemon.spawn(["sh", "-c", BUSY])
            await pool.pause(record.id)
            await pool.aclose(release=False)  # a restart: its pods are left to the next
    finally:
        await first.aclose()

    second = KubernetesProvider(config)
    try:
        async with Pool(second, PoolConfig(name=pool_name, adopt_orphans=True)) as pool:
            adopted = pool.get(record.id)  # adopted at start
            assert adopted.info is not None and adopted.info.endpoint is not None
            async with adopted.info.endpoint.client() as daemon:
                with pytest.raises(errors.SandboxPaused):  # still paused
                    await daemon.exec(["true"])
                await pool.resume(record.id)
                result = await daemon.exec(["sh", "-c", "ps -o comm | grep -c sh"])
                assert int(result.stdout) >= 1  # the loop of before, going on
    finally:
        await second.aclose()

    async def gone() -> bool:
        return await admin.pod(record.id) is None

    await wait_for("the adopted sandbox's pod to go", 60, gone)
