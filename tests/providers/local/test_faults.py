"""Faults around a sandbox: a full disk, a read-only or full state directory, a daemon that
dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.base import Lost, LostReports, SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.providers.local.exits import classify
from sandman.settings import LocalConfig
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready
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


def _pid(info: SandboxInfo) -> int:
    assert info.endpoint is not None and info.endpoint.pid is not None
    return info.endpoint.pid


async def _next(reports: LostReports, timeout: float = 20.0) -> Lost:
    async with asyncio.timeout(timeout):
        return await anext(reports)


async def test_a_daemon_killed_from_the_host_is_reported_lost_at_once(
    provider: LocalProvider,
) -> None:
    reports = provider.lost()
    try:
        killed, deleted, calm = [await provider.create(SandboxSpec(image="busybox")) for _ in "abc"]
        for info in (killed, deleted, calm):
            provider.watch_lost(info)
        async with await ready(killed) as sb:
            await sb.spawn(["sleep", "1000"])
        await provider.delete(deleted.id)  # killed by us: no loss
        os.kill(_pid(killed), signal.SIGKILL)
        lost = await _next(reports)
        assert (lost.sandbox_id, lost.reason) == (killed.id, "killed")
        assert "SIGKILL" in lost.detail
        assert (await provider.inspect(killed.id)).state == "stopped"
        assert (await provider.inspect(calm.id)).state == "running"
    finally:
        await reports.aclose()


async def test_a_daemon_watched_past_descriptor_1023_is_reported_lost(
    provider: LocalProvider,
) -> None:
    # A pool holds a pidfd per sandbox: past ~1000 sandboxes every new one is watched
    # through a descriptor select() refuses (FD_SETSIZE); each went unwatched.
    info = await provider.create(SandboxSpec(image="busybox"))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("needs a limit of open files past 1200")  # the provider raised it
    filler = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]
    reports = provider.lost()
    try:
        provider.watch_lost(info)
        os.kill(_pid(info), signal.SIGKILL)
        lost = await _next(reports)
        assert (lost.sandbox_id, lost.reason) == (info.id, "killed")
    finally:
        await reports.aclose()
        for fd in filler:
            os.close(fd)


async def test_a_daemon_the_oom_killer_kills_is_lost_as_oom(
    state_dir: Path, busybox_tar: Path
) -> None:
    """The daemon makes the OOM killer prefer its commands (their oom_score_adj is 1000),
    so a memory hog dies, not the sandbox. Here the daemon is made as preferred as they
    are, from the host, and the memory is taken by a tmpfs file (in no process's RSS):
    the daemon, the largest process, is the OOM killer's choice. /dev/shm is a tmpfs
    only when asked (`LocalConfig.dev_tmpfs`): by default it is on the sandbox's disk."""
    async with provider_for(config_for(state_dir, dev_tmpfs=True), busybox_tar) as provider:
        reports = provider.lost()
        try:
            info = await provider.create(SandboxSpec(image="busybox", memory="32Mi"))
            provider.watch_lost(info)
            async with await ready(info) as sb:
                Path(f"/proc/{_pid(info)}/oom_score_adj").write_text("1000")
                await sb.spawn("head -c 60000000 /dev/zero > /dev/shm/fill")
                lost = await _next(reports)
            assert (lost.sandbox_id, lost.reason) == (info.id, "oom"), lost
            assert "OOM killer" in lost.detail
            # A later look finds the same (without the wait status: from the cgroup).
            stopped = await provider.inspect(info.id)
            assert stopped.lost is not None and stopped.lost.reason == "oom"
        finally:
            await reports.aclose()


def test_why_a_daemon_died_from_the_evidence_it_left() -> None:
    sigkill, sigterm = signal.SIGKILL, signal.SIGTERM
    exited = [0 << 8, 2 << 8]  # wait statuses of exit(0), exit(2)
    assert classify(sigkill, 0, "")[0] == "killed"
    assert classify(sigkill, 3, "")[0] == "oom"
    assert classify(sigterm, 3, "")[0] == "killed"  # a signal other than the OOM killer's
    stopped = "sandmand: listening on fd:3\nsandmand: got terminated, shutting down\n"
    assert classify(exited[0], 0, stopped)[0] == "killed"
    crash = "sandmand: listening on fd:3\npanic: runtime error: index out of range\n\ngoroutine 1"
    assert classify(exited[1], 0, crash) == (
        "daemon_exit",
        "the daemon exited with status 2: 'panic: runtime error: index out of range'",
    )
    go_oom = "fatal error: runtime: out of memory\n"
    assert classify(exited[1], 1, go_oom)[0] == "oom"
    # No wait status (reaped, an older kernel): the cgroup and the log still tell.
    assert classify(None, 2, "")[0] == "oom"
    assert classify(None, 0, crash)[0] == "daemon_exit"
    assert classify(None, 0, stopped)[0] == "killed"
    assert classify(None, 0, "sandmand: listening on fd:3\n") == (
        "killed", "the daemon is gone without a word (as after a SIGKILL)",
    )  # fmt: skip
