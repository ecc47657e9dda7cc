"""Faults around a sandbox: a full disk, a read-only or full state directory."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.conftest import config_for, needs_root_and_crun
from tests.providers.local.leaks import assert_nothing_left

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 24 MiB filesystem to keep a whole state directory on."""
    path = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


async def test_full_disk_is_a_clear_error_and_the_sandbox_lives_on(
    small_disk: Path, busybox_tar: Path
) -> None:
    # No disk limit: this is about the state directory's own filesystem filling up.
    config = LocalConfig(
        state_dir=small_disk, cgroup_parent=f"/sandman-test/{uuid.uuid4().hex[:12]}", disk=None
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    info = await provider.create(SandboxSpec(image="busybox"))
    assert info.endpoint is not None
    try:
        async with info.endpoint.client() as sb:
            await sb.wait_ready(timeout=10)
            with pytest.raises(sandman.NoSpace) as full:
                await sb.write_file("/root/big", b"x" * (40 * 2**20))
            assert full.value.status == 507
            assert not await sb.exists("/root/big")  # atomic: no half-written file
            dd = await sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=64")
            assert dd.exit_code != 0 and "No space left" in dd.stderr
            await sb.remove("/root/fill")
            assert (
                await sb.exec("echo still fine > /root/ok && cat /root/ok")
            ).stdout == "still fine\n"
    finally:
        await provider.delete(info.id)
    await assert_nothing_left(provider)


def _run(*argv: str, check: bool = True) -> None:
    subprocess.run(argv, check=check, capture_output=True)


@pytest.mark.parametrize("fault", ["read-only", "full"])
async def test_a_broken_state_directory_is_a_provider_error_and_leaves_nothing(
    small_disk: Path, busybox_tar: Path, fault: str
) -> None:
    config = LocalConfig(
        state_dir=small_disk, cgroup_parent=f"/sandman-test/{uuid.uuid4().hex[:12]}", disk=None
    )
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_tar, name="busybox")
    (small_disk / "sandboxes").mkdir(exist_ok=True)
    filler = small_disk / "filler"
    if fault == "read-only":
        _run("mount", "-o", "remount,ro", str(small_disk))
        cause = "Read-only file system"
    else:
        _run("dd", "if=/dev/zero", f"of={filler}", "bs=1M", check=False)  # until it is full
        cause = "No space left on device"
    try:
        with pytest.raises(sandman.ProviderError, match=f"state directory failed at .*{cause}"):
            await provider.create(SandboxSpec(image="busybox"))
        assert list((small_disk / "sandboxes").iterdir()) == []
    finally:
        if fault == "read-only":
            _run("mount", "-o", "remount,rw", str(small_disk))
        filler.unlink(missing_ok=True)
    await provider.aclose()
    await assert_nothing_left(provider)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only (a read-only bind of it over itself) while the block runs."""
    _run("mount", "--bind", str(path), str(path))
    try:
        _run("mount", "-o", "remount,bind,ro", str(path))
        yield
    finally:
        _run("umount", "-l", str(path))


async def test_a_read_only_state_directory_fails_every_call_typed_and_then_recovers(
    state_dir: Path, busybox_tar: Path
) -> None:
    """Found by the chaos suite (embedded/state-ro): past ``create``, the network state,
    the disk filesystem's lock and the sandbox directory failed with bare OSErrors: the
    cleanup of a half-created sandbox replaced the create's error with one, and the
    pool's reconcile died of one."""
    provider = LocalProvider(config_for(state_dir))
    await provider.images.import_archive(busybox_tar, name="busybox")
    kept = await provider.create(SandboxSpec(image="busybox", network="isolated"))
    with read_only(state_dir / "network"):
        with pytest.raises(sandman.ProviderError, match="network.*Read-only file system"):
            await provider.create(SandboxSpec(image="busybox", network="isolated"))
        with pytest.raises(sandman.ProviderError, match="Read-only file system"):
            await provider.list()
    with read_only(state_dir):
        with pytest.raises(sandman.ProviderError, match="Read-only file system"):
            await provider.delete(kept.id)
        with pytest.raises(sandman.ProviderError, match="Read-only file system"):
            await provider.aclose()
    # Writable again: what the failed calls left goes with the next delete.
    for info in await provider.list():
        await provider.delete(info.id)
    await provider.aclose()
    await assert_nothing_left(provider)
