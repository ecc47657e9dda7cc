"""Snapshots with memory: gVisor (``runtime="runsc"``, its own network stack) checkpoints
every process of a sandbox; forks are restored from that image, each with its own
address and daemon token, and the original goes on running."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import anyio
import pytest

from sandman import errors
from sandman.daemon import DaemonClient
from sandman.models import SandboxSpec
from sandman.providers.base import DaemonEndpoint, SnapshotInfo
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc (gVisor) is not installed"),
    pytest.mark.timeout(180),
]

SPEC = SandboxSpec(image="busybox", memory="256Mi", pids=128, cpu=1)
# A shell whose state lives only in its memory: a random word and a counter.
COUNTER = (
    "x=$(head -c 6 /dev/urandom | od -An -tx1 | tr -d ' \\n'); i=0; "
    'while true; do i=$((i+1)); echo "$x $i" > /tmp/count; sleep 0.05; done'
)


@pytest.fixture
async def gvisor(state_dir: Path, busybox_tar: Path) -> AsyncIterator[LocalProvider]:
    config = config_for(state_dir, runtime="runsc", runsc_network="sandbox", disk=None)
    async with provider_for(config, busybox_tar) as provider:
        yield provider


async def count(daemon: DaemonClient) -> tuple[str, int]:
    """The counter shell's word and count, as it last wrote them."""
    for _ in range(100):
        out = (await daemon.exec("cat /tmp/count", timeout=10)).stdout.split()
        if len(out) == 2:
            return out[0], int(out[1])
        await anyio.sleep(0.02)  # read between its truncate and its write
    raise AssertionError("the counter never wrote")


async def counted_past(daemon: DaemonClient, n: int) -> tuple[str, int]:
    """The counter shell's word and count, once its count is past ``n`` (it goes on)."""
    with anyio.fail_after(10):
        while (now := await count(daemon))[1] <= n:
            await anyio.sleep(0.05)
    return now


async def test_a_fork_runs_the_processes_of_its_memory_snapshot_with_a_token_of_its_own(
    gvisor: LocalProvider,
) -> None:
    parent = await gvisor.create(SPEC)
    assert parent.endpoint is not None
    daemon = await ready(parent)
    try:
        counter = await daemon.spawn(["sh", "-c", COUNTER])
        await daemon.write_file("/root/before", "kept\n")
        await counted_past(daemon, 2)
    finally:
        await daemon.aclose()

    snapshot = await gvisor.snapshot(parent.id, memory=True, labels={"who": "test"})
    assert snapshot.memory and snapshot.source == parent.id and snapshot.size > 0

    # The original goes on running: same address, same token, same processes.
    (listed,) = await gvisor.list()
    assert listed.state == "running" and listed.endpoint == parent.endpoint
    daemon = await ready(parent)
    try:
        word, at_snapshot = await count(daemon)
        await daemon.write_file("/root/after", "parent only\n")
        assert (await daemon.poll(counter.id)).running
    finally:
        await daemon.aclose()

    fork = await gvisor.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
    assert fork.endpoint is not None and fork.endpoint.host is not None
    assert fork.endpoint.host != parent.endpoint.host
    assert fork.endpoint.token != parent.endpoint.token
    token_file = gvisor.config.state_dir / "sandboxes" / fork.id / "token"
    assert token_file.read_text() == fork.endpoint.token
    parent_file = gvisor.config.state_dir / "sandboxes" / parent.id / "token"
    assert parent_file.read_text() == parent.endpoint.token
    forked = await ready(fork)
    try:
        # The same shell, restored: its word from memory, its count going on.
        again, then = await count(forked)
        assert again == word and then >= 3
        await counted_past(forked, then)
        assert (await forked.poll(counter.id)).running
        # Its files as of the snapshot.
        assert (await forked.read_file("/root/before")) == b"kept\n"
        assert not await forked.exists("/root/after")
    finally:
        await forked.aclose()

    # The parent's token opens nothing on the fork.
    stolen = DaemonEndpoint(
        host=fork.endpoint.host, port=fork.endpoint.port, token=parent.endpoint.token
    ).client()
    try:
        with pytest.raises(errors.Unauthorized):
            await stolen.exec("true")
    finally:
        await stolen.aclose()

    # Two forks of one image, independent of each other.
    second = await gvisor.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
    other = await ready(second)
    try:
        assert (await count(other))[0] == word
    finally:
        await other.aclose()
    for info in (fork, second):
        await gvisor.delete(info.id)
    await gvisor.delete_snapshot(snapshot.id)
    daemon = await ready(parent)
    try:
        assert (await count(daemon))[1] > at_snapshot
    finally:
        await daemon.aclose()


async def test_restore_in_place_brings_the_snapshots_processes_and_keeps_the_token(
    gvisor: LocalProvider,
) -> None:
    parent = await gvisor.create(SPEC)
    daemon = await ready(parent)
    try:
        counter = await daemon.spawn(["sh", "-c", COUNTER])
        word, _ = await count(daemon)
    finally:
        await daemon.aclose()
    snapshot = await gvisor.snapshot(parent.id, memory=True)
    other = await gvisor.create(SPEC)
    assert other.endpoint is not None and parent.endpoint is not None
    restored = await gvisor.restore(other.id, snapshot.id)
    assert restored.endpoint == other.endpoint  # same address, same token
    daemon = await ready(restored)
    try:
        assert (await count(daemon))[0] == word
        assert (await daemon.poll(counter.id)).running
    finally:
        await daemon.aclose()
    stolen = DaemonEndpoint(
        host=other.endpoint.host, port=other.endpoint.port, token=parent.endpoint.token
    ).client()
    try:
        with pytest.raises(errors.Unauthorized):
            await stolen.exec("true")
    finally:
        await stolen.aclose()


async def test_a_sandbox_serving_tcp_is_refused_and_keeps_running(gvisor: LocalProvider) -> None:
    info = await gvisor.create(SPEC)
    daemon = await ready(info)
    try:
        server = await daemon.spawn(["busybox", "httpd", "-f", "-p", "8080"])
        with anyio.fail_after(10):
            while "8080" not in (await daemon.exec("netstat -ltn")).stdout:
                await anyio.sleep(0.05)
    finally:
        await daemon.aclose()
    with pytest.raises(errors.DaemonError) as refused:
        await gvisor.snapshot(info.id, memory=True)
    assert refused.value.code == "not_checkpointable", refused.value
    assert f"pid {server.pid} (busybox): LISTEN [::]:8080" in str(refused.value), refused.value
    assert await gvisor.snapshots() == []
    # Untouched: it serves on, its server too.
    daemon = await ready(info)
    try:
        assert (await daemon.poll(server.id)).running
        assert (await daemon.exec("true")).exit_code == 0
        await daemon.kill(server.id)
    finally:
        await daemon.aclose()
    # Without the server, it can be kept.
    snapshot = await gvisor.snapshot(info.id, memory=True)
    assert snapshot.memory


async def test_memory_needs_gvisor_with_its_own_network_stack(
    state_dir: Path, busybox_tar: Path
) -> None:
    for settings in ({}, {"runtime": "runsc"}):
        provider = LocalProvider(config_for(state_dir, **settings))
        with pytest.raises(errors.ConfigError, match="runsc_network='sandbox'"):
            await provider.snapshot("sb-none", memory=True)
        await provider.aclose()


async def test_one_memory_snapshot_of_a_sandbox_at_a_time(gvisor: LocalProvider) -> None:
    info = await gvisor.create(SPEC)
    await (await ready(info)).aclose()
    results = await _gather(
        gvisor.snapshot(info.id, memory=True), gvisor.snapshot(info.id, memory=True)
    )
    kept = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(kept) == 1 and len(refused) == 1, results
    assert isinstance(refused[0], errors.ProviderError) and "already" in str(refused[0])
    assert [s.id for s in await gvisor.snapshots()] == [kept[0].id]
    daemon = await ready(info)
    try:
        assert (await daemon.exec("true")).exit_code == 0
    finally:
        await daemon.aclose()


async def _gather(*calls: Awaitable[SnapshotInfo]) -> list[SnapshotInfo | BaseException]:
    results: list[SnapshotInfo | BaseException] = []

    async def one(call: Awaitable[SnapshotInfo]) -> None:
        try:
            results.append(await call)
        except errors.SandboxError as exc:
            results.append(exc)

    async with anyio.create_task_group() as group:
        for call in calls:
            group.start_soon(one, call)
    return results


async def test_a_pause_with_memory_frees_it_and_resume_brings_every_process_back(
    gvisor: LocalProvider,
) -> None:
    info = await gvisor.create(SPEC)
    daemon = await ready(info)
    try:
        await daemon.spawn(["sh", "-c", COUNTER])
        word, before = await counted_past(daemon, 2)
    finally:
        await daemon.aclose()
    parent = gvisor.config.cgroup_parent.strip("/")
    memory_cgroup = Path("/sys/fs/cgroup/memory") / parent / info.id
    assert memory_cgroup.is_dir()

    await gvisor.pause(info.id, memory=True)
    # Nothing runs and nothing is held: no container, no cgroup; still listed, held.
    assert not memory_cgroup.exists()
    (listed,) = await gvisor.list()
    assert listed.id == info.id and listed.state == "running"
    with pytest.raises(errors.SandboxPaused):
        await gvisor.pause(info.id, memory=True)
    with pytest.raises(errors.SandboxPaused):
        await gvisor.snapshot(info.id)

    resumed = await gvisor.resume(info.id)
    assert (
        resumed.endpoint is not None and resumed.endpoint.token == info.endpoint.token
        if info.endpoint
        else False
    )
    daemon = await ready(resumed)
    try:
        again, after = await count(daemon)
        assert again == word and after >= before  # the same shell, its memory back
        await counted_past(daemon, after)  # and it goes on counting
    finally:
        await daemon.aclose()
    assert not (gvisor.config.state_dir / "sandboxes" / info.id / "paused-memory").exists()
