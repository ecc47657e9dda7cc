"""Prometheus metrics of one pool, fed by its lifecycle events and ``Pool.stats()``.

Names follow the Prometheus conventions: ``sandman_`` prefix, seconds as the
unit, ``_total`` on counters. Each `Metrics` has its own registry, so several
services (or tests) in one process do not collide.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandman import errors
from sandman.pool import Pool, PoolEvent
from sandman.pool.records import LABEL_TENANT, State
from sandman.server.errors import ApiError
from sandman.server.settings import ServerSettings

__all__ = ["CONTENT_TYPE", "STATES", "Metrics", "check_scrape"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES: tuple[State, ...] = (
    "queued", "creating", "starting", "ready", "leased", "releasing", "failed", "gone", "lost",
)  # fmt: skip

# Sandbox creation spans milliseconds (warm, fake) to minutes (image pulls, busy clusters).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# The pacer's gauges: name, help and their key in ``Pool.stats()`` (NaN when it is missing).
_PACING = (
    ("sandman_pacing_rate", "Create calls per second the pacer allows now.", "pacing_rate"),
    ("sandman_pacing_window", "Most sandboxes created but not yet ready, now.", "pacing_window"),
    ("sandman_pacing_in_flight", "Sandboxes created but not yet ready.", "pacing_in_flight"),
    ("sandman_pacing_queued", "Requests waiting for the pacer.", "pacing_queued"),
    (
        "sandman_pacing_latency_seconds",
        "The pacer's running average of readiness latency.",
        "pacing_latency",
    ),
)


class _PoolCollector(Collector):
    """Gauges read at scrape time: sandboxes per state, sessions, pacing, queue depth."""

    def __init__(
        self, pool: Pool, queue_depths: Callable[[], Mapping[str, int]], tenant_labels: bool
    ) -> None:
        self._pool = pool
        self._queue_depths = queue_depths
        self._tenant_labels = tenant_labels

    def collect(self) -> Iterator[Metric]:
        stats = self._pool.stats()
        pool = self._pool.config.name
        states = GaugeMetricFamily(
            "sandman_sandboxes", "Sandboxes the pool knows, per state.", labels=["pool", "state"]
        )
        for state in STATES:
            states.add_metric([pool, state], stats.get(state, 0.0))
        yield states
        yield _gauge("sandman_sessions", "Open client sessions.", pool, stats.get("sessions", 0))
        yield _gauge(
            "sandman_snapshots", "Snapshots the pool keeps.", pool, stats.get("snapshots", 0)
        )
        for name, documentation, key in _PACING:
            yield _gauge(name, documentation, pool, stats.get(key, math.nan))
        depths = self._queue_depths()
        if not self._tenant_labels:
            yield _gauge(
                "sandman_queue_depth",
                "Acquires waiting at the service.",
                pool,
                sum(depths.values()),
            )
            return
        depth = GaugeMetricFamily(
            "sandman_queue_depth",
            "Acquires waiting at the service, per tenant.",
            labels=["pool", "tenant"],
        )
        for tenant, n in sorted(depths.items()):
            depth.add_metric([pool, tenant], n)
        yield depth


def _tenant(pool: Pool, sandbox_id: str) -> str:
    try:
        record = pool.get(sandbox_id)
    except errors.SandboxNotFound:
        return ""
    return record.spec.labels.get(LABEL_TENANT) or record.labels.get(LABEL_TENANT) or ""


def _gauge(name: str, documentation: str, pool: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["pool"])
    gauge.add_metric([pool], value)
    return gauge


class Metrics:
    """Prometheus metrics of ``pool``; `hook` is given every pool event (``Pool.add_hook``).

    Latencies, from the pool's own timeline of each sandbox:
    ``sandman_create_seconds`` (create called -> the backend accepted),
    ``sandman_ready_seconds`` (create called -> daemon ready),
    ``sandman_delete_seconds`` (released -> the backend confirmed gone),
    ``sandman_acquire_seconds`` (an acquire at the service, until answered).

    ``sandman_sandboxes_lost_total`` counts sandboxes that died by themselves (OOM, a
    crash, killed, evicted, preempted, their node lost...), by ``reason``
    (`sandman.SandboxLost.REASONS`, each there from the start at 0).

    No series names a tenant unless ``tenant_labels`` (then ``sandman_queue_depth``
    has a ``tenant`` label; `ServerSettings.metrics_tenant_labels`).
    """

    def __init__(
        self,
        pool: Pool,
        queue_depths: Callable[[], Mapping[str, int]] = dict,
        *,
        tenant_labels: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pool = pool
        labels = ["pool"]
        self.create_seconds = Histogram(
            "sandman_create_seconds",
            "From the create call until the backend accepted it.",
            labels,
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.ready_seconds = Histogram(
            "sandman_ready_seconds",
            "From the create call until the sandbox's daemon was ready.",
            labels,
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.delete_seconds = Histogram(
            "sandman_delete_seconds",
            "From release until the backend confirmed the sandbox gone.",
            labels,
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.acquire_seconds = Histogram(
            "sandman_acquire_seconds",
            "Acquires at the service, until answered, by outcome.",
            [*labels, "outcome"],
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.backend_errors = Counter(
            "sandman_backend_errors",
            "Failed backend calls, by operation and kind.",
            [*labels, "operation", "kind"],
            registry=self.registry,
        )
        self.lost = Counter(
            "sandman_sandboxes_lost",
            "Sandboxes that died by themselves, by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )
        for reason in errors.SandboxLost.REASONS:
            # Every reason from the start, at 0: a rate over them works before the first loss.
            self.lost.labels(pool.config.name, reason)
        self.events = Counter(
            "sandman_pool_events",
            "Pool lifecycle events, by name.",
            [*labels, "event"],
            registry=self.registry,
        )
        # What released sandboxes used (the rollouts' cost), read just before each delete.
        usage_labels = [*labels, "tenant"] if tenant_labels else labels
        self._tenant_labels = tenant_labels
        self.usage_cpu = Counter(
            "sandman_usage_cpu_seconds",
            "CPU seconds used by sandboxes, counted at their delete.",
            usage_labels,
            registry=self.registry,
        )
        self.usage_disk = Counter(
            "sandman_usage_disk_bytes",
            "Bytes sandboxes held in their writable layer at their delete.",
            usage_labels,
            registry=self.registry,
        )
        self.usage_network = Counter(
            "sandman_usage_network_bytes",
            "Bytes sandboxes received (rx) and sent (tx), counted at their delete.",
            [*usage_labels, "direction"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pool, queue_depths, tenant_labels))
        self._started: dict[str, float] = {}
        self._released: dict[str, float] = {}

    def hook(self, event: PoolEvent) -> None:
        """Turn one pool event into metrics (cheap: called on the pool's loop)."""
        pool = event.pool
        self.events.labels(pool, event.name).inc()
        sid = event.sandbox_id or ""
        if event.name == "create.started":
            self._started[sid] = event.at
        elif event.name == "create.complete":
            started = self._started.pop(sid, None)
            if started is not None:
                self.ready_seconds.labels(pool).observe(max(0.0, event.at - started))
            self._observe_create(pool, sid)
        elif event.name == "create.failed":
            self._started.pop(sid, None)
            self.backend_errors.labels(pool, "create", str(event.detail.get("kind", "other"))).inc()
        elif event.name == "sandbox.released":
            self._released[sid] = event.at
        elif event.name == "sandbox.usage":
            self._count_usage(pool, sid, event.detail)
        elif event.name == "delete.failed":
            self.backend_errors.labels(pool, "delete", "other").inc()
        elif event.name == "delete.complete":
            released = self._released.pop(sid, None)
            if released is not None:
                self.delete_seconds.labels(pool).observe(max(0.0, event.at - released))
        elif event.name == "reconcile.failed":
            self.backend_errors.labels(pool, "list", "other").inc()
        elif event.name == "sandbox.lost":
            self.lost.labels(pool, str(event.detail.get("reason", "unknown"))).inc()

    def _count_usage(self, pool: str, sandbox_id: str, detail: Mapping[str, object]) -> None:
        labels = [pool, _tenant(self._pool, sandbox_id)] if self._tenant_labels else [pool]
        for counter, key in ((self.usage_cpu, "cpu_seconds"), (self.usage_disk, "disk_bytes")):
            value = detail.get(key)
            if isinstance(value, int | float):
                counter.labels(*labels).inc(max(0.0, float(value)))
        for direction in ("rx", "tx"):
            value = detail.get(f"net_{direction}_bytes")
            if isinstance(value, int | float):
                self.usage_network.labels(*labels, direction).inc(max(0.0, float(value)))

    def _observe_create(self, pool: str, sandbox_id: str) -> None:
        try:
            timeline = self._pool.get(sandbox_id).timeline
        except errors.SandboxNotFound:
            return
        called, accepted = timeline.get("create_called"), timeline.get("accepted")
        if called is not None and accepted is not None:
            self.create_seconds.labels(pool).observe(max(0.0, accepted - called))

    def observe_acquire(self, started: float, outcome: str) -> None:
        """An acquire at the service ended (``ok`` or an error code) after ``started`` (monotonic)."""
        self.acquire_seconds.labels(self._pool.config.name, outcome).observe(
            max(0.0, time.monotonic() - started)
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


def check_scrape(
    authorization: str | None, settings: ServerSettings, authenticate: Callable[[str | None], str]
) -> None:
    """Raise `ApiError` ``unauthorized`` unless this scrape of ``/metrics`` may read them:
    anyone when ``settings.metrics_key`` is unset, else the bearer of that key or of an
    admin tenant's API key (``authenticate`` maps a key to its tenant)."""
    if settings.metrics_key is None:
        return
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise ApiError(
            "unauthorized",
            "metrics need a key: Authorization: Bearer <metrics key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if hmac.compare_digest(key.encode(), settings.metrics_key.get_secret_value().encode()):
        return
    try:
        tenant = authenticate(authorization)
    except ApiError:
        tenant = None
    if tenant is None or tenant not in settings.admin_tenants:
        raise ApiError(
            "unauthorized",
            "this key may not read the metrics",
            headers={"WWW-Authenticate": "Bearer"},
        )
