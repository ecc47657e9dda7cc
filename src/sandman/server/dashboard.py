"""The live dashboard: a sampler of the pool and the static page at ``/`` that draws it.

The `Sampler` keeps one sample a second in a ring buffer (``Pool.stats()`` plus
the pool events of that second), the readiness latencies and the recent
backend errors; ``GET /v1/dashboard`` answers `Sampler.view`. The page (HTML,
JS and CSS in ``static/``, no build step, nothing fetched from elsewhere) polls
that route every second and draws with plain SVG.

Besides the pool's events, the service tells the sampler what it refused
itself (`Sampler.refused`: tenant limits, malformed requests, expired
sessions), and the sampler asks the service for its acquires waiting per
tenant (``queue_depths``).

Who sees what: the page is public HTML holding no data. Its data needs an API
key like every other route; the page asks for one and keeps it in the
browser's ``localStorage`` (with ``anonymous_tenant`` set it needs none). Every
key sees the pool-wide aggregates (states, pacing, rates, readiness latency:
the numbers ``/metrics`` publishes without a key); sandboxes per image, waiting
acquires and error messages only of its own tenant; the other tenants are one
group. Keys of an operator tenant (``admins``, ``ServerSettings.admin_tenants``)
see every tenant, image and error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI
from starlette.responses import Response

from sandman import errors
from sandman.pool import Pool, PoolEvent, Record
from sandman.server.metrics import STATES
from sandman.server.schemas import (
    DashboardError,
    DashboardGroup,
    DashboardOut,
    DashboardSample,
    LatencyBucket,
    PacingOut,
)
from sandman.server.service import tenant_of

__all__ = ["BUCKETS", "NO_TENANT", "OTHER_TENANTS", "REFUSALS", "Sampler", "install_page"]

OTHER_TENANTS = "other tenants"
NO_TENANT = "no tenant"
"""The operator view's group of sandboxes the service did not hand out (warm spares, adopted)."""
REFUSALS = frozenset(
    {
        "tenant_sandbox_limit",
        "tenant_pending_limit",
        "session_expired",
        "invalid_request",
        "malformed_json",
    }
)
"""Error codes `Sampler.refused` keeps: the service's own refusals. Backend failures
(an unknown image included) arrive as pool events (``create.failed``) instead."""
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the readiness histogram; one more bucket holds the rest."""
_LIVE = tuple(s for s in STATES if s not in ("queued", "gone"))
_ERROR_EVENTS = ("create.failed", "delete.failed", "reconcile.failed", "sandbox.lost")
_COUNTED = {"create.started": "started", "create.complete": "completed",
            "create.failed": "failed", "delete.complete": "deleted",
            "sandbox.lost": "lost"}  # fmt: skip
_MAX_REASONS = 32  # distinct reasons of lost sandboxes counted apart; the rest as "other"
_MESSAGE_MAX = 500


@dataclass(frozen=True)
class _Error:
    at: float
    event: str
    sandbox_id: str | None
    tenant: str | None
    image: str | None
    kind: str | None
    message: str


class Sampler:
    """Samples ``pool`` every ``interval`` seconds, keeping the last ``keep`` samples.

    Give `hook` every pool event (``pool.add_hook(sampler.hook)``). The sampling
    task starts with the first event or `view` on the pool's loop (so an app
    needs no start-up step) and ends with `aclose` or that loop.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        interval: float = 1.0,
        keep: int = 600,
        keep_errors: int = 50,
        keep_latencies: int = 10_000,
        owner: Callable[[Record], str | None] = tenant_of,
        queue_depths: Callable[[], Mapping[str, int]] = dict,
        admins: Collection[str] = (),
    ) -> None:
        if interval <= 0 or keep < 1:
            raise ValueError("the sampler needs interval > 0 and keep >= 1")
        self.pool = pool
        self.interval = interval
        self.admins = frozenset(admins)
        self._owner = owner
        self._queue_depths = queue_depths
        self._samples: deque[DashboardSample] = deque(maxlen=keep)
        self._counts: Counter[str] = Counter()
        self._lost: Counter[str] = Counter()  # since the start, by reason
        self._latencies: deque[tuple[float, float]] = deque(maxlen=keep_latencies)
        self._errors: deque[_Error] = deque(maxlen=keep_errors)
        # Apart, so a client sending garbage cannot push the backend's errors out.
        self._refusals: deque[_Error] = deque(maxlen=keep_errors)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- input --------------------------------------------------------------------------

    def hook(self, event: PoolEvent) -> None:
        """Count one pool event (cheap: called on the pool's loop)."""
        self._ensure_running()
        counted = _COUNTED.get(event.name)
        if counted is not None:
            self._counts[counted] += 1
        if event.name == "create.complete":
            seconds = event.detail.get("seconds")
            if isinstance(seconds, int | float) and math.isfinite(seconds):
                self._latencies.append((event.at, max(0.0, float(seconds))))
        if event.name == "sandbox.lost":
            reason = str(event.detail.get("reason", "unknown"))
            if reason not in self._lost and len(self._lost) >= _MAX_REASONS:
                reason = "other"
            self._lost[reason] += 1
        if event.name in _ERROR_EVENTS:
            self._errors.appendleft(self._error(event))

    def _error(self, event: PoolEvent) -> _Error:
        tenant = image = None
        if event.sandbox_id is not None:
            with contextlib.suppress(errors.SandboxNotFound):
                record = self.pool.get(event.sandbox_id)
                tenant, image = self._owner(record), record.spec.image
        # The cause (image_not_found...) where the pool names one; the pacer's kind of
        # failure (throttled, capacity...) says less.
        kind = event.detail.get("cause") or event.detail.get("kind") or event.detail.get("reason")
        message = str(event.detail.get("error") or event.detail.get("detail") or event.name)
        return _Error(
            at=event.at,
            event=event.name,
            sandbox_id=event.sandbox_id,
            tenant=tenant,
            image=image,
            kind=None if kind is None else str(kind),
            message=message[:_MESSAGE_MAX],
        )

    def refused(
        self,
        tenant: str,
        code: str,
        message: str,
        *,
        image: str | None = None,
        at: float | None = None,
    ) -> None:
        """The service refused a request of ``tenant`` with ``code``; kept if in `REFUSALS`."""
        if code not in REFUSALS:
            return
        refusal = _Error(
            at=time.time() if at is None else at,
            event="refused",
            sandbox_id=None,
            tenant=tenant,
            image=image,
            kind=code,
            message=message[:_MESSAGE_MAX],
        )
        self._refusals.appendleft(refusal)

    def sample(self, now: float) -> DashboardSample:
        """Take one sample at ``now`` (wall clock): the pool now, the events since the last."""
        stats = self.pool.stats()
        taken = DashboardSample(
            t=now,
            states=_states(stats),
            pacing=_pacing(stats),
            started=self._counts["started"],
            completed=self._counts["completed"],
            failed=self._counts["failed"],
            deleted=self._counts["deleted"],
            lost=self._counts["lost"],
        )
        self._counts.clear()
        self._samples.append(taken)
        return taken

    # -- the sampling task --------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a plain call): nothing to sample on
        self._task = loop.create_task(self._run(), name="sandman-dashboard-sampler")

    async def _run(self) -> None:
        # On a fixed grid, so a slow sample does not shift every later one.
        start = time.monotonic()
        ticks = 0
        while True:
            ticks = max(ticks + 1, int((time.monotonic() - start) / self.interval) + 1)
            await asyncio.sleep(max(0.0, start + ticks * self.interval - time.monotonic()))
            self.sample(time.time())

    @property
    def running(self) -> bool:
        """Whether the sampling task runs now."""
        return self._task is not None and not self._task.done()

    async def aclose(self) -> None:
        """Stop sampling (for good)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- output -------------------------------------------------------------------------

    def view(
        self, tenant: str, *, now: float, seconds: float = 300.0, admin: bool | None = None
    ) -> DashboardOut:
        """What ``tenant`` sees: the last ``seconds`` of samples and the pool now.

        ``admin`` (by default: whether ``tenant`` is in `admins`) shows every
        tenant apart, every image and every error."""
        self._ensure_running()
        admin = tenant in self.admins if admin is None else admin
        since = now - seconds

        def group_of(owner: str | None) -> str:
            if admin:
                return NO_TENANT if owner is None else owner
            return tenant if owner == tenant else OTHER_TENANTS

        stats = self.pool.stats()
        groups: dict[str, Counter[str]] = {tenant: Counter()}
        if not admin:
            groups[OTHER_TENANTS] = Counter()
        waiting: Counter[str] = Counter()
        images: dict[str, Counter[str]] = {}
        for record in self.pool.list():
            if record.state == "gone":
                continue
            owner = self._owner(record)
            groups.setdefault(group_of(owner), Counter())[record.state] += 1
            if admin or owner == tenant:
                images.setdefault(record.spec.image, Counter())[record.state] += 1
        for owner, n in self._queue_depths().items():
            if n > 0:
                waiting[group_of(owner)] += n
                groups.setdefault(group_of(owner), Counter())
        tenants = [_group(name, counts, waiting[name]) for name, counts in groups.items()]
        if admin:  # the caller's tenant first, then the busiest
            tenants.sort(key=lambda g: (g.name != tenant, -g.total - g.waiting, g.name))
        latencies = sorted(s for at, s in self._latencies if at >= since)
        shown = sorted(
            (
                e
                for e in (*self._errors, *self._refusals)
                if e.at >= since and (admin or e.tenant in (None, tenant))
            ),
            key=lambda e: -e.at,
        )
        return DashboardOut(
            pool=self.pool.config.name,
            provider=self.pool.provider.name,
            tenant=tenant,
            admin=admin,
            now=now,
            interval=self.interval,
            states=_states(stats),
            sessions=int(stats.get("sessions", 0)),
            snapshots=int(stats.get("snapshots", 0)),
            pacing=_pacing(stats),
            lost=dict(self._lost),
            samples=[s for s in self._samples if s.t >= since],
            tenants=tenants,
            images=sorted(
                (_group(name, counts) for name, counts in images.items()),
                key=lambda g: (-g.total, g.name),
            ),
            readiness=_histogram(latencies),
            readiness_count=len(latencies),
            readiness_p50=_quantile(latencies, 0.5),
            readiness_p95=_quantile(latencies, 0.95),
            errors=[
                DashboardError(
                    at=e.at,
                    event=e.event,
                    sandbox_id=e.sandbox_id,
                    image=e.image,
                    kind=e.kind,
                    message=e.message,
                    tenant=e.tenant,
                )
                for e in shown
            ],
        )


def _number(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those are None."""
    return value if value is not None and math.isfinite(value) else None


def _states(stats: dict[str, float]) -> dict[str, int]:
    states: dict[str, int] = {state: int(stats.get(state, 0)) for state in _LIVE}
    # Requests waiting for the pacer are sandboxes not yet made: the state machine's QUEUED.
    queued = _number(stats.get("pacing_queued"))
    return {"queued": int(stats.get("queued", 0) + (queued or 0)), **states}


def _pacing(stats: dict[str, float]) -> PacingOut:
    def get(key: str) -> float | None:
        return _number(stats.get(f"pacing_{key}"))

    return PacingOut(
        rate=get("rate"),
        window=get("window"),
        in_flight=get("in_flight"),
        queued=get("queued"),
        latency=get("latency"),
    )


def _group(name: str, counts: Counter[str], waiting: int = 0) -> DashboardGroup:
    states = {state: counts[state] for state in _LIVE if counts[state]}
    return DashboardGroup(name=name, states=states, total=sum(states.values()), waiting=waiting)


def _histogram(latencies: list[float]) -> list[LatencyBucket]:
    counts = [0] * (len(BUCKETS) + 1)
    for seconds in latencies:
        counts[next((i for i, le in enumerate(BUCKETS) if seconds <= le), len(BUCKETS))] += 1
    bounds: list[float | None] = [*BUCKETS, None]
    return [LatencyBucket(le=le, count=n) for le, n in zip(bounds, counts, strict=True)]


def _quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted values; None for none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- the page -------------------------------------------------------------------------

_ASSETS = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# The page loads only its own script and style and talks only to this service;
# user-supplied strings (image names, error messages) are set as text, never as HTML.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def install_page(app: FastAPI) -> None:
    """Serve the dashboard page at ``/`` (and its script and style); not in the API schema."""
    static = resources.files("sandman.server").joinpath("static")
    for path, (name, media_type) in _ASSETS.items():
        body = static.joinpath(name).read_bytes()

        async def asset(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        app.add_api_route(path, asset, methods=["GET"], include_in_schema=False)
