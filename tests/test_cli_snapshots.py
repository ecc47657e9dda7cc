"""``sandman snapshot save|ls|rm``, ``fork``, ``restore``, ``pause``, ``resume`` on this machine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from sandman.cli import build
from sandman.pool.snapshots import expires_at
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.fresh import fresh_local_provider

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


def cli(*args: str, env: dict[str, str]) -> Awaitable[Result]:
    return asyncio.to_thread(CliRunner().invoke, build(), list(args), env=env)


async def test_a_prepared_sandbox_is_saved_forked_restored_paused(busybox_tar: Path) -> None:
    async with fresh_local_provider(busybox_tar) as provider:
        env = {"SANDMAN_CGROUP_PARENT": provider.config.cgroup_parent}
        root = ["--state-dir", str(provider.config.state_dir)]

        async def ok(*args: str) -> str:
            result = await cli(*root, *args, env=env)
            assert result.exit_code == 0, result.output
            return result.stdout

        sandbox_id = (await ok("create", "busybox", "--memory", "64Mi")).strip()
        await ok("exec", sandbox_id, "--", "sh", "-c", "echo prepared > /root/state")
        assert (
            await ok("snapshot", "ls")
        ) == "no snapshots (`sandman snapshot save ID` makes one)\n"
        snapshot_id = (await ok("snapshot", "save", sandbox_id, "--ttl", "2h")).strip()
        (listed,) = await provider.snapshots()
        assert listed.id == snapshot_id and expires_at(listed) > 0
        rows = (await ok("snapshot", "ls")).splitlines()
        assert rows[0].split()[:3] == ["ID", "IMAGE", "SIZE"]
        assert rows[1].split()[:2] == [snapshot_id, "busybox"]

        forks = (await ok("fork", snapshot_id, "-n", "2")).split()
        assert len(forks) == 2
        for fork in forks:
            assert await ok("exec", fork, "--", "cat", "/root/state") == "prepared\n"
        # From a sandbox directly: the snapshot between is not kept.
        (direct,) = (await ok("fork", sandbox_id)).split()
        assert [s.id for s in await provider.snapshots()] == [snapshot_id]

        await ok("exec", sandbox_id, "--", "sh", "-c", "echo changed > /root/state")
        assert (
            await ok("restore", sandbox_id, snapshot_id)
            == f"restored {sandbox_id} to {snapshot_id}\n"
        )
        assert await ok("exec", sandbox_id, "--", "cat", "/root/state") == "prepared\n"
        assert await ok("pause", sandbox_id) == f"paused {sandbox_id}\n"
        assert await ok("resume", sandbox_id) == f"resumed {sandbox_id}\n"
        assert await ok("exec", sandbox_id, "--", "echo", "awake") == "awake\n"

        missing = await cli(*root, "restore", sandbox_id, "sn-nosuchthing", env=env)
        assert missing.exit_code == 1 and "no snapshot sn-nosuchthing" in missing.output
        assert "Traceback" not in missing.output
        assert await ok("snapshot", "rm", snapshot_id) == f"deleted {snapshot_id}\n"
        assert await ok("snapshot", "rm", snapshot_id) == f"{snapshot_id} was already gone\n"
        assert (
            await ok("snapshot", "save", sandbox_id, "--as-image", "task:ready")
        ) == "task:ready\n"
        made = (await ok("create", "task:ready")).strip()
        assert await ok("exec", made, "--", "cat", "/root/state") == "prepared\n"
        assert await provider.snapshots() == []
        await ok("rm", sandbox_id, direct, made, *forks)
