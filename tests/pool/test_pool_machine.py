"""A Hypothesis state machine over the pool: acquire, cancel, release, client crash,
pool restart and backend failures, with the invariants checked after every step
and nothing leaked at the end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from sandman.models import SandboxSpec
from sandman.pool import PacingConfig, Pool, PoolConfig, Record
from sandman.testing import FakeProvider

SPECS = [SandboxSpec(image="a"), SandboxSpec(image="b", cpu=2)]
CONFIG = PoolConfig(
    name="machine", lease=5.0, delete_backoff=0.001, delete_backoff_max=0.01, retry_limit=100,
    pacing=PacingConfig(rate=500.0, burst=50, window=16, cooldown=0.01),
)  # fmt: skip


class PoolMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.fake = FakeProvider(daemon=False, seed=3)
        self.pool = self._run(self._start())
        self.pending: list[asyncio.Task[Record]] = []
        self.held: list[Record] = []
        self.crashed: list[Pool] = []

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _in_loop(self, fn: Any, *args: Any) -> Any:
        """Pool methods are called from the event loop, as real callers do."""

        async def call() -> Any:
            return fn(*args)

        return self._run(call())

    async def _start(self) -> Pool:
        pool = Pool(self.fake, CONFIG)
        await pool.start()
        return pool

    def _settle(self, seconds: float = 0.002) -> None:
        self._run(asyncio.sleep(seconds))
        done = [t for t in self.pending if t.done()]
        self.pending = [t for t in self.pending if not t.done()]
        for task in done:
            if not task.cancelled() and task.exception() is None:
                self.held.append(task.result())

    @rule(target=sessions)
    def open_session(self) -> str:
        session: str = self._in_loop(self.pool.open_session)
        return session

    @rule(
        session=sessions, spec=st.sampled_from(SPECS), patience=st.sampled_from([None, 0.001, 1.0])
    )
    def acquire(self, session: str, spec: SandboxSpec, patience: float | None) -> None:
        if session in self.pool._leases.sessions:
            self.pending.append(
                self.loop.create_task(self.pool.acquire(spec, session=session, timeout=patience))
            )
        self._settle()

    # No preconditions on `pending`/`held`: what is still pending depends on
    # timing, and a precondition that differs on replay makes Hypothesis fail
    # with FlakyStrategyDefinition. Both rules are no-ops when there is nothing.
    @rule(index=st.integers(0, 100))
    def cancel(self, index: int) -> None:
        if self.pending:
            self.pending[index % len(self.pending)].cancel()
        self._settle()

    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        if self.held:
            record = self.held.pop(index % len(self.held))
            self._in_loop(self.pool.release, record.id)
        self._settle()

    @rule(session=consumes(sessions))
    def client_exits(self, session: str) -> None:
        self._in_loop(self.pool.close_session, session)
        self._settle()

    @rule(
        throttle=st.sampled_from([0.0, 0.3]),
        fail=st.sampled_from([0.0, 0.2]),
        fail_delete=st.sampled_from([0.0, 0.3]),
        latency=st.sampled_from([0.0, 0.005]),
    )
    def backend_weather(
        self, throttle: float, fail: float, fail_delete: float, latency: float
    ) -> None:
        faults = self.fake.faults
        faults.throttle, faults.fail_create = throttle, fail
        faults.fail_delete, faults.create_latency = fail_delete, latency
        faults.throttle_retry_after = 0.001

    @rule()
    def pool_restarts(self) -> None:
        """The pool's process dies (no cleanup at all); a new one of the same name starts."""
        old = self.pool
        for task in [*old._loops, *old._creation.creates, *old._tasks, *self.pending]:
            task.cancel()
        self._settle()
        self.crashed.append(old)
        self.pending, self.held = [], []
        self.pool = self._run(self._start())

    @rule()
    def time_passes(self) -> None:
        self._settle(0.02)

    @invariant()
    def leased_sandboxes_belong_to_open_sessions_once(self) -> None:
        owners: dict[str, str] = {}
        for record in self.pool.list():
            if record.state == "leased":
                assert record.session in self.pool._leases.sessions, record
                assert owners.setdefault(record.id, record.session) == record.session

    @invariant()
    def in_flight_within_the_window_bound(self) -> None:
        stats = self.pool.stats()
        assert stats["pacing_in_flight"] <= CONFIG.pacing.max_window

    def teardown(self) -> None:
        try:
            faults = self.fake.faults
            faults.throttle = faults.fail_create = faults.fail_delete = 0.0
            for task in self.pending:
                task.cancel()
            self._settle()
            self._run(self.pool.aclose())
            # What crashed pools left, the next pool's start-up reconcile deleted;
            # what this pool made, its close did. Nothing may be left.
            leaked = self.fake.live
        finally:
            self._run(self._sweep())
            self._run(self.fake.aclose())
            self.loop.close()
        assert leaked == 0, f"{leaked} sandboxes leaked"

    async def _sweep(self) -> None:
        final = Pool(self.fake, CONFIG)
        await final.start()
        async with asyncio.timeout(10):
            while self.fake.live:
                await asyncio.sleep(0.005)
        await final.aclose()


PoolMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_pool_state_machine = pytest.mark.timeout(300)(PoolMachine.TestCase)
