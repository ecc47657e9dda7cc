"""Snapshots, forks, restore and pause through the SDK: embedded, and over the service."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import sandman
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.server import ApiKey, ServerSettings, TenantLimits, create_app
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import KEY_A, KEY_B, serve_in_thread

pytestmark = [pytest.mark.anyio, needs_root_and_crun]


async def text(sb: sandman.AsyncSandbox, script: str) -> str:
    result = await sb.exec(["sh", "-c", script], timeout=20)
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


async def test_fork_restore_pause_embedded(local_state: Path, imported: LocalProvider) -> None:
    async with sandman.local(state_dir=local_state) as client:
        async with client.sandbox("busybox") as sb:
            await text(sb, "echo prepared > /root/state")
            forks = await sb.fork(3)
            assert len({f.id for f in forks} | {sb.id}) == 4
            for i, fork in enumerate(forks):
                assert await text(fork, "cat /root/state") == "prepared"
                await text(fork, f"echo {i} > /root/state")
            assert [await text(f, "cat /root/state") for f in forks] == ["0", "1", "2"]
            assert await text(sb, "cat /root/state") == "prepared"
            assert await client.snapshots() == []  # the fork's snapshot is gone once they are

            snap = await sb.snapshot(ttl=600)
            assert snap.image == "busybox" and snap.source == sb.id and not snap.memory
            await text(sb, "echo changed > /root/state")
            await sb.restore(snap)
            assert await text(sb, "cat /root/state") == "prepared"  # same sandbox, reset
            async with client.sandbox(snapshot=snap.id) as again:
                assert await text(again, "cat /root/state") == "prepared"

            await sb.pause()
            with pytest.raises(sandman.SandboxPaused):
                await sb.exec(["true"])
            await sb.resume()
            assert await text(sb, "echo awake") == "awake"

            with pytest.raises(sandman.ConfigError, match="memory"):
                await sb.snapshot(memory=True)
            with pytest.raises(sandman.SnapshotNotFound):
                await client.acquire(snapshot="sn-nosuchthing")
            for fork in forks:
                await fork.release()
        assert [s.id for s in await client.snapshots()] == [snap.id]
    # The pool closed: its snapshots went with it.
    assert await imported.snapshots() == []


@contextlib.asynccontextmanager
async def local_service(
    provider: LocalProvider, limits: dict[str, TenantLimits]
) -> AsyncIterator[str]:
    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[object, None]]:
        pool = Pool(provider, PoolConfig(name="snapshots"))
        settings = ServerSettings(
            api_keys=[ApiKey(tenant="a", key=KEY_A), ApiKey(tenant="b", key=KEY_B)],
            tenant_limits=limits,
            close_pool=True,
        )
        yield create_app(pool, settings), None

    with serve_in_thread(setup) as (url, _, _loop):  # type: ignore[arg-type]
        yield url


async def test_snapshots_over_the_service_are_the_tenants(
    local_state: Path, imported: LocalProvider
) -> None:
    limits = {"a": TenantLimits(max_snapshots=1)}
    async with (
        local_service(imported, limits) as url,
        sandman.connect(url, api_key=KEY_A) as a,
        sandman.connect(url, api_key=KEY_B) as b,
        a.sandbox("busybox") as sb,
    ):
        await text(sb, "echo prepared > /root/state")
        (fork,) = await sb.fork(1)
        assert await text(fork, "cat /root/state") == "prepared"
        snap = await sb.snapshot()
        with pytest.raises(sandman.CapacityError, match="limit"):
            await sb.snapshot()  # a's limit is one
        # Another tenant's snapshot is not even confirmed to exist.
        with pytest.raises(sandman.SnapshotNotFound):
            await b.acquire("busybox", snapshot=snap.id)
        await b.delete_snapshot(snap.id)  # not b's: nothing to delete for b
        assert await b.snapshots() == []
        assert [s.id for s in await a.snapshots()] == [snap.id]
        await text(sb, "echo changed > /root/state")
        await sb.restore(snap)
        assert await text(sb, "cat /root/state") == "prepared"
        await sb.pause()
        with pytest.raises(sandman.SandboxPaused):
            await sb.exec(["true"])
        await sb.resume()
        assert [s.id for s in await a.snapshots()] == [snap.id]
        async with httpx.AsyncClient(base_url=url) as http:
            board = await http.get("/v1/dashboard", headers={"Authorization": f"Bearer {KEY_A}"})
            metrics = (await http.get("/metrics")).text
        assert board.json()["snapshots"] == 1
        assert 'sandman_snapshots{pool="snapshots"} 1.0' in metrics
        await a.delete_snapshot(snap)
        assert await a.snapshots() == []
        await fork.release()
    assert await imported.snapshots() == []
