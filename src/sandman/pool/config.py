"""How a pool behaves (`PoolConfig`) and how it is doing now (`PoolHealth`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sandman import errors
from sandman.pool.pacing import PacingConfig

__all__ = ["PoolConfig", "PoolHealth"]


@dataclass(frozen=True)
class PoolConfig:
    """How the pool behaves. Times are seconds."""

    name: str = "default"
    """Every sandbox carries the label ``sandman.io/pool=<name>``; the reconciler owns those."""
    lease: float = 30.0
    """A session that has not heartbeated for this long loses its sandboxes."""
    lifetime: float = 6 * 3600.0
    """Hard lifetime of every sandbox (``sandman.io/expires-at``), enforced even across restarts."""
    ready_timeout: float = 120.0
    """How long a created sandbox may take until its daemon answers health."""
    reconcile_interval: float = 15.0
    """Seconds between reconcile passes, at least; a pass lists every sandbox, so when
    one takes longer than ``reconcile_share`` of this, the next waits longer (at 10k
    local sandboxes one takes seconds)."""
    reconcile_share: float = 0.05
    """The most of the pool's time its reconcile passes may take, together."""
    delete_backoff: float = 0.2
    delete_backoff_max: float = 10.0
    retry_limit: int = 5
    """How often one request is re-queued after retryable failures (throttling, capacity)."""
    remember_lost: int = 1000
    """How many lost sandboxes (deleted already) are remembered, so that their holders'
    next calls say why (`SandboxLost`); the oldest are forgotten first."""
    adopt_orphans: bool = False
    """At start, keep running sandboxes a previous life of this pool left instead of deleting
    them: those whose hand-over it recorded, as leased to that session. The rest (being
    created, or spares no caller received) are deleted."""
    record_hand_over: bool = True
    """Record each hand-over on the sandbox itself (its ``sandman.io/session`` label, one
    `Provider.relabel`) before the caller is answered, so a later pool of this name adopts
    exactly what callers received. Only a pool no one will ever adopt (a unique name,
    swept by its watchdog: ``sandman.local()``) may save the call."""
    reap_dead_owners: bool | None = None
    """Reconcile also deletes sandboxes of any pool whose owner (``sandman.io/owner``, see
    `sandman.pool.owner`) is a dead process, and records of nothing that run nothing
    (older than ``stray_grace``). None: on the local provider, where listing every
    sandbox is cheap and owners are processes of this host; and on a provider that keeps
    owner records itself (`KeepsOwners`: Kubernetes' Leases), for the sandboxes of the
    owners its records say are dead only (one list of records, then one of sandboxes per
    dead owner). False: neither."""
    stray_grace: float = 60.0
    """How old a record of nothing must be before it is reaped: a create in flight is one
    for a moment."""
    pacing: PacingConfig = field(default_factory=PacingConfig)

    def __post_init__(self) -> None:
        if not 0 < self.reconcile_share <= 1:
            raise errors.ConfigError(
                f"reconcile_share must be in (0, 1], not {self.reconcile_share!r}"
            )


@dataclass(frozen=True)
class PoolHealth:
    """How the pool is doing now (`Pool.health`): what a service's probes are made of."""

    started: bool
    closed: bool
    provider_age: float | None
    """Seconds since the provider last answered (a reconcile pass's list, a create);
    None if it never has."""
    reconcile_interval: float
    """Seconds between reconcile passes now (longer while passes are slow)."""
    stopped: tuple[str, ...]
    """The background loops that ended by themselves (a bug): nothing is handed out,
    expired or reconciled any more, and only a restart helps."""

    @property
    def provider_reached(self) -> bool:
        """Whether the provider answered recently: within two and a half reconcile
        intervals (so one pass may fail on a moment's trouble, and a pass's own list
        takes a fraction of an interval), so a pool that cannot reach its backend says so."""
        return (
            self.provider_age is not None
            and self.provider_age <= _REACHED_INTERVALS * self.reconcile_interval
        )


_REACHED_INTERVALS = 2.5
