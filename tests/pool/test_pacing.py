"""The pacer, driven by a fake ``now``: one test per rule, then Hypothesis properties."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sandman.errors import ConfigError
from sandman.pool.pacing import FailureKind, Pacer, PacingConfig

T0 = 1000.0  # monotonic clocks do not start at zero

# A config whose only limit is the one a test looks at.
LOOSE = PacingConfig(
    rate=500.0,
    max_rate=500.0,
    burst=100_000,
    window=100_000,
    max_window=100_000,
    increase_rate=0.0,
    increase_window=0,
)

TROUBLE: list[FailureKind] = ["throttled", "server_error", "timeout", "capacity"]


def drain(pacer: Pacer[Any], now: float) -> list[Any]:
    """Everything `next` hands out at ``now``."""
    out = []
    while (request := pacer.next(now)) is not None:
        out.append(request)
    return out


# -- configuration --------------------------------------------------------------------------


def test_defaults() -> None:
    pacer: Pacer[str] = Pacer()
    assert pacer.rate == 50.0
    assert pacer.window == 64
    assert pacer.in_flight == 0
    assert pacer.queued() == 0
    assert pacer.latency is None
    assert pacer.config == PacingConfig()


@pytest.mark.parametrize(
    "changes",
    [
        {"rate": 0.0},
        {"rate": math.nan},
        {"rate": 0.5},  # below min_rate
        {"rate": 600.0},  # above max_rate
        {"min_rate": -1.0},
        {"max_rate": math.inf},
        {"burst": 0},
        {"window": 2},  # below min_window
        {"window": 5000},  # above max_window
        {"min_window": 0, "window": 1},
        {"increase_rate": -1.0},
        {"increase_window": -1},
        {"decrease": 0.0},
        {"decrease": 1.0},
        {"healthy_interval": 0.0},
        {"latency_target": -1.0},
        {"cooldown": -0.5},
        {"latency_alpha": 0.0},
        {"latency_alpha": 1.5},
    ],
)
def test_invalid_config_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        replace(PacingConfig(), **changes)


# -- the token bucket -----------------------------------------------------------------------


def test_bucket_starts_full_and_refills_at_rate() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, rate=10.0, burst=3), now=T0)
    for i in range(100):
        pacer.enqueue("a", i)
    assert drain(pacer, T0) == [0, 1, 2]
    assert pacer.wait_time(T0) == pytest.approx(0.1)
    assert pacer.next(T0 + 0.05) is None
    assert pacer.wait_time(T0 + 0.05) == pytest.approx(0.05)
    assert pacer.next(T0 + 0.1) == 3
    assert pacer.next(T0 + 0.1) is None
    assert drain(pacer, T0 + 0.35) == [4, 5]  # 2.5 tokens accrued: two whole ones


def test_bucket_holds_at_most_burst() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, rate=10.0, burst=3), now=T0)
    for i in range(100):
        pacer.enqueue("a", i)
    drain(pacer, T0)
    assert len(drain(pacer, T0 + 3600)) == 3
    assert pacer.stats()["tokens"] == pytest.approx(0.0)


def test_wait_time_then_next_succeeds() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, rate=3.0, burst=1), now=T0)
    for i in range(20):
        pacer.enqueue("a", i)
    now = T0
    for i in range(20):
        wait = pacer.wait_time(now)
        assert wait is not None
        now += wait
        assert pacer.next(now) == i


def test_wait_time_is_none_when_nothing_is_queued() -> None:
    pacer: Pacer[int] = Pacer(now=T0)
    assert pacer.wait_time(T0) is None
    assert pacer.next(T0) is None
    pacer.enqueue("a", 1)
    assert pacer.wait_time(T0) == 0.0


# -- the window -----------------------------------------------------------------------------


def test_window_bounds_in_flight() -> None:
    cfg = replace(LOOSE, window=4, min_window=1)
    pacer: Pacer[int] = Pacer(cfg, now=T0)
    for i in range(10):
        pacer.enqueue("a", i)
    assert drain(pacer, T0) == [0, 1, 2, 3]
    assert pacer.in_flight == 4
    assert pacer.wait_time(T0) is None  # only the window blocks: an on_* call unblocks
    pacer.on_ready(T0 + 1, latency=1.0)
    assert pacer.wait_time(T0 + 1) == 0.0
    assert drain(pacer, T0 + 1) == [4]
    pacer.on_failed(T0 + 2, "other")
    pacer.on_abandoned(T0 + 2)
    assert drain(pacer, T0 + 2) == [5, 6]
    assert pacer.in_flight == 4


def test_surplus_reports_do_not_open_the_window() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, window=4, min_window=1), now=T0)
    pacer.on_ready(T0, latency=1.0)
    pacer.on_abandoned(T0)
    assert pacer.in_flight == 0
    for i in range(10):
        pacer.enqueue("a", i)
    assert len(drain(pacer, T0)) == 4


# -- the fair queue -------------------------------------------------------------------------


def test_fifo_within_a_client() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    for request in ["x", "y", "z"]:
        pacer.enqueue("a", request)
    assert drain(pacer, T0) == ["x", "y", "z"]


def test_round_robin_across_clients() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    for i in range(3):
        pacer.enqueue("a", f"a{i}")
    pacer.enqueue("b", "b0")
    pacer.enqueue("c", "c0")
    pacer.enqueue("c", "c1")
    assert drain(pacer, T0) == ["a0", "b0", "c0", "a1", "c1", "a2"]


def test_a_new_client_joins_at_the_back() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    for i in range(3):
        pacer.enqueue("a", f"a{i}")
        pacer.enqueue("b", f"b{i}")
    assert pacer.next(T0) == "a0"
    pacer.enqueue("c", "c0")
    assert drain(pacer, T0) == ["b0", "a1", "c0", "b1", "a2", "b2"]


def test_a_big_client_delays_others_by_one_turn_per_client() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    for i in range(5000):
        pacer.enqueue("big", f"big{i}")
    for client in ("small1", "small2"):
        for i in range(10):
            pacer.enqueue(client, f"{client}-{i}")
    first = [pacer.next(T0) for _ in range(30)]
    assert sum(1 for r in first if r is not None and r.startswith("small")) == 20
    assert pacer.queued("big") == 4990
    assert pacer.queued("small1") == pacer.queued("small2") == 0


def test_queued_counts_per_client() -> None:
    pacer: Pacer[int] = Pacer(LOOSE, now=T0)
    pacer.enqueue("a", 1)
    pacer.enqueue("a", 2)
    pacer.enqueue("b", 3)
    assert (pacer.queued(), pacer.queued("a"), pacer.queued("b"), pacer.queued("c")) == (3, 2, 1, 0)
    pacer.next(T0)
    assert (pacer.queued(), pacer.queued("a")) == (2, 1)


def test_enqueue_twice_is_refused() -> None:
    pacer: Pacer[int] = Pacer(now=T0)
    pacer.enqueue("a", 1)
    with pytest.raises(ValueError, match="already queued"):
        pacer.enqueue("b", 1)


def test_cancelled_requests_are_never_returned() -> None:
    pacer: Pacer[int] = Pacer(LOOSE, now=T0)
    for i in range(6):
        pacer.enqueue("a" if i % 2 else "b", i)
    assert pacer.cancel(2) is True
    assert pacer.cancel(2) is False
    assert pacer.cancel(99) is False
    assert pacer.queued() == 5
    assert pacer.queued("b") == 2
    assert drain(pacer, T0) == [0, 1, 4, 3, 5]


def test_cancel_of_a_returned_request_is_false() -> None:
    pacer: Pacer[int] = Pacer(LOOSE, now=T0)
    pacer.enqueue("a", 1)
    assert pacer.next(T0) == 1
    assert pacer.cancel(1) is False
    assert pacer.in_flight == 1


def test_a_client_whose_requests_are_all_cancelled_leaves_the_rotation() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    pacer.enqueue("a", "a0")
    pacer.enqueue("b", "b0")
    pacer.enqueue("b", "b1")
    pacer.cancel("a0")
    assert pacer.queued("a") == 0
    assert drain(pacer, T0) == ["b0", "b1"]


def test_a_request_queued_again_after_cancel_goes_to_the_back() -> None:
    pacer: Pacer[str] = Pacer(LOOSE, now=T0)
    for request in ["x", "y", "z"]:
        pacer.enqueue("a", request)
    pacer.cancel("x")
    pacer.enqueue("a", "x")
    assert drain(pacer, T0) == ["y", "z", "x"]


def test_mass_cancel_keeps_order_and_memory() -> None:
    pacer: Pacer[int] = Pacer(LOOSE, now=T0)
    for i in range(1000):
        pacer.enqueue("a", i)
    for i in range(1000):
        if i % 10:
            pacer.cancel(i)
    assert pacer.queued() == 100
    assert len(pacer._queues["a"].entries) <= 2 * 100 + 16
    assert drain(pacer, T0) == list(range(0, 1000, 10))


# -- multiplicative decrease ----------------------------------------------------------------


@pytest.mark.parametrize("kind", TROUBLE)
def test_trouble_halves_rate_and_window(kind: FailureKind) -> None:
    pacer: Pacer[int] = Pacer(replace(PacingConfig(), rate=40.0, window=64), now=T0)
    pacer.on_failed(T0, kind)
    assert (pacer.rate, pacer.window) == (20.0, 32)


def test_other_failures_are_not_trouble() -> None:
    pacer: Pacer[int] = Pacer(now=T0)
    pacer.on_failed(T0, "other")
    assert (pacer.rate, pacer.window) == (50.0, 64)


def test_at_most_one_decrease_per_cooldown() -> None:
    pacer: Pacer[int] = Pacer(replace(PacingConfig(), rate=40.0, cooldown=2.0), now=T0)
    for i in range(50):
        pacer.on_failed(T0 + i * 0.01, "throttled")
    assert (pacer.rate, pacer.window) == (20.0, 32)
    pacer.on_failed(T0 + 1.99, "server_error")
    assert pacer.rate == 20.0
    pacer.on_failed(T0 + 2.0, "timeout")
    assert (pacer.rate, pacer.window) == (10.0, 16)


def test_decrease_stops_at_the_minimum() -> None:
    cfg = replace(PacingConfig(), cooldown=0.0, min_rate=2.0, min_window=5)
    pacer: Pacer[int] = Pacer(cfg, now=T0)
    for i in range(30):
        pacer.on_failed(T0 + i, "capacity")
    assert (pacer.rate, pacer.window) == (2.0, 5)


def test_a_decrease_applies_from_now_not_retroactively() -> None:
    cfg = replace(LOOSE, rate=10.0, min_rate=1.0, burst=5)
    pacer: Pacer[int] = Pacer(cfg, now=T0)
    for i in range(100):
        pacer.enqueue("a", i)
    drain(pacer, T0)
    pacer.on_failed(T0 + 0.3, "throttled")  # 3 tokens accrued at 10/s before the decrease
    assert pacer.rate == 5.0
    assert len(drain(pacer, T0 + 0.3)) == 3
    assert pacer.wait_time(T0 + 0.3) == pytest.approx(0.2)


def test_window_below_in_flight_blocks_until_enough_are_freed() -> None:
    cfg = replace(LOOSE, window=8, min_window=1)
    pacer: Pacer[int] = Pacer(cfg, now=T0)
    for i in range(20):
        pacer.enqueue("a", i)
    assert len(drain(pacer, T0)) == 8
    pacer.on_failed(T0, "throttled")  # in_flight 7, window 4
    assert (pacer.in_flight, pacer.window) == (7, 4)
    for _ in range(3):
        pacer.on_abandoned(T0)
        assert pacer.next(T0) is None
    pacer.on_abandoned(T0)
    assert pacer.next(T0) is not None
    assert pacer.in_flight == pacer.window == 4


# -- Retry-After ----------------------------------------------------------------------------


def test_retry_after_pauses_every_create_then_resumes_at_rate() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, rate=10.0, burst=5), now=T0)
    for i in range(100):
        pacer.enqueue("a", i)
    assert pacer.next(T0) == 0
    pacer.on_failed(T0, "other", retry_after=3.0)  # "other": a pause without a decrease
    assert pacer.rate == 10.0
    assert pacer.paused_until == T0 + 3.0
    assert pacer.wait_time(T0 + 1) == pytest.approx(2.0 + 0.1)
    assert pacer.next(T0 + 2.9) is None
    assert pacer.next(T0 + 3.0) is None  # the bucket was emptied; it refills from the pause end
    assert drain(pacer, T0 + 3.1) == [1]
    assert drain(pacer, T0 + 3.3) == [2, 3]


def test_a_shorter_retry_after_does_not_shorten_a_pause() -> None:
    pacer: Pacer[int] = Pacer(now=T0)
    pacer.on_failed(T0, "throttled", retry_after=10.0)
    pacer.on_failed(T0 + 1, "throttled", retry_after=2.0)
    assert pacer.paused_until == T0 + 10.0
    pacer.on_failed(T0 + 1, "throttled", retry_after=20.0)
    assert pacer.paused_until == T0 + 21.0


@pytest.mark.parametrize("retry_after", [0.0, -5.0, math.nan, math.inf])
def test_meaningless_retry_after_is_ignored(retry_after: float) -> None:
    pacer: Pacer[int] = Pacer(now=T0)
    pacer.enqueue("a", 1)
    pacer.on_failed(T0, "throttled", retry_after=retry_after)
    assert pacer.paused_until == T0
    assert pacer.next(T0) == 1


# -- additive increase ----------------------------------------------------------------------


def growing(**changes: Any) -> PacingConfig:
    return replace(PacingConfig(), rate=10.0, window=8, **changes)


def test_healthy_interval_with_demand_increases_rate_and_window() -> None:
    pacer: Pacer[int] = Pacer(growing(), now=T0)
    pacer.enqueue("a", 1)
    pacer.next(T0)  # in flight: demand
    pacer.next(T0 + 0.5)
    assert (pacer.rate, pacer.window) == (10.0, 8)
    pacer.next(T0 + 1.0)
    assert (pacer.rate, pacer.window) == (15.0, 12)
    pacer.next(T0 + 1.5)
    pacer.next(T0 + 2.0)
    assert (pacer.rate, pacer.window) == (20.0, 16)


def test_no_increase_without_demand() -> None:
    pacer: Pacer[int] = Pacer(growing(), now=T0)
    for t in range(1, 10):
        pacer.next(T0 + t)
    assert (pacer.rate, pacer.window) == (10.0, 8)


def test_increase_stops_at_the_maximum() -> None:
    pacer: Pacer[int] = Pacer(growing(max_rate=12.0, max_window=10), now=T0)
    pacer.enqueue("a", 1)
    for t in range(1, 10):
        pacer.next(T0 + t)
    assert (pacer.rate, pacer.window) == (12.0, 10)


def test_trouble_restarts_the_healthy_interval() -> None:
    pacer: Pacer[int] = Pacer(growing(cooldown=5.0), now=T0)
    pacer.enqueue("a", 1)
    pacer.enqueue("a", 2)
    pacer.on_failed(T0, "throttled")
    assert (pacer.rate, pacer.window) == (5.0, 4)
    pacer.next(T0 + 0.75)
    pacer.on_failed(T0 + 0.75, "throttled")  # within cooldown: no decrease, but still trouble
    assert pacer.rate == 5.0
    pacer.next(T0 + 1.5)
    assert pacer.rate == 5.0
    pacer.next(T0 + 1.75)
    assert pacer.rate == 10.0


def test_a_long_silence_yields_one_step() -> None:
    pacer: Pacer[int] = Pacer(growing(), now=T0)
    pacer.enqueue("a", 1)
    pacer.next(T0 + 60)
    assert (pacer.rate, pacer.window) == (15.0, 12)
    pacer.next(T0 + 60.5)
    assert pacer.rate == 15.0
    pacer.next(T0 + 61)
    assert pacer.rate == 20.0


def test_a_pause_is_not_healthy_time() -> None:
    pacer: Pacer[int] = Pacer(growing(), now=T0)
    pacer.enqueue("a", 1)
    pacer.on_failed(T0, "other", retry_after=30.0)
    pacer.next(T0 + 30)
    assert pacer.rate == 10.0
    pacer.next(T0 + 31)
    assert pacer.rate == 15.0


# -- readiness latency ----------------------------------------------------------------------


def test_latency_is_an_ewma() -> None:
    pacer: Pacer[int] = Pacer(growing(latency_alpha=0.5), now=T0)
    pacer.on_ready(T0 + 10, latency=2.0)
    assert pacer.latency == 2.0
    pacer.on_ready(T0 + 10, latency=4.0)
    assert pacer.latency == 3.0
    pacer.on_ready(T0 + 10, latency=math.nan)  # ignored
    pacer.on_ready(T0 + 10, latency=-1.0)  # counted as 0
    assert pacer.latency == 1.5
    assert pacer.stats()["latency"] == 1.5


def test_latency_above_target_decreases() -> None:
    pacer: Pacer[int] = Pacer(growing(latency_target=5.0, latency_alpha=0.5), now=T0)
    pacer.on_ready(T0 + 20, latency=4.0)
    pacer.on_ready(T0 + 20, latency=5.8)  # average 4.9: fine
    assert pacer.rate == 10.0
    pacer.on_ready(T0 + 20, latency=5.4)  # average 5.15: too slow
    assert (pacer.rate, pacer.window) == (5.0, 4)
    assert pacer.latency is None  # a new regime starts


def test_latency_of_sandboxes_created_before_a_decrease_is_ignored() -> None:
    pacer: Pacer[int] = Pacer(growing(latency_target=5.0, cooldown=0.0), now=T0)
    pacer.on_failed(T0 + 10, "throttled")
    assert pacer.rate == 5.0
    pacer.on_ready(T0 + 12, latency=8.0)  # created at T0 + 4: the old regime
    pacer.on_ready(T0 + 13, latency=9.0)
    assert pacer.rate == 5.0
    assert pacer.latency is None
    pacer.on_ready(T0 + 16, latency=6.0)  # created at T0 + 10: counts
    assert pacer.rate == 2.5


def test_no_increase_while_latency_is_above_target() -> None:
    cfg = growing(latency_target=0.5, latency_alpha=1.0, cooldown=100.0)
    pacer: Pacer[int] = Pacer(cfg, now=T0)
    pacer.enqueue("a", 1)
    pacer.on_failed(T0, "throttled")
    pacer.on_ready(T0 + 0.75, latency=0.75)  # too slow, but within cooldown: no decrease
    assert (pacer.rate, pacer.latency) == (5.0, 0.75)
    for t in range(2, 10):
        pacer.next(T0 + t)
    assert pacer.rate == 5.0


# -- time and stats -------------------------------------------------------------------------


def test_time_never_runs_backwards() -> None:
    pacer: Pacer[int] = Pacer(replace(LOOSE, rate=10.0, burst=1), now=T0)
    for i in range(10):
        pacer.enqueue("a", i)
    assert pacer.next(T0 + 1) == 0
    assert pacer.next(T0) is None
    assert pacer.wait_time(T0) == pytest.approx(0.1)
    assert pacer.next(T0 + 1.1) == 1


def test_stats() -> None:
    pacer: Pacer[int] = Pacer(replace(PacingConfig(), burst=3), now=T0)
    pacer.enqueue("a", 1)
    pacer.enqueue("a", 2)
    pacer.next(T0)
    stats = pacer.stats()
    assert set(stats) == {
        "rate",
        "window",
        "in_flight",
        "queued",
        "tokens",
        "paused_until",
        "latency",
    }
    assert stats["rate"] == 50.0
    assert stats["window"] == 64.0
    assert stats["in_flight"] == 1.0
    assert stats["queued"] == 1.0
    assert stats["tokens"] == 2.0
    assert stats["paused_until"] == T0
    assert math.isnan(stats["latency"])


# -- properties -----------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def configs(draw: st.DrawFn) -> PacingConfig:
    min_rate = draw(st.floats(0.5, 5.0))
    max_rate = draw(st.floats(min_rate, 30.0))
    min_window = draw(st.integers(1, 4))
    max_window = draw(st.integers(min_window, 12))
    return PacingConfig(
        rate=draw(st.floats(min_rate, max_rate)),
        burst=draw(st.integers(1, 8)),
        min_rate=min_rate,
        max_rate=max_rate,
        window=draw(st.integers(min_window, max_window)),
        min_window=min_window,
        max_window=max_window,
        increase_rate=draw(st.floats(0.0, 10.0)),
        increase_window=draw(st.integers(0, 4)),
        decrease=draw(st.floats(0.1, 0.9)),
        healthy_interval=draw(st.floats(0.1, 2.0)),
        latency_target=draw(st.floats(0.5, 5.0)),
        cooldown=draw(st.floats(0.0, 2.0)),
        latency_alpha=draw(st.floats(0.05, 1.0)),
    )


class PacerMachine(RuleBasedStateMachine):
    """A model of what the pool sees, checked against the pacer after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.cfg = PacingConfig()
        self.pacer: Pacer[int] = Pacer(self.cfg, now=self.now)
        self.counter = 0
        self.queued: dict[int, str] = {}  # request -> client
        self.seen: set[int] = set()  # returned or cancelled: never to be returned again
        self.in_flight = 0
        self.creates: list[float] = []
        # (time, rate from then on): the rate is piecewise constant between calls.
        self.rates: list[tuple[float, float]] = [(self.now, self.cfg.rate)]
        self.paused_until = self.now

    @initialize(cfg=configs())
    def start(self, cfg: PacingConfig) -> None:
        self.cfg = cfg
        self.pacer = Pacer(cfg, now=self.now)
        self.rates = [(self.now, cfg.rate)]

    def record_rate(self) -> None:
        self.rates.append((self.now, self.pacer.rate))

    def allowed(self, start: float, end: float) -> float:
        """Creates the bucket can allow in [start, end]: burst plus the integral of the rate."""
        total = float(self.cfg.burst)
        for i, (t, rate) in enumerate(self.rates):
            t_next = self.rates[i + 1][0] if i + 1 < len(self.rates) else math.inf
            lo, hi = max(t, start), min(t_next, end)
            if hi > lo:
                total += rate * (hi - lo)
        return total

    @rule(client=st.sampled_from(["a", "b", "c"]))
    def enqueue(self, client: str) -> None:
        self.counter += 1
        self.pacer.enqueue(client, self.counter)
        self.queued[self.counter] = client

    @precondition(lambda self: self.counter > 0)
    @rule(pick=st.integers(min_value=1))
    def cancel(self, pick: int) -> None:
        request = (pick - 1) % self.counter + 1
        was_queued = request in self.queued
        assert self.pacer.cancel(request) is was_queued
        if was_queued:
            del self.queued[request]
            self.seen.add(request)

    @rule()
    def next(self) -> None:
        wait = self.pacer.wait_time(self.now)
        request = self.pacer.next(self.now)
        self.record_rate()
        assert (request is not None) == (wait == 0.0), (request, wait)
        if request is None:
            return
        assert request in self.queued, "returned a request that is not queued"
        assert request not in self.seen, "returned a cancelled or already returned request"
        assert self.now >= self.paused_until - 1e-6, "created during a Retry-After pause"
        del self.queued[request]
        self.seen.add(request)
        self.in_flight += 1
        assert self.pacer.in_flight <= self.pacer.window, "a create beyond the window"
        self.creates.append(self.now)
        # Every span ending with this create: the brief's bound, and the tighter bucket bound.
        n = len(self.creates)
        for i, start in enumerate(self.creates):
            count = n - i
            span = self.now - start
            assert count <= self.cfg.burst + self.cfg.max_rate * span + 1e-6
            assert count <= self.allowed(start, self.now) + 1e-6

    @rule()
    def wait_then_next(self) -> None:
        wait = self.pacer.wait_time(self.now)
        if wait is None:
            return
        assert wait >= 0.0
        if wait > 1e-6:
            self.now += wait / 2
            assert self.pacer.next(self.now) is None, "next() before wait_time() said it could"
            self.record_rate()
            wait = self.pacer.wait_time(self.now)
            assert wait is not None
        self.now += wait
        created = len(self.creates)
        self.next()
        assert len(self.creates) == created + 1, "wait_time() promised a create"

    @precondition(lambda self: self.in_flight > 0)
    @rule(latency=st.floats(0.0, 10.0))
    def on_ready(self, latency: float) -> None:
        self.pacer.on_ready(self.now, latency)
        self.in_flight -= 1
        self.record_rate()

    @precondition(lambda self: self.in_flight > 0)
    @rule(
        kind=st.sampled_from(get_args(FailureKind)),
        retry_after=st.none() | st.floats(0.0, 3.0),
    )
    def on_failed(self, kind: FailureKind, retry_after: float | None) -> None:
        self.pacer.on_failed(self.now, kind, retry_after)
        self.in_flight -= 1
        if retry_after:
            self.paused_until = max(self.paused_until, self.now + retry_after)
        self.record_rate()

    @precondition(lambda self: self.in_flight > 0)
    @rule()
    def on_abandoned(self) -> None:
        self.pacer.on_abandoned(self.now)
        self.in_flight -= 1
        self.record_rate()

    @rule(dt=st.floats(0.0, 1.5))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def bounds(self) -> None:
        cfg, pacer = self.cfg, self.pacer
        assert cfg.min_rate <= pacer.rate <= cfg.max_rate
        assert cfg.min_window <= pacer.window <= cfg.max_window
        tokens = pacer.stats()["tokens"]
        assert 0.0 <= tokens <= cfg.burst

    @invariant()
    def books_agree(self) -> None:
        assert self.pacer.in_flight == self.in_flight
        assert self.pacer.queued() == len(self.queued)
        for client in ("a", "b", "c"):
            expected = sum(1 for c in self.queued.values() if c == client)
            assert self.pacer.queued(client) == expected


def test_state_machine() -> None:
    run_state_machine_as_test(
        PacerMachine,
        settings=settings(PROPERTY_SETTINGS, stateful_step_count=40),
    )


@PROPERTY_SETTINGS
@given(
    big_first=st.booleans(),
    served_before=st.integers(0, 200),
    interleave=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_a_small_client_is_not_starved_by_a_big_one(
    big_first: bool, served_before: int, interleave: list[bool]
) -> None:
    """Two clients, 5,000 requests and 10: the 10 come out within the first ~20 results."""
    pacer: Pacer[tuple[str, int]] = Pacer(LOOSE, now=T0)
    big = [("big", i) for i in range(5000)]
    small = [("small", i) for i in range(10)]
    if big_first:
        for request in big:
            pacer.enqueue("big", request)
        served = [pacer.next(T0) for _ in range(served_before)]
        assert all(r is not None and r[0] == "big" for r in served)
        # The small client's requests arrive one by one, some with a next() in between.
        results: list[tuple[str, int] | None] = []
        for request, step in zip(small, interleave, strict=True):
            pacer.enqueue("small", request)
            if step:
                results.append(pacer.next(T0))
    else:
        for request in small:
            pacer.enqueue("small", request)
        for request in big:
            pacer.enqueue("big", request)
        results = []
    while len([r for r in results if r is not None and r[0] == "small"]) < 10:
        results.append(pacer.next(T0))
        assert len(results) <= 20, "the small client waited more than one turn per request"
    got = [r for r in results if r is not None and r[0] == "small"]
    assert got == small  # and in its own order
