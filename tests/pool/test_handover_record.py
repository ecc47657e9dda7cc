"""The hand-over is recorded on the sandbox before the caller is answered, and adoption
leases exactly what callers received (issue 14, item 9)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent, Record
from sandman.pool import pool as pool_module
from sandman.testing import FakeProvider
from tests.support import eventually

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image="task")
SPARE = SandboxSpec(image="spare")
SESSION = "sandman.io/session"


class FlakyRelabel(FakeProvider):
    """Relabels fail the first ``failures`` times (the sandbox vanished, or the API
    refused), and each waits for ``gate`` when one is set."""

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        super().__init__(daemon=False, seed=5)
        self.failures = failures
        self.error = error or sandman.ProviderError("fake: relabel refused")
        self.gate: asyncio.Event | None = None

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.failures > 0:
            self.failures -= 1
            self.calls.append(("relabel", sandbox_id))
            raise self.error
        await super().relabel(sandbox_id, labels)


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    provider = FakeProvider(daemon=False, seed=7)
    yield provider
    await provider.aclose()


def labels_of(provider: FakeProvider, sandbox_id: str) -> dict[str, str]:
    return next(s.labels for s in provider._sandboxes.values() if s.id == sandbox_id)


async def test_the_session_label_is_written_at_the_hand_over_not_at_create(
    fake: FakeProvider,
) -> None:
    async with Pool(fake, PoolConfig(name="t")) as pool:
        pool.warm(SPARE, 1)
        await eventually(lambda: pool.stats().get("ready", 0) == 1)
        (spare,) = await fake.list()
        assert SESSION not in spare.labels  # a spare no one was handed
        session = pool.open_session()
        for spec, timeout in ((SPEC, None), (SPARE, 0.0)):
            # A ready spare within no time at all: its hand-over is recorded all the same.
            record = await pool.acquire(spec, session=session, timeout=timeout)
            assert labels_of(fake, record.id)[SESSION] == session
            assert record.labels[SESSION] == session
        created = [sid for op, sid in fake.calls if op == "create"]
        relabelled = [sid for op, sid in fake.calls if op == "relabel"]
        assert len(relabelled) == 2 and set(relabelled) <= set(created)


async def test_adoption_leases_only_what_a_caller_received() -> None:
    """The first pool is abandoned (as by SIGKILL) with one sandbox handed over, one
    whose create was in flight (running, its daemon not ready yet) and one warm
    spare: the next pool of the name adopts only the first, and deletes the rest."""
    async with FakeProvider(daemon=True, seed=3) as fake:
        first = Pool(fake, PoolConfig(name="t", ready_timeout=3600))
        await first.start()
        waiting: asyncio.Future[Record] | None = None
        try:
            session = first.open_session()
            held = await first.acquire(SPEC, session=session, timeout=30)
            first.warm(SPARE, 1)
            await eventually(lambda: first.stats().get("ready", 0) == 1, timeout=30)
            fake.faults.ready_latency = 3600  # the next daemon never answers
            waiting = asyncio.ensure_future(first.acquire(SPEC, session=session))
            await eventually(lambda: fake.live == 3, timeout=30)
            # The pool "dies" here: its loops stop, nothing of it is cleaned up.
            for loop in first._loops:
                loop.cancel()
            events: list[PoolEvent] = []
            config = PoolConfig(name="t", adopt_orphans=True)
            async with Pool(fake, config, hook=events.append) as second:
                adopted = [e.sandbox_id for e in events if e.name == "reconcile.adopted"]
                assert adopted == [held.id]
                assert [r.id for r in second.list(session=session)] == [held.id]
                assert second.get(held.id).state == "leased"
                orphans = {
                    e.sandbox_id: e.detail["reason"] for e in events if e.name == "reconcile.orphan"
                }
                assert list(orphans.values()) == ["orphan, never handed over"] * 2
                await eventually(lambda: fake.live == 1, timeout=30)
                second.heartbeat(session)  # the session carries on with what it holds
            assert fake.live == 0
        finally:
            if waiting is not None:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            await first.aclose(timeout=30)


async def test_a_hand_over_that_cannot_be_recorded_is_never_answered() -> None:
    """The first sandbox's relabel fails: it is deleted, and the caller gets a second."""
    async with FlakyRelabel(failures=1) as fake:
        events: list[PoolEvent] = []
        async with Pool(fake, PoolConfig(name="t"), hook=events.append) as pool:
            session = pool.open_session()
            record = await pool.acquire(SPEC, session=session, timeout=10)
            assert labels_of(fake, record.id)[SESSION] == session
            assert fake.created_total == 2
            await eventually(lambda: fake.live == 1)
            failed = [e for e in events if e.name == "handover.failed"]
            assert len(failed) == 1 and failed[0].sandbox_id != record.id
            # Twice in a row: a typed error, and nothing kept.
            fake.failures = 2
            with pytest.raises(sandman.ProviderError, match="could not record the hand-over"):
                await pool.acquire(SPEC, session=session, timeout=10)
            await eventually(lambda: fake.live == 1)
            assert [r.id for r in pool.list(session=session)] == [record.id]


async def test_a_throttled_relabel_is_waited_out() -> None:
    error = sandman.ThrottledError("fake: 429", retry_after=0.01)
    async with (
        FlakyRelabel(failures=2, error=error) as fake,
        Pool(fake, PoolConfig(name="t")) as pool,
    ):
        session = pool.open_session()
        record = await pool.acquire(SPEC, session=session, timeout=10)
        assert labels_of(fake, record.id)[SESSION] == session
        assert fake.created_total == 1


async def test_a_caller_cut_off_while_the_hand_over_is_recorded_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "HAND_OVER_GRACE", 0.1)
    async with FlakyRelabel() as fake:
        fake.gate = asyncio.Event()
        async with Pool(fake, PoolConfig(name="t")) as pool:
            session = pool.open_session()
            with pytest.raises(sandman.CreateTimeout, match="recording the hand-over"):
                await pool.acquire(SPEC, session=session, timeout=0.05)
            await eventually(lambda: fake.live == 0 and not pool.list())
            task = asyncio.ensure_future(pool.acquire(SPEC, session=session))
            await eventually(lambda: fake.created_total == 2 and fake.live == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await eventually(lambda: fake.live == 0 and not pool.list())


async def test_without_record_hand_over_no_relabel_is_made(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t", record_hand_over=False)) as pool:
        record = await pool.acquire(SPEC, session=pool.open_session())
        assert SESSION not in labels_of(fake, record.id)
        assert not [op for op, _ in fake.calls if op == "relabel"]


async def test_a_session_that_ends_while_its_acquire_waits_is_session_expired(
    fake: FakeProvider,
) -> None:
    fake.faults.create_latency = 0.2
    async with Pool(fake, PoolConfig(name="t")) as pool:
        session = pool.open_session()
        task = asyncio.ensure_future(pool.acquire(SPEC, session=session))
        await eventually(lambda: fake.creating == 1)
        pool.close_session(session)
        with pytest.raises(sandman.SessionExpired, match="ended while waiting"):
            await task
        with pytest.raises(sandman.SessionExpired, match="unknown or expired"):
            pool.heartbeat(session)
        await eventually(lambda: fake.live == 0 and fake.creating == 0)
