"""What the pool knows of each sandbox: its state, owner, expiry and timeline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from sandman.models import SandboxSpec, Usage
from sandman.providers.base import Lost, SandboxInfo

__all__ = [
    "LABEL_EXPIRES",
    "LABEL_POOL",
    "LABEL_SESSION",
    "LABEL_TENANT",
    "Record",
    "State",
    "TimelineEvent",
]

LABEL_POOL = "sandman.io/pool"
LABEL_SESSION = "sandman.io/session"
LABEL_EXPIRES = "sandman.io/expires-at"
LABEL_TENANT = "sandman.io/tenant"
"""Set by the service on what it hands out (in the spec, so the backend keeps it)."""

State = Literal[
    "queued",
    "creating",
    "starting",
    "ready",
    "leased",
    "releasing",
    "failed",
    "gone",
    "lost",
]
"""``lost``: it died by itself while ready or leased (``Record.lost`` says why); the
pool deletes what is left of it and tells its holder with `sandman.SandboxLost`."""

TimelineEvent = Literal[
    "queued",
    "create_called",
    "accepted",
    "running",
    "daemon_ready",
    "handed_out",
    "released",
    "lost",
    "gone",
]
"""Where a sandbox's time went, in order; each is stamped once, in wall-clock seconds."""


USAGE_FRESH = 1.0
"""Seconds a usage read stands as the last one before a delete (`Record.usage`)."""


@dataclass
class Record:
    """One sandbox, from the recorded intent to gone. Mutated only by the pool."""

    id: str
    spec: SandboxSpec
    state: State
    labels: dict[str, str]
    expires_at: float
    session: str | None = None
    info: SandboxInfo | None = None
    error: BaseException | None = None
    lost: Lost | None = None
    """In state ``lost``: why (``lost.reason``: ``oom``, ``killed``, ``evicted``...)."""
    release_requested: bool = False
    usage: Usage | None = None
    """What it used, as last read (`Pool.usage`); read once more just before its delete
    unless read within `USAGE_FRESH` seconds of it (a release that reads it first)."""
    usage_read_at: float = 0.0
    changing: int = 0
    """Changes of its container under way (a snapshot freezes it, a restore makes it
    again, a pause with memory removes it until resumed): meanwhile the backend may
    list it oddly (missing, stopped), which is no loss."""
    changes: int = 0
    """Counts each change's start and end: a listing made across one is not believed."""
    paused_memory: bool = False
    """Paused with its memory on disk: no container until resumed, and that is no loss."""
    timeline: dict[str, float] = field(default_factory=dict)

    def stamp(self, event: TimelineEvent, at: float | None = None) -> None:
        self.timeline.setdefault(event, time.time() if at is None else at)
