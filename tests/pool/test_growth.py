"""What the pool keeps per spec and per key lasts only while it is in use (issue 30):
the waiters of a spec nobody waits on any more have no entry, and a `Tally` follows
every sandbox from its recorded intent to its release, failure, loss or adoption."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig, Record, Tally
from sandman.testing import FakeProvider
from tests.support import eventually

pytestmark = pytest.mark.anyio


def spec_of(team: str | None, task: int = 0) -> SandboxSpec:
    labels = {"task": f"t{task}"} | ({"team": team} if team else {})
    return SandboxSpec(image="task", labels=labels)


def team(record: Record) -> str | None:
    return record.spec.labels.get("team") or record.labels.get("team")


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=3)
    yield provider
    await provider.aclose()


def pool_of(provider: FakeProvider, **config: object) -> Pool:
    return Pool(provider, PoolConfig(name="g", delete_backoff=0.01, **config))  # type: ignore[arg-type]


# -- the waiters of each spec -------------------------------------------------------


async def test_distinct_specs_acquired_and_released_leave_no_waiters(
    fake: FakeProvider,
) -> None:
    async with pool_of(fake) as pool:
        session = pool.open_session()
        for task in range(50):
            record = await pool.acquire(spec_of(None, task), session=session)
            pool.release(record.id)
        assert pool._creation.waiting == {}
        await eventually(lambda: fake.live == 0)


async def test_a_caller_who_gives_up_while_queued_is_no_waiter(fake: FakeProvider) -> None:
    """One create at a time: the second caller waits in the queue, and gives up there."""
    fake.faults.create_latency = 0.3
    pacing = PacingConfig(window=1, min_window=1, max_window=1)
    async with pool_of(fake, pacing=pacing) as pool:
        session = pool.open_session()
        first = asyncio.ensure_future(pool.acquire(spec_of(None, 1), session=session))
        await eventually(lambda: fake.creating == 1)
        with pytest.raises(sandman.CreateTimeout, match="still queued"):
            await pool.acquire(spec_of(None, 2), session=session, timeout=0.01)
        assert len(pool._creation.waiting) == 1  # the first's, still being made
        pool.release((await first).id)
        assert pool._creation.waiting == {}
        # The queued one was never created.
        await eventually(lambda: fake.live == 0)
        assert fake.created_total == 1


async def test_a_caller_cancelled_while_its_create_fails_is_no_waiter(
    fake: FakeProvider,
) -> None:
    fake.faults.create_latency = 0.1
    fake.faults.fail_create = 1.0
    async with pool_of(fake, retry_limit=0) as pool:
        session = pool.open_session()
        waiting = asyncio.ensure_future(pool.acquire(spec_of(None), session=session))
        await eventually(lambda: fake.creating == 1)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await eventually(lambda: fake.creating == 0)
        assert pool._creation.waiting == {}


async def test_a_sandbox_made_for_a_caller_who_left_goes_to_the_next_waiter(
    fake: FakeProvider,
) -> None:
    """The hand-over to the next waiter of the same spec still works, and leaves no entry."""
    fake.faults.create_latency = 0.2
    pacing = PacingConfig(window=1, min_window=1, max_window=1)
    async with pool_of(fake, pacing=pacing) as pool:
        left, stays = pool.open_session(), pool.open_session()
        gone = asyncio.ensure_future(pool.acquire(spec_of(None), session=left))
        await eventually(lambda: fake.creating == 1)
        waiting = asyncio.ensure_future(pool.acquire(spec_of(None), session=stays))
        await eventually(
            lambda: len(pool._creation.waiting.get(next(iter(pool._creation.waiting)), ())) == 2
        )
        gone.cancel()
        record = await waiting
        assert record.session == stays and fake.created_total == 1
        assert pool._creation.waiting == {}


# -- tallies --------------------------------------------------------------------------


def test_a_tally_counts_each_sandbox_once_under_the_key_it_was_held_with() -> None:
    tally = Tally(team)
    x1, x2 = (Record(f"x{n}", spec_of("x"), "creating", {}, 0.0) for n in (1, 2))
    nobody = Record("n", spec_of(None), "creating", {}, 0.0)
    for record in (x1, x1, x2, nobody):
        tally.held(record)
    assert (tally["x"], tally["y"], len(tally)) == (2, 0, 1)
    x1.labels["team"] = "y"  # relabelled meanwhile: let go of where it was counted
    tally.let_go("x1")
    tally.let_go("x1")
    tally.let_go("n")
    tally.let_go("unknown")
    assert tally.counts() == {"x": 1}
    tally.let_go("x2")
    assert tally.counts() == {} and len(tally) == 0 and tally._keyed == {}


async def test_a_tally_follows_sandboxes_as_they_come_and_go(fake: FakeProvider) -> None:
    async with pool_of(fake, retry_limit=0) as pool:
        session = pool.open_session()
        early = await pool.acquire(spec_of("x"), session=session)
        tally = pool.tally(team)  # counts what is held already
        assert tally.counts() == {"x": 1}
        x = await pool.acquire(spec_of("x", 1), session=session)
        y = await pool.acquire(spec_of("y"), session=session)
        await pool.acquire(spec_of(None), session=session)
        assert tally.counts() == {"x": 2, "y": 1}

        pool.release(early.id)  # let go of at once, not once deleted
        assert tally.counts() == {"x": 1, "y": 1}
        fake.lose(y.id)
        await eventually(lambda: tally.counts() == {"x": 1}, what="the loss counted")

        # Counted while it is being made; a create that fails is let go of.
        fake.faults.create_latency = 0.2
        fake.faults.fail_create = 1.0
        failing = asyncio.ensure_future(pool.acquire(spec_of("y", 1), session=session))
        await eventually(lambda: tally["y"] == 1, what="the create counted")
        with pytest.raises(sandman.ProviderError):
            await failing
        assert tally.counts() == {"x": 1}

        pool.close_session(session)
        assert tally.counts() == {}
        assert x.state != "leased"


async def test_a_tally_counts_adopted_sandboxes_by_their_labels(fake: FakeProvider) -> None:
    first = pool_of(fake)
    await first.start()
    session = first.open_session()
    held = await first.acquire(spec_of("x"), session=session)
    for loop in first._loops:  # crashed: never closed
        loop.cancel()
    second = pool_of(fake, adopt_orphans=True)
    tally = second.tally(team)
    async with second:
        assert second.get(held.id).state == "leased"
        assert tally.counts() == {"x": 1}
        second.release(held.id)
        assert tally.counts() == {}


async def test_a_tally_nobody_keeps_is_dropped(fake: FakeProvider) -> None:
    async with pool_of(fake) as pool:
        kept = pool.tally(team)
        pool.tally(team)  # not kept
        session = pool.open_session()
        await pool.acquire(spec_of("x"), session=session)
        assert kept.counts() == {"x": 1}
        assert list(pool._ledger.tallies) == [kept]
