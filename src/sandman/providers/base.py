"""The seam between the pool and a backend: the Provider protocol and what it returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from sandman.daemon import DaemonClient
from sandman.egress import Egress
from sandman.models import SandboxSpec, Usage

__all__ = [
    "BackendOwners",
    "ChangesEgress",
    "DaemonEndpoint",
    "KeepsOwners",
    "Lost",
    "LostReports",
    "OwnerStatus",
    "Provider",
    "ReportsUsage",
    "SandboxInfo",
    "SandboxState",
    "SnapshotInfo",
    "Snapshots",
    "WatchesLost",
]

OwnerStatus = Literal["alive", "dead", "unknown"]
"""Whether the process that owns a sandbox (``sandman.io/owner``) still lives; only
``dead`` is a reason to reap its sandboxes."""

SandboxState = Literal["creating", "running", "stopped", "unknown"]
"""What the backend says of a sandbox. ``creating``: recorded, not started
(or a create that crashed half-way). ``stopped``: its init is gone."""


class DaemonEndpoint(BaseModel):
    """How to reach a sandbox's daemon: a unix socket or a TCP address, and its token."""

    model_config = ConfigDict(frozen=True)

    uds: str | None = None
    host: str | None = None
    port: int | None = None
    token: str
    pid: int | None = None
    """The daemon's pid on this host: a unix-socket peer must be this process."""

    def client(self, *, request_timeout: float = 60.0) -> DaemonClient:
        """A new client for this daemon; close it with ``aclose``."""
        return DaemonClient(
            uds=self.uds,
            host=self.host,
            port=self.port,
            token=self.token,
            request_timeout=request_timeout,
            peer_pid=self.pid,
        )


class Lost(BaseModel):
    """A sandbox that died by itself, and why (`sandman.SandboxLost.REASONS`)."""

    model_config = ConfigDict(frozen=True)

    sandbox_id: str
    reason: str
    """``oom``, ``killed``, ``evicted``, ``preempted``, ``node_lost``, ``deleted``,
    ``daemon_exit`` or ``unknown``."""
    detail: str = ""
    """What the backend said, in a sentence (the exit status, the pod's reason...)."""


class SandboxInfo(BaseModel):
    """One sandbox as the backend knows it. Everything here survives a restart of the caller."""

    model_config = ConfigDict(frozen=True)

    id: str
    provider: str
    state: SandboxState
    labels: dict[str, str]
    created_at: float
    image: str
    endpoint: DaemonEndpoint | None = None
    lost: Lost | None = None
    """For a ``stopped`` sandbox: why it stopped, as far as the backend can tell."""


class SnapshotInfo(BaseModel):
    """One snapshot as the backend keeps it; everything here survives a restart."""

    model_config = ConfigDict(frozen=True)

    id: str
    provider: str
    labels: dict[str, str]
    created_at: float
    image: str
    image_id: str
    size: int
    """Bytes it holds beyond the image."""
    memory: bool = False
    source: str | None = None
    spec: SandboxSpec | None = None


class Provider(Protocol):
    """Creates, lists and deletes sandboxes on one backend.

    Implementations record a sandbox (its id and labels) before asking the
    backend for it, so a crash in between leaves something `list` finds;
    `delete` is idempotent and succeeds only once the backend holds nothing.
    """

    name: str

    async def create(
        self,
        spec: SandboxSpec,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SandboxInfo:
        """Start a sandbox; it is running (not necessarily ready) when this returns."""
        ...

    async def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox and everything it holds; a missing sandbox is not an error."""
        ...

    def progress(self, sandbox_id: str) -> str | None:
        """What a create still in flight waits on, in a few words (for a timeout's
        error); None when it is not in flight or there is nothing to say."""
        ...

    async def list(self, *, labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox this provider owns whose labels include ``labels``."""
        ...

    async def relabel(self, sandbox_id: str, labels: Mapping[str, str | None]) -> None:
        """Merge ``labels`` into the sandbox's (a None value removes that label), durably:
        a later `list`, in this process or another, sees them. SandboxNotFound when
        there is no such sandbox."""
        ...

    async def inspect(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox; raises SandboxNotFound when there is none."""
        ...

    async def aclose(self) -> None:
        """Release the provider's own resources; sandboxes are left as they are."""
        ...


class LostReports(Protocol):
    """What `WatchesLost.lost` returns: ``async for lost in reports``; `aclose` ends them."""

    def __aiter__(self) -> LostReports: ...

    async def __anext__(self) -> Lost: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class WatchesLost(Protocol):
    """An optional capability of a provider: it tells at once when a sandbox dies by
    itself (its daemon exits, its pod is evicted), so the pool need not wait for its
    next reconcile to notice. A provider without it is still reconciled: a sandbox it
    lists as ``stopped`` (or no longer lists) is lost then.
    """

    def watch_lost(self, sandbox: SandboxInfo) -> None:
        """Tell of ``sandbox`` (just created or adopted, running) through `lost` from now
        on, until it is reported or deleted. Call it on the event loop `lost` runs on."""
        ...

    def lost(self) -> LostReports:
        """Each watched sandbox that died by itself, once, as soon as the backend says;
        never one removed through `delete`. Every reader sees every report made after
        it was asked for (not only after it first waits); close it with ``aclose``."""
        ...


@runtime_checkable
class ReportsUsage(Protocol):
    """An optional capability of a provider: what a sandbox has used (CPU, memory, disk,
    network), read from the backend's own accounting."""

    async def usage(self, sandbox_id: str) -> Usage:
        """The sandbox's usage so far; figures the backend cannot tell are None."""
        ...


@runtime_checkable
class ChangesEgress(Protocol):
    """An optional capability of a provider: it changes where a running egress sandbox
    may connect (`Egress` rules), at once, for connections already open too."""

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Replace the sandbox's egress rules. `SandboxNotFound` if there is no such
        sandbox; `ConfigError` if it was made without egress or the backend cannot hold
        a rule (a domain on Kubernetes)."""
        ...


@runtime_checkable
class Snapshots(Protocol):
    """An optional capability of a provider: it keeps snapshots of sandboxes, makes
    sandboxes from them (`create` with ``spec.snapshot``), resets a sandbox to one, and
    pauses and resumes sandboxes. A snapshot is recorded before it is made, as a sandbox
    is, so that `snapshots` finds even a half-made one and `delete_snapshot` removes it.
    """

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        snapshot_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: bool = False,
    ) -> SnapshotInfo:
        """Keep the sandbox's files (and with ``memory``, its processes); it goes on
        running. ConfigError if this backend cannot keep memory."""
        ...

    async def snapshots(self, *, labels: Mapping[str, str] | None = None) -> list[SnapshotInfo]:
        """Every snapshot this provider keeps whose labels include ``labels``."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the snapshot and all it holds; a missing one is not an error. Sandboxes
        made from it are not touched (they hold their own copy-on-write files)."""
        ...

    async def restore(self, sandbox_id: str, snapshot_id: str) -> SandboxInfo:
        """Reset the sandbox to the snapshot in place: same id, new processes (those of the
        snapshot, with memory). Returns it with its daemon's new endpoint."""
        ...

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Stop every process of the sandbox (it uses no CPU) until `resume`; with
        ``memory``, checkpoint them to disk so that it holds no memory either
        (ConfigError where the backend cannot)."""
        ...

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Let a paused sandbox's processes run again."""
        ...


@dataclass(frozen=True)
class BackendOwners:
    """The owners a backend keeps records of (`KeepsOwners`), as judged at one moment.

    Call it with an owner value: its status. A value of this backend's form
    (``prefix``) that has no record is ``dead`` (a record is made before its owner's
    first sandbox and removed only after its last); one of another form is ``unknown``.
    """

    statuses: Mapping[str, OwnerStatus]
    prefix: str
    versions: Mapping[str, str] = field(default_factory=dict)
    """The version of each record as judged (deleting it is conditional on it)."""
    undecided_for: float = 0.0
    """Seconds until every record judged ``unknown`` now that could turn ``dead`` is
    judged, if it stays as it is and is looked at again then (0: none is pending)."""
    longest: float = 0.0
    """The longest time a record may take to be judged dead once its owner stops renewing
    it (the longest duration plus grace among them): waiting twice that, looking again
    and again, tells a dead owner from a live one."""

    def knows(self, owner: str) -> bool:
        """Whether ``owner`` is of this backend's form."""
        return owner.startswith(self.prefix)

    def __call__(self, owner: str) -> OwnerStatus:
        if owner in self.statuses:
            return self.statuses[owner]
        return "dead" if self.knows(owner) else "unknown"

    @property
    def dead(self) -> list[str]:
        """The owners whose records say they are dead (not those without a record)."""
        return sorted(o for o, status in self.statuses.items() if status == "dead")


@runtime_checkable
class KeepsOwners(Protocol):
    """An optional capability of a provider: it records each pool process as an owner on
    the backend itself (Kubernetes: a Lease), so that any process that can reach the
    backend can tell when that owner died. Without it, owners are processes of this
    host (`sandman.pool.owner`).
    """

    async def open_owner(self) -> str | None:
        """Record this process as an owner and keep the record fresh until `close_owner`;
        its value for the ``sandman.io/owner`` label (None: the backend refuses, and
        sandboxes carry the local form). Called again, the same value."""
        ...

    async def close_owner(self) -> None:
        """Stop keeping the record fresh and remove it (a clean close)."""
        ...

    async def owners(self) -> BackendOwners:
        """Every owner the backend records, judged now. Judging may take repeated calls
        (a record looks dead only once it has been seen unchanged for a while)."""
        ...

    async def forget_owner(self, owner: str, version: str | None = None) -> bool:
        """Remove a dead owner's record once none of its sandboxes is left (and the record
        is still at ``version``); whether it is gone."""
        ...
