"""Per-sandbox disk limits: a sandbox that writes past its limit gets an error
from the filesystem, and the host's disk is untouched (providers/local/disk.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pydantic
import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.conftest import config_for, needs_root_and_crun
from tests.providers.local.leaks import assert_nothing_left, leftovers, loop_devices
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

LIMIT = 64 * 2**20


def _free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


async def _ready(info: SandboxInfo) -> sandman.DaemonClient:
    assert info.endpoint is not None
    client = info.endpoint.client()
    await client.wait_ready(timeout=10)
    return client


async def _no_qgroups_left(provider: LocalProvider) -> list[str]:
    # The kernel drops a destroyed subvolume's qgroup once its cleaner has run.
    deadline = time.monotonic() + 20
    while (left := provider.disk.qgroups()) and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    return left


async def _left_after_close(provider: LocalProvider) -> list[str]:
    # The loop device detaches (autoclear) asynchronously, after the unmount.
    deadline = time.monotonic() + 10
    while (left := leftovers(provider, closed=True)) and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    return left


async def test_writes_past_the_limit_fail_and_the_host_disk_is_untouched(
    provider: LocalProvider,
) -> None:
    state = provider.config.state_dir
    free_before = _free(state)
    info = await provider.create(SandboxSpec(image="busybox", disk="64Mi"))
    async with await _ready(info) as sb:
        dd = await sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=256")
        # A quota says EDQUOT ("Disk quota exceeded"), not ENOSPC: same meaning, both no_space.
        assert dd.exit_code != 0 and "Disk quota exceeded" in dd.stderr, dd
        head = await sb.exec("head -c 100000000 /dev/zero > /root/more")
        assert head.exit_code != 0 and "Disk quota exceeded" in head.stderr, head
        # Many empty files: metadata counts too.
        files = await sb.exec(
            "mkdir /root/d && cd /root/d && i=0; while touch $i; do i=$((i+1)); done"
        )
        assert "Disk quota exceeded" in files.stderr, files
        used, limit = provider.disk.usage(info.id) or (0, 0)
        assert limit == LIMIT and used <= LIMIT
        # What the host holds for all of it: the image's allocated blocks (data,
        # plus the filesystem's own trees), and the host's free space (noisy: others write too).
        os.sync()
        held = os.stat(provider.disk.image).st_blocks * 512
        assert held <= LIMIT + 32 * 2**20, held
        assert free_before - _free(state) <= 2 * LIMIT
        await sb.exec("rm -rf /root/fill /root/more /root/d")
        with pytest.raises(sandman.NoSpace) as full:
            await sb.write_file("/root/big", b"x" * (80 * 2**20))
        assert full.value.code == "no_space" and full.value.status == 507
        assert not await sb.exists("/root/big")
        # Below the limit all is well again.
        await sb.write_file("/root/ok", b"y" * 2**20)
        assert (await sb.exec("wc -c < /root/ok")).stdout.strip() == str(2**20)
    await provider.delete(info.id)
    assert leftovers(provider) == []
    assert await _no_qgroups_left(provider) == []
    await provider.aclose()
    assert await _left_after_close(provider) == []
    assert not provider.disk.mounted() and loop_devices(state / "disk.img") == []


async def test_the_default_limit_applies_and_a_default_sandbox_works(
    state_dir: Path, busybox_tar: Path
) -> None:
    config = LocalConfig(
        state_dir=state_dir, cgroup_parent=f"/sandman-test/disk-{uuid.uuid4().hex[:8]}", disk="32Mi"
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    small = await provider.create(SandboxSpec(image="busybox"))
    large = await provider.create(SandboxSpec(image="busybox", disk="1Gi"))
    try:
        async with await _ready(small) as sb:
            dd = await sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=64")
            assert dd.exit_code != 0 and "Disk quota exceeded" in dd.stderr
        async with await _ready(large) as sb:
            dd = await sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=64 && sync")
            assert dd.exit_code == 0, dd
        assert provider.disk.usage(large.id) is not None
    finally:
        await provider.delete(small.id)
        await provider.delete(large.id)
        await provider.aclose()
    await assert_nothing_left(provider)  # and its cgroup parent goes


async def test_the_builtin_default_is_ten_gib(provider: LocalProvider) -> None:
    assert LocalConfig().disk == 10 * 2**30
    info = await provider.create(SandboxSpec(image="busybox"))
    async with await _ready(info) as sb:
        assert (await sb.exec("echo hi > /root/f && cat /root/f")).stdout == "hi\n"
    assert provider.disk.usage(info.id) is not None
    assert (provider.disk.usage(info.id) or (0, 0))[1] == 10 * 2**30


async def test_no_limit_means_no_filesystem(state_dir: Path, busybox_tar: Path) -> None:
    config = LocalConfig(
        state_dir=state_dir,
        cgroup_parent=f"/sandman-test/disk-off-{uuid.uuid4().hex[:8]}",
        disk=None,
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    info = await provider.create(SandboxSpec(image="busybox"))
    try:
        async with await _ready(info) as sb:
            assert (await sb.exec("echo hi > /root/f && cat /root/f")).stdout == "hi\n"
        assert (state_dir / "sandboxes" / info.id / "upper" / "root" / "f").exists()
        assert not provider.disk.mounted() and not provider.disk.image.exists()
    finally:
        await provider.delete(info.id)
        await provider.aclose()
    await assert_nothing_left(provider)  # and its cgroup parent goes


async def test_a_layer_without_a_record_is_listed_and_deleted(provider: LocalProvider) -> None:
    # A provider killed after making the layer, with its record gone: the
    # reconciler must still find it (list) and remove it (delete).
    await anyio.to_thread.run_sync(provider.disk.create, "sb-orphan", LIMIT)
    assert "sb-orphan" in [info.id for info in await provider.list()]
    await provider.delete("sb-orphan")
    assert provider.disk.names() == []
    assert await provider.list() == []


async def test_a_layer_left_in_an_unmounted_filesystem_is_removed(
    provider: LocalProvider,
) -> None:
    # After a reboot: records on disk, the filesystem not mounted.
    info = await provider.create(SandboxSpec(image="busybox", disk="64Mi"))
    await provider._runtime.delete(info.id)
    await anyio.run_process(["umount", str(provider.disk.root)])  # as a reboot leaves it
    assert not provider.disk.mounted()
    await provider.delete(info.id)
    assert leftovers(provider) == []
    assert not provider.disk.mounted()


@pytest.fixture
def small_state_dir() -> Iterator[Path]:
    """A state directory on its own 320 MiB filesystem, to fill up."""
    path = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=320m,mode=0700", "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _fill(path: Path) -> None:
    """Write ``path`` until its filesystem has not a block left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for block in (b"\0" * 2**20, b"\0" * 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, block)
    finally:
        os.close(fd)


def _read_only(provider: LocalProvider) -> bool:
    return bool(os.statvfs(provider.disk.root).f_flag & os.ST_RDONLY)


async def test_a_full_state_directory_fails_typed_and_everything_recovers_once_freed(
    small_state_dir: Path, busybox_tar: Path
) -> None:
    """Found by the chaos suite (state-full): btrfs cannot write its sparse image into a
    full state directory, aborts and turns read-only for good; no create nor delete
    worked after, even once the space was back, and sandboxes leaked."""
    provider = LocalProvider(config_for(small_state_dir))
    await provider.images.import_archive(busybox_tar, name="busybox")
    kept = await provider.create(SandboxSpec(image="busybox"))
    dropped = await provider.create(SandboxSpec(image="busybox"))
    filler = small_state_dir / "filler"
    try:
        async with await _ready(kept) as sb:
            await anyio.to_thread.run_sync(_fill, filler)

            async def aborted() -> bool:
                # A sandbox writing (metadata, then a commit) while the host is full.
                await sb.exec("for i in $(seq 200); do echo x > /root/f$i; done; sync")
                return _read_only(provider)

            await eventually(aborted, 60, what="the disk filesystem aborts", interval=0.1)
        # Still full: a create fails, saying why; a delete completes, its layer discarded
        # with the filesystem; nothing is left half-made.
        with pytest.raises(sandman.ProviderError, match="No space left on device"):
            await provider.create(SandboxSpec(image="busybox"))
        await provider.delete(dropped.id)
        assert [info.id for info in await provider.list()] == [kept.id]
        with pytest.raises(
            sandman.ProviderError, match=f"{small_state_dir / 'disk.img'}.*No space left on device"
        ):
            await anyio.to_thread.run_sync(provider.disk.create, "sb-direct", LIMIT)
        assert provider.disk.names() == []
        filler.unlink()
        # Room again: creates work by themselves, while a sandbox of before still holds the
        # old filesystem; deletes complete.
        fresh = await provider.create(SandboxSpec(image="busybox"))
        async with await _ready(fresh) as sb:
            assert (await sb.exec("echo hi > /root/f && cat /root/f")).stdout == "hi\n"
        assert provider.disk.usage(fresh.id) is not None
        await provider.delete(kept.id)
        await provider.delete(fresh.id)
        assert await provider.list() == []
    finally:
        filler.unlink(missing_ok=True)
        for info in await provider.list():
            await provider.delete(info.id)
        await provider.aclose()
    await assert_nothing_left(provider)  # the aborted filesystem's loop device too


@pytest.mark.parametrize("value", ["lots", "1k", 1000, "-5Gi"])
def test_a_bad_value_is_refused(value: object) -> None:
    with pytest.raises(pydantic.ValidationError, match="disk"):
        SandboxSpec(image="busybox", disk=value)
    with pytest.raises(pydantic.ValidationError, match="disk"):
        LocalConfig(disk=value)
