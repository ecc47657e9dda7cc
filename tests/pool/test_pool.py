"""The pool against the fault-injecting fake provider: ownership, leases, pacing, cleanup."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig, PoolEvent
from sandman.providers.base import SandboxInfo
from sandman.testing import FakeProvider, Faults
from tests.support import eventually

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image="task")


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=7)
    yield provider
    await provider.aclose()


def pool_of(provider: FakeProvider, **config: object) -> Pool:
    return Pool(provider, PoolConfig(name="t", **config))  # type: ignore[arg-type]


async def test_acquire_release_and_timeline(fake: FakeProvider) -> None:
    events: list[PoolEvent] = []
    async with Pool(fake, PoolConfig(name="t"), hook=events.append) as pool:
        session = pool.open_session()
        record = await pool.acquire(SPEC, session=session)
        assert record.state == "leased" and record.session == session
        assert fake.live == 1
        assert record.labels["sandman.io/pool"] == "t"
        assert float(record.labels["sandman.io/expires-at"]) > 0
        pool.release(record.id)
        await eventually(lambda: fake.live == 0)
        assert list(record.timeline) == [
            "queued", "create_called", "accepted", "running", "daemon_ready", "handed_out",
            "released", "gone",
        ]  # fmt: skip
    names = [e.name for e in events]
    assert (
        names.index("create.started")
        < names.index("create.complete")
        < names.index("delete.complete")
    )


async def test_a_caller_who_gives_up_leaks_nothing(fake: FakeProvider) -> None:
    fake.faults.create_latency = 0.2
    async with pool_of(fake) as pool:
        session = pool.open_session()
        # The provider's word on what the create waits on is passed on.
        pattern = r"being created for \d+\.\d s \(fake: waiting out create_latency\)"
        with pytest.raises(sandman.CreateTimeout, match=pattern):
            await pool.acquire(SPEC, session=session, timeout=0.05)
        await eventually(lambda: fake.created_total == 1 and fake.live == 0)


async def test_a_caller_cut_off_just_after_the_hand_over_leaks_nothing(
    fake: FakeProvider,
) -> None:
    """The pool has set the waiting acquire's result; the caller is cancelled (or its
    deadline fires) before it resumes: the sandbox must not stay leased to no one."""
    waiting: list[asyncio.Task[object]] = []

    def cut_off(event: PoolEvent) -> None:
        # Runs inside the hand-over, just before the result is set: the cut lands
        # after it, before the caller's task resumes.
        if event.name == "sandbox.leased" and waiting:
            asyncio.get_running_loop().call_soon(waiting[0].cancel)

    async with Pool(fake, PoolConfig(name="t"), hook=cut_off) as pool:
        session = pool.open_session()
        waiting.append(asyncio.ensure_future(pool.acquire(SPEC, session=session, timeout=30)))
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        await eventually(lambda: fake.live == 0 and not pool.list(session=session))
        assert fake.created_total == 1


async def test_a_timeout_says_where_the_request_had_got_to(fake: FakeProvider) -> None:
    # Queued behind a full window: the cluster is busy, not the image.
    fake.faults.create_latency = 5.0
    config = PacingConfig(window=1, min_window=1, max_window=1, rate=100.0)
    async with Pool(fake, PoolConfig(name="t", pacing=config)) as pool:
        session = pool.open_session()
        first = asyncio.ensure_future(pool.acquire(SPEC, session=session))
        await eventually(lambda: fake.creating == 1)
        with pytest.raises(sandman.CreateTimeout, match="still queued, 1 requests waiting") as e:
            await pool.acquire(SPEC, session=session, timeout=0.1)
        assert "1 of 1 creates in flight" in str(e.value)
        first.cancel()
    # Every try refused and retried: the last refusal is named.
    fake.faults = Faults(throttle=1.0, throttle_retry_after=0.01)
    async with pool_of(fake, retry_limit=1000) as pool:
        session = pool.open_session()
        with pytest.raises(sandman.CreateTimeout, match=r"try \d+ failed: .*too many requests"):
            await pool.acquire(SPEC, session=session, timeout=0.5)


async def test_a_sandbox_nobody_waits_for_goes_to_the_next_waiter(fake: FakeProvider) -> None:
    fake.faults.create_latency = 0.2
    config = PacingConfig(window=4, min_window=1, rate=100.0)
    async with Pool(fake, PoolConfig(name="t", pacing=config)) as pool:
        session = pool.open_session()
        impatient = asyncio.ensure_future(pool.acquire(SPEC, session=session))
        await eventually(lambda: fake.creating == 1)
        impatient.cancel()
        # A second waiter, queued behind a window of... it is served by the
        # first create rather than starting another one from scratch.
        patient = await pool.acquire(SPEC, session=session, timeout=5)
        assert patient.state == "leased"
        assert fake.created_total <= 2


async def test_queued_requests_of_a_gone_caller_are_never_created(fake: FakeProvider) -> None:
    fake.faults.create_latency = 0.1
    config = PacingConfig(window=4, min_window=1)
    async with Pool(fake, PoolConfig(name="t", pacing=config)) as pool:
        session = pool.open_session()
        tasks = [asyncio.ensure_future(pool.acquire(SPEC, session=session)) for _ in range(20)]
        await eventually(lambda: fake.creating >= 1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await eventually(lambda: fake.creating == 0 and fake.live == 0)
        assert fake.created_total <= 4  # only what was already in the window


async def test_an_untyped_failure_of_a_reconcile_does_not_stop_maintenance(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by the chaos suite: an OSError out of the provider's list ended the
    # maintenance loop, and no session expired nor anything was reaped after it.
    events: list[PoolEvent] = []
    config = PoolConfig(name="t", lease=0.3, reconcile_interval=0.05)
    async with Pool(fake, config, hook=events.append) as pool:
        quiet = pool.open_session()
        await pool.acquire(SPEC, session=quiet)

        async def broken(**_: object) -> list[object]:
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr(fake, "list", broken)
        await eventually(lambda: "reconcile.failed" in [e.name for e in events])
        await eventually(lambda: fake.live == 0, what="the quiet session's sandbox to go")
        assert "session.expired" in [e.name for e in events]
    assert "Read-only file system" in caplog.text


async def test_a_slow_reconcile_is_spaced_to_its_share_of_the_pools_time(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pass lists every sandbox: at 10k local ones it takes seconds, and at the
    # configured interval it would take a core's share for good.
    starts: list[float] = []
    listing = fake.list

    async def slow(**kwargs: Any) -> list[SandboxInfo]:
        starts.append(time.monotonic())
        await asyncio.sleep(0.1)
        return await listing(**kwargs)

    monkeypatch.setattr(fake, "list", slow)
    config = PoolConfig(name="t", lease=0.4, reconcile_interval=0.05, reconcile_share=0.1)
    async with Pool(fake, config):
        await eventually(lambda: len(starts) >= 4, timeout=10, what="three passes after start's")
    gaps = [b - a for a, b in itertools.pairwise(starts[1:])]
    assert all(gap >= 0.9 for gap in gaps), gaps  # 0.1 s is 10% of 1 s; not every 0.05 s


def test_a_reconcile_share_outside_0_to_1_is_refused() -> None:
    for share in (0.0, -1.0, 1.5):
        with pytest.raises(sandman.ConfigError, match="reconcile_share"):
            PoolConfig(reconcile_share=share)


async def test_a_session_that_stops_heartbeating_loses_its_sandboxes(fake: FakeProvider) -> None:
    async with pool_of(fake, lease=0.3) as pool:
        quiet, alive = pool.open_session(), pool.open_session()
        await pool.acquire(SPEC, session=quiet)
        kept = await pool.acquire(SPEC, session=alive)
        for _ in range(10):
            pool.heartbeat(alive)
            await asyncio.sleep(0.1)
        assert fake.live == 1 and pool.get(kept.id).state == "leased"
        with pytest.raises(sandman.SandboxNotFound):
            pool.heartbeat(quiet)


async def test_a_stall_of_the_pools_own_loop_expires_no_session(fake: FakeProvider) -> None:
    """A debugger, a long synchronous step or SIGSTOP stops the loop that would have
    served the heartbeats: that time must not count against the sessions."""
    events: list[PoolEvent] = []
    async with Pool(fake, PoolConfig(name="t", lease=1.0), hook=events.append) as pool:
        session = pool.open_session()
        record = await pool.acquire(SPEC, session=session)
        stall(2.5)  # blocks the event loop: nothing of the pool runs
        await asyncio.sleep(0.3)
        pool.heartbeat(session)  # not "unknown or expired"
        assert record.state == "leased" and fake.live == 1
        assert "pool.stalled" in [e.name for e in events]
        assert "session.expired" not in [e.name for e in events]
        # A session that really stops heartbeating still goes.
        await eventually(lambda: "session.expired" in [e.name for e in events], timeout=5)


def stall(seconds: float) -> None:
    time.sleep(seconds)


async def test_hard_lifetime_is_enforced(fake: FakeProvider) -> None:
    async with pool_of(fake, lifetime=0.3) as pool:
        session = pool.open_session()
        await pool.acquire(SPEC, session=session)
        await eventually(lambda: fake.live == 0, timeout=5)


async def test_throttling_is_retried_and_slows_the_pacer(fake: FakeProvider) -> None:
    fake.faults.throttle = 0.5
    fake.faults.throttle_retry_after = 0.01
    async with pool_of(fake, retry_limit=50) as pool:
        session = pool.open_session()
        records = await asyncio.gather(*(pool.acquire(SPEC, session=session) for _ in range(20)))
        assert len({r.id for r in records}) == 20
        assert pool.stats()["pacing_rate"] < PacingConfig().rate


async def test_permanent_failures_reach_the_caller(fake: FakeProvider) -> None:
    fake.faults.image_errors = frozenset({"broken"})
    async with pool_of(fake) as pool:
        session = pool.open_session()
        with pytest.raises(sandman.ImageError):
            await pool.acquire(SandboxSpec(image="broken"), session=session)
        fake.faults.fail_create = 1.0
        with pytest.raises(sandman.ProviderError):
            await pool.acquire(SPEC, session=session)
    assert fake.live == 0


async def test_a_missing_image_does_not_slow_the_pacer(fake: FakeProvider) -> None:
    fake.faults.image_errors = frozenset({"typo"})
    async with pool_of(fake) as pool:
        session = pool.open_session()
        before = pool.stats()
        for _ in range(3):
            with pytest.raises(sandman.ImageError):
                await pool.acquire(SandboxSpec(image="typo"), session=session)
        after = pool.stats()
        assert after["pacing_rate"] == before["pacing_rate"]
        assert after["pacing_window"] == before["pacing_window"]


async def test_a_backend_that_leaks_on_failure_is_reconciled(fake: FakeProvider) -> None:
    fake.faults.fail_create = 1.0
    fake.faults.leak_on_fail = 1.0
    async with pool_of(fake) as pool:
        session = pool.open_session()
        with pytest.raises(sandman.ProviderError):
            await pool.acquire(SPEC, session=session)
        # The failed create was deleted by id, the recorded intent.
        await eventually(lambda: fake.live == 0)


async def test_deletes_are_retried_until_gone(fake: FakeProvider) -> None:
    fake.faults.fail_delete = 0.7
    async with pool_of(fake, delete_backoff=0.01, delete_backoff_max=0.05) as pool:
        session = pool.open_session()
        for _ in range(5):
            pool.release((await pool.acquire(SPEC, session=session)).id)
        await eventually(lambda: fake.live == 0)


async def test_a_restarted_pool_cleans_up_its_previous_life(fake: FakeProvider) -> None:
    first = pool_of(fake)
    await first.start()
    session = first.open_session()
    for _ in range(3):
        await first.acquire(SPEC, session=session)
    # first "crashes": never closed. A new pool of the same name starts:
    async with pool_of(fake) as second:
        await eventually(lambda: fake.live == 0)
        assert second.list() == []
    for loop in first._loops:  # stop the crashed pool's loops without any cleanup
        loop.cancel()


async def test_adopting_orphans_keeps_them_for_their_session(fake: FakeProvider) -> None:
    first = pool_of(fake)
    await first.start()
    session = first.open_session()
    held = await first.acquire(SPEC, session=session)
    for loop in first._loops:
        loop.cancel()
    async with pool_of(fake, adopt_orphans=True) as second:
        assert second.get(held.id).state == "leased"
        second.heartbeat(session)
    assert fake.live == 0


async def test_warm_spares_serve_acquires_at_once(fake: FakeProvider) -> None:
    fake.faults.create_latency = 0.05
    async with pool_of(fake) as pool:
        pool.warm(SPEC, 3)
        await eventually(lambda: pool.stats().get("ready", 0) == 3)
        created = fake.created_total
        session = pool.open_session()
        record = await pool.acquire(SPEC, session=session, timeout=0.01)
        assert record.state == "leased" and fake.created_total == created
        await eventually(lambda: pool.stats().get("ready", 0) == 3)  # topped up again


async def test_one_clients_burst_does_not_starve_another(fake: FakeProvider) -> None:
    fake.faults.create_latency = 0.01
    config = PacingConfig(rate=200.0, burst=5, window=4, min_window=1)
    async with Pool(fake, PoolConfig(name="t", pacing=config)) as pool:
        big, small = pool.open_session(), pool.open_session()
        order: list[str] = []

        async def one(session: str) -> None:
            await pool.acquire(SPEC, session=session)
            order.append(session)

        bulk = [asyncio.ensure_future(one(big)) for _ in range(200)]
        await asyncio.sleep(0.02)
        await asyncio.gather(*(one(small) for _ in range(5)))
        # The small client's 5 are done long before the big client's 200.
        assert order.count(big) < 100
        await asyncio.gather(*bulk)


def test_deletes_cut_short_at_the_end_of_asyncio_run_are_done_at_close() -> None:
    """asyncio.run cancels every task left when its main one returns: the delete of a
    sandbox just released among them, and a task that closes the pool then (as the
    adapters' client of a loop does). The close deletes what the cancelled delete left."""
    provider = FakeProvider(daemon=False, seed=7)
    provider.faults.delete_latency = 0.2

    async def main() -> None:
        pool = pool_of(provider)
        await pool.start()

        async def close_at_end() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await pool.aclose()

        closer = asyncio.create_task(close_at_end())
        record = await pool.acquire(SPEC, session=pool.open_session())
        pool.release(record.id)  # its delete is under way as main returns
        assert not closer.done()

    asyncio.run(main())
    assert provider.live == 0
    asyncio.run(provider.aclose())


@pytest.mark.timeout(30)
async def test_a_close_just_after_its_deletes_are_cancelled_returns(fake: FakeProvider) -> None:
    """asyncio.run's end cancels the pool's deletes; a close that runs before their done
    callbacks (which take them off the pool's books) must not spin: on Python 3.12
    ``gather`` of tasks already done completes without ever yielding to those callbacks."""
    fake.faults.delete_latency = 0.5
    pool = pool_of(fake)
    await pool.start()
    record = await pool.acquire(SPEC, session=pool.open_session())
    pool.release(record.id)
    [delete] = [t for t in asyncio.all_tasks() if t.get_name().startswith("sandman-delete")]
    delete.cancel()
    await asyncio.sleep(0)  # the delete ends; its done callbacks are queued, not yet run
    assert delete.done()
    await pool.aclose()
    assert fake.live == 0


async def test_closed_pool_refuses_and_releases_everything(fake: FakeProvider) -> None:
    pool = pool_of(fake)
    await pool.start()
    session = pool.open_session()
    await pool.acquire(SPEC, session=session)
    await pool.aclose()
    assert fake.live == 0
    with pytest.raises(sandman.PoolClosed):
        await pool.acquire(SPEC, session=session)
