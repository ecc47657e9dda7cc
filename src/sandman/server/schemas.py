"""Request and response bodies of the service's JSON API (v1)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandman.models import SandboxSpec, Snapshot
from sandman.pool.records import Record, State

__all__ = [
    "AcquirePending",
    "AcquireRequest",
    "DashboardError",
    "DashboardGroup",
    "DashboardOut",
    "DashboardSample",
    "Endpoint",
    "ErrorBody",
    "ErrorDetail",
    "HealthOut",
    "LatencyBucket",
    "PacingOut",
    "PauseRequest",
    "RestoreRequest",
    "SandboxList",
    "SandboxOut",
    "SandboxPage",
    "SandboxRow",
    "SessionOut",
    "SessionRequest",
    "SnapshotList",
    "SnapshotRequest",
    "WarmRequest",
]


class _In(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class ErrorDetail(_Out):
    code: str
    """Stable; see `sandman.server.errors.STATUS`."""
    message: str
    reason: str | None = None
    """With ``sandbox_lost``: why the sandbox died (``oom``, ``killed``, ``evicted``...)."""


class ErrorBody(_Out):
    error: ErrorDetail


class SessionRequest(_In):
    lease_seconds: float | None = Field(default=None, gt=0, le=86400)
    """How long the session lives without a heartbeat; default: the pool's lease
    (capped by the service's ``max_lease``)."""


class SessionOut(_Out):
    id: str
    lease_seconds: float


class AcquireRequest(_In):
    spec: SandboxSpec
    session: str = Field(min_length=1, max_length=128)
    timeout: float | None = Field(default=None, gt=0, le=86400)
    """Seconds to wait for a ready sandbox (``create_timeout`` after it); None: the
    service's ``max_acquire_timeout``."""
    wait: float | None = Field(default=None, ge=0, le=300)
    """Answer ``202`` (`AcquirePending`) once this many seconds pass without a sandbox
    (at once when the service holds many such requests open): the acquire keeps its
    place, and is asked for again with its ``ticket``. None: the request waits for
    the sandbox, however long (one open request per waiting acquire)."""
    ticket: str | None = Field(default=None, min_length=1, max_length=64)
    """Ask again for the acquire of an `AcquirePending` (its ``spec`` and ``timeout``
    are the first request's)."""


class AcquirePending(_Out):
    """An acquire still waiting (``202``): ask again with ``ticket`` after ``retry_after``
    seconds (also the ``Retry-After`` header), or give it up (``DELETE
    /v1/sandboxes/acquires/{ticket}``). Unasked for ``retry_after`` and 30 s more, it
    is given up."""

    ticket: str
    position: int
    """About how many acquires of this service came before it and are not yet answered."""
    retry_after: float


class Endpoint(_Out):
    """Where the sandbox's daemon listens, and its bearer token."""

    uds: str | None = None
    host: str | None = None
    port: int | None = None
    token: str
    pid: int | None = None
    """With ``uds``: the daemon's pid on the service's host; the socket's peer must be it."""
    proxy: str
    """The service's proxy route to the same daemon (path relative to the service URL)."""


class SandboxOut(_Out):
    id: str
    state: State
    session: str | None
    image: str
    spec: SandboxSpec
    expires_at: float
    timeline: dict[str, float]
    endpoint: Endpoint | None = None
    """Only in answers about one sandbox (acquire, get), never in lists."""
    running: bool | None = None
    """With ``probe=true``: whether the backend says the sandbox is running."""
    lost_reason: str | None = None
    """In state ``lost`` (it died by itself): why, ``oom``, ``killed``, ``evicted``,
    ``preempted``, ``node_lost``, ``deleted``, ``daemon_exit`` or ``unknown``."""
    lost_detail: str | None = None
    """In state ``lost``: what the backend said of it, in a sentence."""


class SandboxList(_Out):
    sandboxes: list[SandboxOut]


class SandboxRow(_Out):
    """One live sandbox on the dashboard: what it is and what it uses now."""

    id: str
    state: State
    image: str
    age: float
    """Seconds since its create was called."""
    session: str | None = None
    cpu_seconds: float | None = None
    memory_bytes: int | None = None


class SandboxPage(_Out):
    """One page of the tenant's live sandboxes, oldest first."""

    total: int
    page: int
    size: int
    sandboxes: list[SandboxRow]


class SnapshotRequest(_In):
    """Keep a leased sandbox's files (with ``memory``, its processes too)."""

    memory: bool = False
    ttl: float | None = Field(default=None, gt=0, le=30 * 86400)
    """Seconds until it is deleted; None: the pool's sandbox lifetime."""


class WarmRequest(_In):
    """Keep ``count`` ready spares of ``spec`` for the caller's tenant (0 stops)."""

    spec: SandboxSpec
    count: int = Field(ge=0, le=100_000)


class PauseRequest(_In):
    """Pause a leased sandbox; with ``memory``, its processes checkpointed to disk."""

    memory: bool = False


class RestoreRequest(_In):
    """Reset a leased sandbox to one of the tenant's snapshots."""

    snapshot: str = Field(min_length=1, max_length=128)


class SnapshotList(_Out):
    snapshots: list[Snapshot]


class HealthOut(_Out):
    status: Literal["ok", "shutting_down"]
    version: str
    pool: str
    provider: str


class ReadyOut(_Out):
    """``/v1/ready``: whether acquires can be served now, and if not, why."""

    status: Literal["ready", "not_ready"]
    reasons: list[str]
    """Empty when ready; else each reason in a sentence (shutting down, the pool not
    started, the provider not answering)."""


class LiveOut(_Out):
    """``/v1/live``: whether the process is worth keeping (its event loop answered this)."""

    status: Literal["alive", "stopped"]
    reasons: list[str]
    """Empty when alive; else the pool's background loops that ended by themselves."""


class PacingOut(_Out):
    """The pacer now: None where it has no number yet."""

    rate: float | None
    """Create calls per second it allows."""
    window: float | None
    """Most sandboxes created but not yet ready."""
    in_flight: float | None
    """Sandboxes created but not yet ready."""
    queued: float | None
    """Requests waiting for it."""
    latency: float | None
    """Its running average of readiness latency, seconds."""


class DashboardSample(_Out):
    """The pool at one second (``t``, wall clock) and what happened in the second before."""

    t: float
    states: dict[str, int]
    """Sandboxes per state, the whole pool."""
    started: int
    """Create calls started."""
    completed: int
    """Sandboxes that became ready."""
    failed: int
    """Create calls that failed."""
    deleted: int
    """Sandboxes the backend confirmed gone."""
    lost: int = 0
    """Sandboxes that died by themselves (their daemon or pod)."""
    pacing: PacingOut


class DashboardGroup(_Out):
    """Live sandboxes of one tenant or image, per state."""

    name: str
    states: dict[str, int]
    total: int
    waiting: int = 0
    """Acquires of the tenant(s) waiting at the service now (0 for an image)."""


class LatencyBucket(_Out):
    """Sandboxes whose readiness took at most ``le`` seconds (None: any longer) and more
    than the bucket before."""

    le: float | None
    count: int


class DashboardError(_Out):
    """A failed backend call (``create.failed``, ``delete.failed``, ``reconcile.failed``),
    a sandbox that died by itself (``sandbox.lost``, its reason as ``kind``), or a request
    the service refused (``refused``, its error code as ``kind``)."""

    at: float
    event: str
    sandbox_id: str | None
    image: str | None
    kind: str | None
    message: str
    tenant: str | None = None
    """Whose (None: the backend's own)."""


class DashboardOut(_Out):
    """What the dashboard shows. Pool-wide: states, pacing, rates and readiness; the
    caller's tenant only: sandboxes per image and errors (other tenants are one group)."""

    pool: str
    provider: str
    tenant: str
    """The caller's tenant."""
    admin: bool = False
    """An operator's view: every tenant apart, every image, every error."""
    now: float
    interval: float
    """Seconds between samples."""
    states: dict[str, int]
    """Sandboxes per state now, the whole pool."""
    sessions: int
    snapshots: int = 0
    """Snapshots the pool keeps now (every tenant's)."""
    pacing: PacingOut
    lost: dict[str, int] = Field(default_factory=dict)
    """Sandboxes that died by themselves since the service started, by reason (``oom``,
    ``killed``, ``evicted``...), the whole pool."""
    samples: list[DashboardSample]
    """Oldest first, one per ``interval``."""
    tenants: list[DashboardGroup]
    """The caller's tenant, then ``other tenants`` (everyone else and the pool's own spares);
    in an operator's view every tenant apart (``no tenant``: the pool's own)."""
    images: list[DashboardGroup]
    """The caller's (an operator: all) live sandboxes per image, most first."""
    readiness: list[LatencyBucket]
    """Readiness latency (create call until the daemon answered) of the sandboxes made
    within the samples' span, the whole pool."""
    readiness_count: int
    readiness_p50: float | None
    readiness_p95: float | None
    errors: list[DashboardError]
    """Newest first: the caller's and those of no tenant (the backend's own); an
    operator's: all."""


def sandbox_out(
    record: Record, *, endpoint: bool = False, running: bool | None = None
) -> SandboxOut:
    """The wire form of a record; with ``endpoint``, the daemon's address and token too."""
    where = None
    info = record.info
    if endpoint and info is not None and info.endpoint is not None:
        e = info.endpoint
        where = Endpoint(
            uds=e.uds,
            host=e.host,
            port=e.port,
            token=e.token,
            pid=e.pid,
            proxy=f"/v1/sandboxes/{record.id}/daemon",
        )
    return SandboxOut(
        id=record.id,
        state=record.state,
        session=record.session,
        image=record.spec.image,
        spec=record.spec,
        expires_at=record.expires_at,
        timeline=dict(record.timeline),
        endpoint=where,
        running=running,
        lost_reason=record.lost.reason if record.lost else None,
        lost_detail=record.lost.detail if record.lost else None,
    )
