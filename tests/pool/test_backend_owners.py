"""Owners a provider keeps on its backend (`KeepsOwners`: Kubernetes' Leases), as the
pool uses them: its own record opened before its first sandbox and removed at close;
dead owners' sandboxes reaped, whatever their pool, then their record; a predecessor
judged before adoption. The records here are a table the test sets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.pool.owner import LABEL_OWNER
from sandman.providers.base import KeepsOwners
from sandman.testing import FakeProvider
from tests.support import OwnerRecords, eventually

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image="task")
ME = OwnerRecords.ME


Records = OwnerRecords


@pytest.fixture
async def records() -> AsyncIterator[Records]:
    provider = Records(FakeProvider(daemon=False, seed=5))
    yield provider
    await provider.aclose()


def labels_of(pool: str, who: str) -> dict[str, str]:
    return {"sandman.io/pool": pool, "sandman.io/session": "s-1", "sandman.io/expires-at": "1e12",
            LABEL_OWNER: who}  # fmt: skip


async def test_the_pool_names_its_record_and_removes_it_at_close(records: Records) -> None:
    assert isinstance(records, KeepsOwners)
    async with Pool(records, PoolConfig(name="t")) as pool:
        assert pool.owner == ME
        record = await pool.acquire(SPEC, session=pool.open_session())
        assert record.labels[LABEL_OWNER] == ME
    assert ME not in records.statuses


async def test_dead_owners_sandboxes_are_reaped_whatever_their_pool_then_their_record(
    records: Records,
) -> None:
    records.statuses |= {"k.dead": "dead", "k.alive": "alive", "k.unknown": "unknown"}
    made = {
        who: (await records.create(SPEC, labels=labels_of("other", who))).id
        for who in ("k.dead", "k.alive", "k.unknown")
    }
    async with Pool(records, PoolConfig(name="t", reconcile_interval=0.05, lease=1.0)):

        async def reaped() -> bool:
            return {i.id for i in await records.list()} == {made["k.alive"], made["k.unknown"]}

        await eventually(reaped, what="the dead owner's sandbox to go")
        await eventually(lambda: records.forgotten == ["k.dead"], what="its record to go")
        assert "k.alive" in records.statuses and "k.unknown" in records.statuses


async def test_with_reap_dead_owners_false_other_pools_are_left_alone(records: Records) -> None:
    records.statuses["k.dead"] = "dead"
    theirs = await records.create(SPEC, labels=labels_of("other", "k.dead"))
    async with Pool(records, PoolConfig(name="t", reap_dead_owners=False)) as pool:
        await pool.reconcile()
        assert [i.id for i in await records.list()] == [theirs.id]
        assert records.forgotten == []


async def test_adoption_waits_until_a_predecessor_is_judged_dead(records: Records) -> None:
    """Killed a moment ago, its record still reads alive: adopted once it reads dead."""
    records.statuses["k.old"], records.versions["k.old"] = "alive", "7"
    left = await records.create(SPEC, labels=labels_of("t", "k.old"))
    pool = Pool(records, PoolConfig(name="t", adopt_orphans=True))
    starting = asyncio.ensure_future(pool.start())
    try:
        await asyncio.sleep(0.2)  # a moment of the wait: nothing to wait on but it
        assert not starting.done()
        records.statuses["k.old"] = "dead"
        await asyncio.wait_for(starting, 5)
        assert pool.get(left.id).state == "leased"
        assert (await records.inspect(left.id)).labels[LABEL_OWNER] == ME
    finally:
        await pool.aclose()


async def test_a_renewing_owner_of_the_same_pool_name_is_left_alone(records: Records) -> None:
    records.statuses["k.twin"], records.versions["k.twin"] = "alive", "1"
    theirs = await records.create(SPEC, labels=labels_of("t", "k.twin"))

    async def renew() -> None:
        for version in range(2, 100):
            await asyncio.sleep(0.1)
            records.versions["k.twin"] = str(version)

    renewing = asyncio.ensure_future(renew())
    try:
        async with Pool(records, PoolConfig(name="t", adopt_orphans=True)) as pool:
            assert theirs.id not in {r.id for r in pool.list()}
            assert (await records.inspect(theirs.id)).labels[LABEL_OWNER] == "k.twin"
    finally:
        renewing.cancel()


async def test_what_a_predecessor_leaves_while_this_pool_runs_is_adopted_not_deleted(
    records: Records,
) -> None:
    """Two replicas of the service overlap (an eviction starts the next before the last
    has gone): the new one starts while the old one still renews, so it leaves the old
    one's sandboxes alone; then the old one leaves them (``--on-shutdown leave``) and
    its record goes. The next periodic pass adopts them for their session; before, it
    deleted them as orphans. A twin that still renews keeps its own."""
    records.statuses["k.old"], records.versions["k.old"] = "alive", "1"
    records.statuses["k.twin"], records.versions["k.twin"] = "alive", "1"
    left = await records.create(SPEC, labels=labels_of("t", "k.old"))
    twins = await records.create(SPEC, labels=labels_of("t", "k.twin"))
    config = PoolConfig(name="t", adopt_orphans=True, reconcile_interval=0.05, lease=1.0)
    pool = Pool(records, config)
    renewing = True

    async def renew() -> None:  # both renew while this pool starts and judges them
        version = 1
        while renewing:
            await asyncio.sleep(0.05)
            version += 1
            records.versions["k.twin"] = records.versions["k.old"] = str(version)

    renewer = asyncio.ensure_future(renew())
    try:
        await pool.start()
        assert {r.id for r in pool.list()} == set()
        renewing = False
        await renewer
        del records.statuses["k.old"]  # left, record removed: dead by its absence
        records.versions["k.twin"] = "renewed"
        await eventually(lambda: left.id in {r.id for r in pool.list()}, what="the adoption")
        assert pool.get(left.id).state == "leased" and pool.get(left.id).session == "s-1"
        assert (await records.inspect(left.id)).labels[LABEL_OWNER] == ME
        for _ in range(2):  # passes as the periodic ones: the live twin's stays its own
            await pool.reconcile(adopt=True, judge=False)
        assert twins.id not in {r.id for r in pool.list()}
        assert {i.id for i in await records.list()} == {left.id, twins.id}
    finally:
        renewer.cancel()
        await pool.aclose()
