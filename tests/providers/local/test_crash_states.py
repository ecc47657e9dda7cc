"""What a create or a delete killed half-way leaves on disk, and who reaps it.

Each test builds the state a SIGKILL would leave at one point (a staging
directory with or without its record, a sandbox directory without a record
beside its container's remains, an empty one), then lets `sandman gc` or a live
pool's reconcile pass at it, and checks that nothing at all is left.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from sandman import errors
from sandman.cli import build
from sandman.client import watchdog
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, owner
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.leaks import leftovers

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

SPEC = SandboxSpec(image="busybox")


async def gc(provider: LocalProvider, *args: str) -> list[str]:
    """``sandman gc`` on the provider's state directory; its output lines."""
    runner = CliRunner()
    argv = ["--state-dir", str(provider.config.state_dir), "gc", *args]
    env = {"SANDMAN_CGROUP_PARENT": provider.config.cgroup_parent}
    result = await anyio.to_thread.run_sync(lambda: runner.invoke(build(), argv, env=env))
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def dead_owner() -> str:
    process = subprocess.Popen(["sleep", "600"])
    value = owner.of_process(process.pid)
    process.kill()
    process.wait()
    return value


async def test_a_create_killed_before_its_record_was_whole(provider: LocalProvider) -> None:
    """Killed between the staging directory and its rename: `list` never sees it. gc
    removes one with its record written at once if its maker's lock is gone (the create
    died), else once past the grace; never a create still in flight (the lock held)."""
    sandboxes = provider.config.state_dir.resolve() / "sandboxes"
    sandboxes.mkdir(parents=True, exist_ok=True)
    empty = sandboxes / ".new-sb-000000000001.1a2b3c4d"
    in_flight = sandboxes / ".new-sb-000000000002.5e6f7a8b"
    died = sandboxes / ".new-sb-000000000003.9c0d1e2f"
    for path in (empty, in_flight, died):
        path.mkdir(mode=0o700)
    for path in (in_flight, died):
        (path / "meta.json").write_text(f'{{"id": "{path.name[5:20]}", "labels": {{}}}}')
    lock = os.open(in_flight, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as `_make_record` holds it
        assert await provider.list() == []
        # Young: the empty one may be a create in flight, the locked one is.
        assert (await gc(provider))[:-1] == [
            f"reaped {died.name}: a create killed before its record was whole"
        ]
        assert empty.exists() and in_flight.exists() and not died.exists()
        age(empty, 120)
        assert (await gc(provider))[0] == (
            f"reaped {empty.name}: a create killed before its record was whole"
        )
        assert in_flight.exists()
    finally:
        os.close(lock)  # its maker dies
    assert (await gc(provider))[0] == (
        f"reaped {in_flight.name}: a create killed before its record was whole"
    )
    assert leftovers(provider) == []


@pytest.mark.parametrize("reaper", ["gc", "a live pool"])
async def test_a_delete_killed_after_the_record_went(provider: LocalProvider, reaper: str) -> None:
    """What shutil.rmtree left when killed after it happened to take meta.json first:
    the rest of the files, invisible by label, beside the disk layer."""
    info = await provider.create(SPEC, labels={"sandman.io/pool": "p"})
    directory = provider.config.state_dir.resolve() / "sandboxes" / info.id
    await provider._runtime.delete(info.id)  # the delete got that far
    (directory / "meta.json").unlink()
    [stray] = await provider.list()
    assert stray.id == info.id and stray.labels == {} and stray.state == "unknown"
    assert await provider.list(labels={"sandman.io/pool": "p"}) == []
    if reaper == "gc":
        assert await gc(provider) == ["reaped 0 sandbox(es)"]  # within the grace
        age(directory, 120)
        assert (await gc(provider))[0] == f"reaped {info.id}: no record"
    else:
        config = PoolConfig(name="another", stray_grace=0.0)
        async with Pool(provider, config) as pool:
            with anyio.fail_after(20):
                while await provider.list() or pool.list():
                    await anyio.sleep(0.02)
    assert leftovers(provider) == []


class Killed(BaseException):
    """The delete's process dies here."""


async def test_a_delete_killed_as_its_directory_goes_leaves_no_unlabelled_sandbox(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed as the last step removes the sandbox's own directory, the delete must not
    leave it under the sandbox's name without its record: `list` shows that unlabelled,
    and no sweep by label (a dead pool's watchdog) removes it. What it leaves goes with
    `remove_strays` at once (a client SIGKILLed mid-delete in a chaos run left one)."""
    info = await provider.create(SPEC, labels={"sandman.io/pool": "p"})
    rmdir = os.rmdir

    def dying_rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if info.id in os.path.basename(os.fsdecode(path)):
            raise Killed
        rmdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rmdir", dying_rmdir)
    with pytest.raises(Killed):
        await provider.delete(info.id)
    monkeypatch.setattr(os, "rmdir", rmdir)
    assert await provider.list() == []
    [trash] = await provider.remove_strays(older_than=3600)  # at once: not a create's
    assert info.id in trash
    assert leftovers(provider) == []


async def test_a_delete_that_fails_under_its_trash_name_is_finished_by_the_next(
    provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state directory went read-only after the sandbox's directory took its trash
    name: the delete fails, and the pool's retry (which finds no sandbox of that name
    any more) must still remove the trash. A live pool never sweeps for trash, so
    before this a chaos run left it until the next gc."""
    info = await provider.create(SPEC, labels={"sandman.io/pool": "p"})
    rmdir = os.rmdir

    def read_only_rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.path.basename(os.fsdecode(path)).startswith(f".old-{info.id}."):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        rmdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rmdir", read_only_rmdir)
    with pytest.raises(errors.ProviderError, match="Read-only file system"):
        await provider.delete(info.id)
    monkeypatch.setattr(os, "rmdir", rmdir)
    sandboxes = provider.config.state_dir.resolve() / "sandboxes"
    assert [p.name for p in sandboxes.glob(f".old-{info.id}.*")]  # the failure's trash
    await provider.delete(info.id)
    assert leftovers(provider) == []


async def test_a_dead_pools_watchdog_removes_what_its_killed_deletes_left(
    provider: LocalProvider,
) -> None:
    """The pool died mid-delete or mid-create: its watchdog's sweep also takes the trash
    and the staging directories whose maker is gone, at once, and spares a young empty
    one (maybe another pool's create in flight)."""
    sandboxes = provider.config.state_dir.resolve() / "sandboxes"
    sandboxes.mkdir(parents=True, exist_ok=True)
    trash = sandboxes / ".old-sb-000000000003.1a2b3c4d"
    in_flight = sandboxes / ".new-sb-000000000004.5e6f7a8b"
    trash.mkdir(mode=0o700)
    (trash / "log").write_text("the rest of a sandbox\n")
    in_flight.mkdir(mode=0o700)
    died = sandboxes / ".new-sb-000000000005.9c0d1e2f"  # the dead pool's create, record written
    died.mkdir(mode=0o700)
    (died / "meta.json").write_text('{"id": "sb-000000000005", "labels": {}}')
    # A snapshot's delete killed after its rename (chaos: service killed mid-delete).
    snapshots = provider.snapshot_store.root
    snapshots.mkdir(parents=True, exist_ok=True)
    dropped = snapshots / ".old-sn-69dfffb26904.cf013cab"
    dropped.mkdir(mode=0o700)
    await watchdog._sweep_local(provider.config, {"sandman.io/pool": "dead"})
    assert not trash.exists() and not died.exists() and in_flight.exists()
    assert not dropped.exists()
    in_flight.rmdir()
    assert leftovers(provider) == []


async def test_a_delete_that_fails_half_way_keeps_the_record(provider: LocalProvider) -> None:
    """The record goes last: a delete stopped anywhere before leaves a sandbox that
    its pool's reconciler still finds by label, and a later delete finishes."""
    labels = {"sandman.io/pool": "p"}
    info = await provider.create(SPEC, labels=labels)
    rootfs = provider.config.state_dir.resolve() / "sandboxes" / info.id / "rootfs"
    # A mount on the (host-side, empty) mount point: its rmdir fails with EBUSY.
    await anyio.run_process(["mount", "-t", "tmpfs", "tmpfs", str(rootfs)])
    try:
        with pytest.raises(errors.ProviderError, match="Device or resource busy"):
            await provider.delete(info.id)
        [found] = await provider.list(labels=labels)
        assert found.id == info.id
    finally:
        await anyio.run_process(["umount", str(rootfs)])
    await provider.delete(info.id)
    assert leftovers(provider) == []


async def test_deletes_of_one_sandbox_at_once_leave_nothing(provider: LocalProvider) -> None:
    """A dead pool's watchdog, gc and a live pool's reconcile may all delete the same
    sandbox: none stops at what another removed first and returns with files left."""
    infos = [await provider.create(SPEC) for _ in range(3)]
    results = await asyncio.gather(
        *(provider.delete(info.id) for info in infos for _ in range(3)), return_exceptions=True
    )
    assert [r for r in results if r is not None] == []
    assert leftovers(provider) == []


async def test_gc_reaps_by_owner_lifetime_and_state_never_a_live_owners(
    provider: LocalProvider,
) -> None:
    me, dead = owner.current(), dead_owner()
    expired = f"{time.time() - 10:.0f}"
    fresh = f"{time.time() + 3600:.0f}"
    made = {
        name: (await provider.create(SPEC, labels=labels)).id
        for name, labels in {
            "dead owner": {"sandman.io/owner": dead, "sandman.io/expires-at": fresh},
            "expired, no owner": {"sandman.io/expires-at": expired},
            "live owner, expired": {"sandman.io/owner": me, "sandman.io/expires-at": expired},
            "live owner": {"sandman.io/owner": me, "sandman.io/expires-at": fresh},
            "no owner, running": {"sandman.io/expires-at": fresh},
        }.items()
    }
    out = await gc(provider)
    assert sorted(out[:-1]) == sorted(
        [
            f"reaped {made['dead owner']}: owner dead ({owner.describe(dead)})",
            f"reaped {made['expired, no owner']}: past its lifetime",
        ]
    )
    assert out[-1] == "reaped 2 sandbox(es) (owner dead: 1, past its lifetime: 1)"
    kept = {info.id for info in await provider.list()}
    assert kept == {made["live owner, expired"], made["live owner"], made["no owner, running"]}
    everything = await gc(provider, "--all")
    assert everything[-1] == "reaped 3 sandbox(es) (--all: 3)"
    assert leftovers(provider) == []
