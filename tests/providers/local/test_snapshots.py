"""Snapshots of local sandboxes: kept files, sandboxes made from them, restore, pause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

DISKS = [pytest.param("64Mi", id="btrfs"), pytest.param(None, id="no-disk")]


@pytest.fixture(params=DISKS)
async def provider(
    request: pytest.FixtureRequest, state_dir: Path, busybox_tar: Path
) -> AsyncIterator[LocalProvider]:
    async with provider_for(config_for(state_dir, disk=request.param), busybox_tar) as made:
        yield made


async def sh(provider: LocalProvider, sandbox_id: str, script: str) -> str:
    info = await provider.inspect(sandbox_id)
    daemon = await ready(info)
    try:
        result = await daemon.exec(["sh", "-c", script], timeout=20)
    finally:
        await daemon.aclose()
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def test_a_fork_has_the_files_of_its_snapshot_and_nothing_after(
    provider: LocalProvider,
) -> None:
    parent = await provider.create(SandboxSpec(image="busybox"))
    # A written file, a file of the image removed (a whiteout), a renamed directory.
    await sh(provider, parent.id, "echo prepared > /root/state; rm /etc/passwd; mkdir -p /w/a")
    snapshot = await provider.snapshot(parent.id, labels={"who": "test"})
    assert snapshot.image == "busybox" and snapshot.source == parent.id
    assert snapshot.labels == {"who": "test"}
    assert snapshot.spec is not None and snapshot.spec.image == "busybox"
    await sh(provider, parent.id, "echo later > /root/state; touch /root/after")

    fork = await provider.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
    seen = await sh(
        provider, fork.id, "cat /root/state; ls /root; test -e /etc/passwd || echo no-passwd"
    )
    assert seen.split() == ["prepared", "state", "no-passwd"]
    # Independent both ways: the fork's writes reach neither the parent nor a second fork.
    await sh(provider, fork.id, "echo fork > /root/state")
    assert (await sh(provider, parent.id, "cat /root/state")).strip() == "later"
    second = await provider.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
    assert (await sh(provider, second.id, "cat /root/state")).strip() == "prepared"

    # Deleting the snapshot takes nothing from the sandboxes made of it.
    await provider.delete_snapshot(snapshot.id)
    assert await provider.snapshots() == []
    assert (await sh(provider, second.id, "cat /root/state")).strip() == "prepared"
    with pytest.raises(errors.SnapshotNotFound):
        await provider.create(SandboxSpec(image="busybox", snapshot=snapshot.id))
    await provider.delete_snapshot(snapshot.id)  # idempotent


async def test_restore_resets_files_and_processes_in_place(provider: LocalProvider) -> None:
    info = await provider.create(SandboxSpec(image="busybox"))
    await sh(provider, info.id, "echo one > /root/state")
    snapshot = await provider.snapshot(info.id)
    await sh(provider, info.id, "echo two > /root/state; touch /root/extra")
    daemon = await ready(info)
    try:
        await daemon.spawn(["sleep", "1000"])
    finally:
        await daemon.aclose()

    restored = await provider.restore(info.id, snapshot.id)
    assert restored.id == info.id and restored.endpoint is not None
    assert restored.endpoint.token == info.endpoint.token if info.endpoint else False
    assert (await sh(provider, info.id, "cat /root/state; ls /root")).split() == ["one", "state"]
    assert "sleep" not in await sh(provider, info.id, "ps")


async def test_pause_stops_all_cpu_until_resume(provider: LocalProvider) -> None:
    info = await provider.create(SandboxSpec(image="busybox"))
    await sh(provider, info.id, "(while :; do :; done) >/dev/null 2>&1 &")
    cpuacct = next(Path("/sys/fs/cgroup/cpuacct").glob(f"**/{info.id}/cpuacct.usage"))

    await provider.pause(info.id)
    assert (await provider.inspect(info.id)).state == "running"  # held, not gone
    used = int(cpuacct.read_text())
    await asyncio.sleep(0.3)
    # A spinning loop that ran would have used ~300 ms; frozen, at most the accounting's
    # crumbs (a few µs were seen).
    assert int(cpuacct.read_text()) - used < 1_000_000, "a paused sandbox used CPU"

    await provider.resume(info.id)
    await eventually(lambda: int(cpuacct.read_text()) != used, what="the resumed sandbox to run")


async def test_what_cannot_be_kept_says_why(provider: LocalProvider) -> None:
    info = await provider.create(SandboxSpec(image="busybox"))
    with pytest.raises(errors.ConfigError, match="memory"):
        await provider.snapshot(info.id, memory=True)
    with pytest.raises(errors.SnapshotNotFound):
        await provider.restore(info.id, "sn-nosuchthing")
    with pytest.raises(errors.SnapshotNotFound):
        await provider.restore(info.id, "../../etc")
    snapshot = await provider.snapshot(info.id)
    with pytest.raises(errors.ConfigError, match="image"):
        await provider.create(SandboxSpec(image="other", snapshot=snapshot.id))
    # Its daemon killed: nothing running to keep.
    await provider._runtime.delete(info.id)
    with pytest.raises(errors.SandboxLost, match="nothing to keep"):
        await provider.snapshot(info.id)
    assert [s.id for s in await provider.snapshots()] == [snapshot.id]


async def test_a_snapshot_becomes_an_image_later_creates_name(provider: LocalProvider) -> None:
    info = await provider.create(SandboxSpec(image="busybox"))
    await sh(provider, info.id, "echo prepared > /root/state; rm /etc/passwd; ln -s /etc /root/l")
    snapshot = await provider.snapshot(info.id)
    image = await provider.save_image(snapshot.id, "prepared:v1")
    assert image.names == ["prepared:v1"]
    # Nothing the runtime made in the sandbox's /dev (its layer's) goes into the image.
    assert list((image.rootfs / "dev").iterdir()) == []
    base = await provider.images.get("busybox")
    assert image.config == base.config  # env, working directory, user, command kept
    await provider.delete_snapshot(snapshot.id)
    made = await provider.create(SandboxSpec(image="prepared:v1"))
    seen = await sh(
        provider, made.id, "cat /root/state; readlink /root/l; test -e /etc/passwd || echo gone"
    )
    assert seen.split() == ["prepared", "/etc", "gone"]
    await provider.delete(made.id)
    await provider.images.remove("prepared:v1")


async def test_an_image_a_sandbox_or_snapshot_is_made_of_is_not_removed(
    provider: LocalProvider,
) -> None:
    await provider.images.tag("busybox", "doomed")
    info = await provider.create(SandboxSpec(image="doomed"))
    image = await provider.images.get("doomed")
    with pytest.raises(errors.ImageError, match="in use"):
        await provider.images.remove(image.id)
    snapshot = await provider.snapshot(info.id)
    await provider.delete(info.id)
    with pytest.raises(errors.ImageError, match="in use"):
        await provider.images.remove(image.id)  # the snapshot still needs it
    await provider.delete_snapshot(snapshot.id)
    await provider.images.remove("doomed")  # a name only: busybox stays
    assert [i.names for i in await provider.images.list()] == [["busybox:latest"]]
