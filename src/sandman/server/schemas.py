"""Request and response bodies of the service's JSON API (v1)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandman.models import SandboxSpec
from sandman.pool.records import Record, State

__all__ = [
    "AcquireRequest",
    "Endpoint",
    "ErrorBody",
    "ErrorDetail",
    "HealthOut",
    "SandboxList",
    "SandboxOut",
    "SessionOut",
    "SessionRequest",
]


class _In(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class ErrorDetail(_Out):
    code: str
    """Stable; see `sandman.server.errors.STATUS`."""
    message: str


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


class Endpoint(_Out):
    """Where the sandbox's daemon listens, and its bearer token."""

    uds: str | None = None
    host: str | None = None
    port: int | None = None
    token: str
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


class SandboxList(_Out):
    sandboxes: list[SandboxOut]


class HealthOut(_Out):
    status: Literal["ok", "shutting_down"]
    version: str
    pool: str
    provider: str


def sandbox_out(
    record: Record, *, endpoint: bool = False, running: bool | None = None
) -> SandboxOut:
    """The wire form of a record; with ``endpoint``, the daemon's address and token too."""
    where = None
    info = record.info
    if endpoint and info is not None and info.endpoint is not None:
        e = info.endpoint
        where = Endpoint(
            uds=e.uds, host=e.host, port=e.port, token=e.token,
            proxy=f"/v1/sandboxes/{record.id}/daemon",
        )  # fmt: skip
    return SandboxOut(
        id=record.id, state=record.state, session=record.session, image=record.spec.image,
        spec=record.spec, expires_at=record.expires_at, timeline=dict(record.timeline),
        endpoint=where, running=running,
    )  # fmt: skip
