"""Sandboxes that die under their holder: lost with a reason, deleted, told, counted."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

import sandman
from sandman.pool import Pool, PoolConfig, PoolEvent, Record
from sandman.providers.base import WatchesLost
from sandman.testing import FakeProvider
from tests.pool.test_pool import SPEC
from tests.support import Delegating, eventually

pytestmark = pytest.mark.anyio


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=7)
    yield provider
    await provider.aclose()


class Blind(Delegating):
    """A provider that cannot tell of losses (no `WatchesLost`): the fake, seen through
    the base `Provider` protocol only, as gVisor sandboxes are."""

    name = "blind"


async def test_a_sandbox_that_dies_is_lost_deleted_and_its_holder_told_why(
    fake: FakeProvider,
) -> None:
    assert isinstance(fake, WatchesLost)
    events: list[PoolEvent] = []
    async with Pool(fake, PoolConfig(name="t"), hook=events.append) as pool:
        session = pool.open_session()
        record = await pool.acquire(SPEC, session=session)
        other = await pool.acquire(SPEC, session=session)
        fake.lose(record.id, reason="oom", detail="fake: out of memory")
        # Told at once (no reconcile pass: the default interval is 15 s).
        await eventually(lambda: record.state == "lost", timeout=2)
        assert record.lost is not None and record.lost.reason == "oom"
        assert "lost" in record.timeline
        lost = [e for e in events if e.name == "sandbox.lost"]
        assert [(e.sandbox_id, e.session, e.detail["reason"]) for e in lost] == [
            (record.id, session, "oom")
        ]
        # Its resources are freed; the record stays to tell the holder.
        await eventually(lambda: fake.live == 1)
        assert "gone" in record.timeline and pool.get(record.id).state == "lost"
        with pytest.raises(sandman.SandboxLost, match="out of memory") as told:
            await pool.check(record.id)
        assert told.value.reason == "oom" and isinstance(told.value, sandman.SandboxNotFound)
        assert (await pool.check(other.id)).state == "leased"  # the others live on
        assert [r.id for r in pool.list(session=session) if r.state == "leased"] == [other.id]
        # The holder gives it back: forgotten, nothing more to delete.
        pool.release(record.id)
        with pytest.raises(sandman.SandboxNotFound) as forgotten:
            await pool.check(record.id)
        assert not isinstance(forgotten.value, sandman.SandboxLost)
        assert fake.calls.count(("delete", record.id)) == 1
        pool.close_session(session)
        await eventually(lambda: fake.live == 0)


def _daemon_pid(record: Record) -> int:
    assert record.info is not None and record.info.endpoint is not None
    assert record.info.endpoint.pid is not None
    return record.info.endpoint.pid


async def test_a_daemon_that_ends_by_itself_is_lost_as_killed_or_exited() -> None:
    async with FakeProvider(seed=1) as fake, Pool(fake, PoolConfig(name="t")) as pool:
        session = pool.open_session()
        killed = await pool.acquire(SPEC, session=session)
        exited = await pool.acquire(SPEC, session=session)
        os.kill(_daemon_pid(killed), signal.SIGKILL)
        os.kill(_daemon_pid(exited), signal.SIGTERM)  # it shuts down and exits 0
        await eventually(lambda: killed.state == exited.state == "lost")
        assert killed.lost is not None and killed.lost.reason == "killed"
        assert exited.lost is not None and exited.lost.reason == "daemon_exit"
        await eventually(lambda: fake.live == 0)


async def test_without_provider_reports_reconcile_and_the_holders_call_find_it(
    fake: FakeProvider,
) -> None:
    blind = Blind(fake)
    assert not isinstance(blind, WatchesLost)
    events: list[PoolEvent] = []
    async with Pool(blind, PoolConfig(name="t"), hook=events.append) as pool:
        session = pool.open_session()
        stopped, deleted, asked = [await pool.acquire(SPEC, session=session) for _ in "abc"]
        fake.lose(stopped.id, reason="evicted")
        await fake.delete(deleted.id)  # behind the pool's back
        fake.lose(asked.id)
        # The holder's next call finds it before any reconcile pass.
        with pytest.raises(sandman.SandboxLost) as told:
            await pool.check(asked.id)
        assert told.value.reason == "killed" and asked.state == "lost"
        assert stopped.state == deleted.state == "leased"  # nobody asked yet
        await pool.reconcile()
        assert stopped.lost is not None and stopped.lost.reason == "evicted"
        assert deleted.lost is not None and deleted.lost.reason == "deleted"
        await eventually(lambda: fake.live == 0)
        reasons = sorted(str(e.detail["reason"]) for e in events if e.name == "sandbox.lost")
        assert reasons == ["deleted", "evicted", "killed"]


async def test_only_the_last_few_lost_are_remembered(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t", remember_lost=2)) as pool:
        session = pool.open_session()
        records = [await pool.acquire(SPEC, session=session) for _ in range(3)]
        for record in records:
            fake.lose(record.id)
        await eventually(lambda: fake.live == 0)
        await eventually(lambda: all("gone" in r.timeline for r in records))
        with pytest.raises(sandman.SandboxNotFound) as first:
            pool.get(records[0].id)
        assert not isinstance(first.value, sandman.SandboxLost)
        for record in records[1:]:
            with pytest.raises(sandman.SandboxLost):
                await pool.check(record.id)


async def test_a_lost_warm_spare_is_replaced(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t")) as pool:
        pool.warm(SPEC, 1)
        await eventually(lambda: len([r for r in pool.list() if r.state == "ready"]) == 1)
        (spare,) = [r for r in pool.list() if r.state == "ready"]
        fake.lose(spare.id)
        await eventually(lambda: spare.state == "lost")
        await eventually(
            lambda: [r.id for r in pool.list() if r.state == "ready"] not in ([], [spare.id])
        )
        session = pool.open_session()
        served = await asyncio.wait_for(pool.acquire(SPEC, session=session), 5)
        assert served.id != spare.id
        with pytest.raises(sandman.SandboxNotFound):
            pool.get(spare.id)  # no holder to tell: not remembered
