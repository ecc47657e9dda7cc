"""Pacing: how fast the pool may call the backend's create, and for whom first.

Pure logic. No I/O, no asyncio and no clock reads: every method that depends on
time takes ``now`` (seconds on a monotonic clock). The pool owns one `Pacer` and
calls it from one event loop.

The pacer bounds two things, and both adapt to the backend's health:

**Rate: a token bucket.** The bucket holds at most ``burst`` tokens and refills
at ``rate`` tokens per second. Every create takes one token. The bucket starts
full, so in any span of ``s`` seconds at most ``burst + max_rate * s`` creates
start. Before ``rate`` changes, the bucket is refilled at the old rate up to
``now``, so a change applies from ``now`` on and never retroactively.

**Window: sandboxes created but not yet ready** (``in_flight``). `next` hands
out a request only while ``in_flight < window``. Every request `next` returns
holds one slot until the pool reports its outcome with exactly one of
`on_ready`, `on_failed` or `on_abandoned`. A decrease may leave ``in_flight``
above ``window``; nothing new starts until enough slots are freed.

**Adaptation: additive increase, multiplicative decrease (AIMD).**

- *Trouble* is a failure of kind ``throttled`` (429), ``server_error`` (5xx),
  ``timeout`` or ``capacity``, or a readiness latency above ``latency_target``.
  Trouble multiplies ``rate`` and ``window`` by ``decrease`` (clamped to
  ``min_rate`` / ``min_window``), at most once per ``cooldown`` seconds: a burst
  of 429s is one signal. Every trouble signal, acted on or not, restarts the
  healthy interval. Failures of kind ``other`` (a bad image, a bad spec) say
  nothing about load: they only free the slot.
- *Retry-After.* A failure with ``retry_after`` pauses every create until
  ``now + retry_after``. The bucket is emptied and refills from the end of the
  pause, so creates resume at ``rate`` rather than in a burst.
- *Readiness latency* is an exponentially weighted moving average (weight
  ``latency_alpha``) of the latencies given to `on_ready`. It describes the
  current regime only: a decrease resets it, and a latency from a sandbox
  created before the last decrease (``now - latency < last decrease``) is
  ignored. So the sandboxes already in flight when the pacer backed off cannot
  make it back off again, as TCP reduces its window once per round trip.
- *Healthy* time is time with demand (something queued or in flight), outside
  a pause, with no trouble and a readiness latency at or below target. After each
  ``healthy_interval`` of it, ``rate += increase_rate`` and
  ``window += increase_window`` (clamped to ``max_rate`` / ``max_window``).
  Time is credited when the pacer is called; one call yields at most one step
  (after a long silence the credit restarts), so a pool that went quiet does
  not wake up at full speed.

**Fairness: one FIFO per client, served round robin.** Clients with queued
requests take turns: after a client is served it goes to the back of the line,
and a new client joins at the back. A client with 5,000 queued requests delays
another client's request by at most one turn per other client. `cancel` drops a
queued request in O(1); a cancelled request is never returned by `next`.

**Time** never runs backwards here: a ``now`` earlier than one already seen is
taken as the latest ``now`` seen.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Literal, TypeAlias, TypeVar

from sandman.errors import ConfigError

__all__ = ["FailureKind", "Pacer", "PacingConfig"]

R = TypeVar("R", bound=Hashable)

FailureKind: TypeAlias = Literal["throttled", "server_error", "timeout", "capacity", "other"]
"""Why a create failed, as the provider reports it."""

_TROUBLE: frozenset[str] = frozenset({"throttled", "server_error", "timeout", "capacity"})

# Floating-point slack, so that `next(now + wait_time(now))` succeeds: a token refilled to
# 0.999999999 counts as one, and a pause that ends within a nanosecond has ended.
_EPSILON = 1e-9


@dataclass(frozen=True)
class PacingConfig:
    """How fast the pool may create sandboxes, and how that adapts."""

    rate: float = 50.0
    """Initial create calls per second (token bucket refill)."""
    burst: int = 10
    """Bucket capacity: creates that may start at once."""
    min_rate: float = 1.0
    max_rate: float = 500.0
    window: int = 64
    """Initial maximum of sandboxes created but not yet ready."""
    min_window: int = 4
    max_window: int = 4096
    increase_rate: float = 5.0
    """Added to the rate after each healthy interval."""
    increase_window: int = 4
    """Added to the window after each healthy interval."""
    decrease: float = 0.5
    """Factor applied to rate and window on trouble, in (0, 1)."""
    healthy_interval: float = 1.0
    """Seconds of demand without trouble between additive increases."""
    latency_target: float = 10.0
    """Readiness latency (seconds) above which the pacer backs off."""
    cooldown: float = 1.0
    """At most one decrease per cooldown (seconds)."""
    latency_alpha: float = 0.2
    """Weight of a new sample in the readiness latency average, in (0, 1]."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in (
            "rate",
            "min_rate",
            "max_rate",
            "healthy_interval",
            "latency_target",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, not {value!r}")
        for name in ("increase_rate", "cooldown"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a number >= 0, not {value!r}")
        if self.burst < 1:
            problems.append(f"burst must be >= 1, not {self.burst!r}")
        if self.min_window < 1:
            problems.append(f"min_window must be >= 1, not {self.min_window!r}")
        if self.increase_window < 0:
            problems.append(f"increase_window must be >= 0, not {self.increase_window!r}")
        if not 0 < self.decrease < 1:
            problems.append(f"decrease must be in (0, 1), not {self.decrease!r}")
        if not 0 < self.latency_alpha <= 1:
            problems.append(f"latency_alpha must be in (0, 1], not {self.latency_alpha!r}")
        if not self.min_rate <= self.rate <= self.max_rate:
            problems.append(
                f"need min_rate <= rate <= max_rate, got {self.min_rate} <= {self.rate} "
                f"<= {self.max_rate}"
            )
        if not self.min_window <= self.window <= self.max_window:
            problems.append(
                f"need min_window <= window <= max_window, got {self.min_window} <= "
                f"{self.window} <= {self.max_window}"
            )
        if problems:
            raise ConfigError("invalid PacingConfig: " + "; ".join(problems))


class _Queue(Generic[R]):
    """One client's FIFO. Cancelled entries stay in the deque until they reach its head."""

    __slots__ = ("entries", "live")

    def __init__(self) -> None:
        self.entries: deque[tuple[int, R]] = deque()
        self.live = 0


class Pacer(Generic[R]):
    """Decides which queued request may call create now. See the module docstring.

    ``R`` is the pool's request type (any hashable, e.g. a waiter object); a
    request may be queued once at a time.
    """

    def __init__(self, config: PacingConfig | None = None, now: float = 0.0) -> None:
        self._config = config if config is not None else PacingConfig()
        cfg = self._config
        self._rate = float(cfg.rate)
        self._window = cfg.window
        self._in_flight = 0
        self._clock = now
        # The bucket: `_tokens` as of `_refilled_at`, which is in the future during a pause.
        self._tokens = float(cfg.burst)
        self._refilled_at = now
        self._paused_until = now
        self._last_decrease = -math.inf
        self._healthy_credit = 0.0
        self._latency: float | None = None
        # The fair queue: rotation order of clients with live requests, and where each live
        # request sits (its client and a sequence number, so a re-queued request is not
        # mistaken for its cancelled earlier entry).
        self._queues: OrderedDict[str, _Queue[R]] = OrderedDict()
        self._where: dict[R, tuple[str, int]] = {}
        self._seq = 0

    # -- the queue ------------------------------------------------------------------------

    def enqueue(self, client: str, request: R) -> None:
        """Queue ``request`` at the back of ``client``'s FIFO.

        Raises `ValueError` if ``request`` is already queued.
        """
        if request in self._where:
            raise ValueError(f"request {request!r} is already queued")
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = _Queue()
        self._seq += 1
        queue.entries.append((self._seq, request))
        queue.live += 1
        self._where[request] = (client, self._seq)

    def cancel(self, request: R) -> bool:
        """Drop a queued request (its caller gave up). True if it was queued."""
        place = self._where.pop(request, None)
        if place is None:
            return False
        client = place[0]
        queue = self._queues[client]
        queue.live -= 1
        if queue.live == 0:
            del self._queues[client]
        elif len(queue.entries) > 2 * queue.live + 16:
            # Mostly cancelled: compact, so memory follows the live requests.
            queue.entries = deque(e for e in queue.entries if self._is_live(client, e))
        return True

    def queued(self, client: str | None = None) -> int:
        """Live queued requests: of ``client``, or of everyone."""
        if client is None:
            return len(self._where)
        queue = self._queues.get(client)
        return 0 if queue is None else queue.live

    def next(self, now: float) -> R | None:
        """The next request allowed to call create now, or None.

        A request returned here has taken a token and a window slot; the pool must
        report its outcome with exactly one `on_ready`, `on_failed` or `on_abandoned`.
        """
        now = self._advance(now)
        request: R | None = None
        if self._where and self._in_flight < self._window and self._can_start(now):
            request = self._pop()
            self._tokens = max(0.0, self._tokens - 1)
            self._in_flight += 1
        self._maybe_increase()
        return request

    def wait_time(self, now: float) -> float | None:
        """Seconds until `next` could return a request.

        None when nothing is queued, or when only the window blocks: then a call
        to `on_ready`, `on_failed` or `on_abandoned` is what unblocks it. Does not
        change the pacer.
        """
        if not self._where or self._in_flight >= self._window:
            return None
        now = max(now, self._clock)
        if self._can_start(now):
            return 0.0
        start = max(now, self._refilled_at)
        tokens = self._tokens_at(start)
        ready_at = start if tokens >= 1 - _EPSILON else start + (1 - tokens) / self._rate
        return max(ready_at, self._paused_until) - now

    # -- feedback from the pool -----------------------------------------------------------

    def on_ready(self, now: float, latency: float) -> None:
        """A created sandbox became ready ``latency`` seconds after its create started."""
        self._advance(now)
        self._release()
        if math.isfinite(latency):
            self._observe_latency(max(0.0, latency))
        self._maybe_increase()

    def on_failed(self, now: float, kind: FailureKind, retry_after: float | None = None) -> None:
        """A create failed (or its sandbox never became ready).

        Frees the slot. ``throttled``, ``server_error``, ``timeout`` and
        ``capacity`` are trouble; ``retry_after`` (seconds, from the backend)
        pauses every create until ``now + retry_after``.
        """
        now = self._advance(now)
        self._release()
        if kind in _TROUBLE:
            self._trouble()
        if retry_after is not None and math.isfinite(retry_after) and retry_after > 0:
            until = now + retry_after
            if until > self._paused_until:
                self._paused_until = until
                self._tokens = 0.0
                self._refilled_at = until
        self._maybe_increase()

    def on_abandoned(self, now: float) -> None:
        """A slot freed without a signal (e.g. the sandbox was deleted before ready)."""
        self._advance(now)
        self._release()
        self._maybe_increase()

    # -- observation ----------------------------------------------------------------------

    @property
    def config(self) -> PacingConfig:
        return self._config

    @property
    def rate(self) -> float:
        """Current create calls per second."""
        return self._rate

    @property
    def window(self) -> int:
        """Current maximum of sandboxes created but not yet ready."""
        return self._window

    @property
    def in_flight(self) -> int:
        """Sandboxes returned by `next` whose outcome has not been reported."""
        return self._in_flight

    @property
    def latency(self) -> float | None:
        """Readiness latency average of the current regime, or None before any sample."""
        return self._latency

    @property
    def paused_until(self) -> float:
        """No create starts before this time (Retry-After)."""
        return self._paused_until

    def stats(self) -> dict[str, float]:
        """Gauges for metrics, as of the last call that passed ``now``.

        ``latency`` is NaN until the current regime has a sample.
        """
        return {
            "rate": self._rate,
            "window": float(self._window),
            "in_flight": float(self._in_flight),
            "queued": float(len(self._where)),
            "tokens": self._tokens,
            "paused_until": self._paused_until,
            "latency": math.nan if self._latency is None else self._latency,
        }

    # -- internals ------------------------------------------------------------------------

    def _advance(self, now: float) -> float:
        """Move the clock to ``now``: refill the bucket, credit healthy time."""
        if now <= self._clock:
            return self._clock
        if self._where or self._in_flight:
            # Demand, and not paused: a pause observes nothing about the backend's health.
            self._healthy_credit += max(0.0, now - max(self._clock, self._paused_until))
        self._clock = now
        self._refill(now)
        return now

    def _can_start(self, now: float) -> bool:
        """Pause over and a token in the bucket at ``now`` (the window is checked apart)."""
        return now + _EPSILON >= self._paused_until and self._tokens_at(now) >= 1 - _EPSILON

    def _tokens_at(self, t: float) -> float:
        if t <= self._refilled_at:
            return self._tokens
        burst = float(self._config.burst)
        return min(burst, self._tokens + self._rate * (t - self._refilled_at))

    def _refill(self, now: float) -> None:
        if now > self._refilled_at:
            self._tokens = self._tokens_at(now)
            self._refilled_at = now

    def _release(self) -> None:
        # Clamped: a surplus report must not open the window beyond its size.
        self._in_flight = max(0, self._in_flight - 1)

    def _observe_latency(self, latency: float) -> None:
        if self._clock - latency < self._last_decrease:
            return  # created before the last decrease: describes the old regime
        if self._latency is None:
            self._latency = latency
        else:
            alpha = self._config.latency_alpha
            self._latency += alpha * (latency - self._latency)
        if self._latency > self._config.latency_target:
            self._trouble()

    def _trouble(self) -> None:
        cfg = self._config
        self._healthy_credit = 0.0
        if self._clock - self._last_decrease < cfg.cooldown:
            return
        self._last_decrease = self._clock
        self._refill(self._clock)  # tokens so far accrued at the old rate
        self._rate = max(cfg.min_rate, self._rate * cfg.decrease)
        self._window = max(cfg.min_window, math.floor(self._window * cfg.decrease))
        self._latency = None

    def _maybe_increase(self) -> None:
        cfg = self._config
        credit = self._healthy_credit
        if credit < cfg.healthy_interval:
            return
        if self._latency is not None and self._latency > cfg.latency_target:
            return  # not healthy; the credit waits for the next on_ready to decide
        self._refill(self._clock)
        self._rate = min(cfg.max_rate, self._rate + cfg.increase_rate)
        self._window = min(cfg.max_window, self._window + cfg.increase_window)
        leftover = credit - cfg.healthy_interval
        self._healthy_credit = leftover if leftover < cfg.healthy_interval else 0.0

    def _is_live(self, client: str, entry: tuple[int, R]) -> bool:
        return self._where.get(entry[1]) == (client, entry[0])

    def _pop(self) -> R:
        """Serve the client at the front of the rotation; it goes to the back."""
        client, queue = next(iter(self._queues.items()))
        while True:
            entry = queue.entries.popleft()
            if self._is_live(client, entry):
                break
        request = entry[1]
        del self._where[request]
        queue.live -= 1
        if queue.live == 0:
            del self._queues[client]
        else:
            self._queues.move_to_end(client)
        return request
