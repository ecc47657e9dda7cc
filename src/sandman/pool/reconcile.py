"""A reconcile pass's listing and applying, and this process's owner record.

The decisions are `plan.plan_reconcile`'s (pure); this lists what the provider holds
(and, on a provider that keeps owner records, who is alive), waits at start until each
predecessor is judged, then applies the plan: orphans deleted, adoptions leased to
their recorded sessions, and the sandboxes of dead owners reaped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import owner as owners
from sandman.pool.config import PoolConfig
from sandman.pool.events import Emit
from sandman.pool.leases import Leases
from sandman.pool.ledger import Ledger
from sandman.pool.losses import Losses
from sandman.pool.plan import Adopt, plan_reconcile
from sandman.pool.records import LABEL_POOL, Record
from sandman.pool.snapshots import SnapshotBook
from sandman.providers.base import BackendOwners, KeepsOwners, Provider, SandboxInfo

__all__ = ["Reconciler"]


@dataclass(eq=False, repr=False)
class Reconciler:
    """Sets what one pool holds against what its provider lists (`Pool.reconcile`)."""

    provider: Provider
    config: PoolConfig
    ledger: Ledger
    leases: Leases
    losses: Losses
    book: SnapshotBook
    emit: Emit
    _: KW_ONLY
    owner: Callable[[], str]
    open_session: Callable[[str], object]
    """`Pool.open_session`: an adoption opens its session only while the pool is open."""
    touch: Callable[[], None]
    """Tells that the provider answered."""
    _keeper: KeepsOwners | None = field(init=False)
    _owner_open: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._keeper = self.provider if isinstance(self.provider, KeepsOwners) else None

    # -- this process's owner record ------------------------------------------------

    async def open_owner(self) -> str | None:
        """Make this process's owner record, on a provider that keeps them: its value (or
        None, for the pool's own), before the first create names it."""
        if self._keeper is None:
            return None
        owner = await self._keeper.open_owner()
        self._owner_open = True
        return owner

    async def close_owner(self) -> None:
        """Remove this process's owner record: what it released is gone, what it left is
        disowned (a delete that failed is reaped once the record is gone, as a dead
        owner's)."""
        if self._keeper is None or not self._owner_open:
            return
        self._owner_open = False
        try:
            async with asyncio.timeout(30):
                await self._keeper.close_owner()
        except (errors.SandboxError, TimeoutError) as exc:
            # It expires by itself: this process then reads as dead, as it soon is.
            self.emit("owner.close_failed", None, error=repr(exc))

    async def disown(self) -> None:
        """Left for the next pool of this name: no longer this process's, whose exit
        would make them a dead owner's, for any pool (and `sandman gc`) to reap."""
        gate = asyncio.Semaphore(32)

        async def one(record: Record) -> None:
            async with gate:
                try:
                    await self.provider.relabel(record.id, {owners.LABEL_OWNER: None})
                except errors.SandboxError as exc:
                    self.emit("disown.failed", record, error=repr(exc))

        kept = [r for r in self.ledger.records.values() if r.state in ("ready", "leased")]
        await asyncio.gather(*(one(record) for record in kept))

    # -- a pass -----------------------------------------------------------------------

    async def reconcile(self, *, adopt: bool, judge: bool) -> None:
        """See `Pool.reconcile`."""
        everyone = self.config.reap_dead_owners
        if everyone is None:
            everyone = self.provider.name == "local"
        mine = {LABEL_POOL: self.config.name}
        held = self.ledger.held()
        infos = await self.provider.list(labels=None if everyone else mine)
        self.touch()
        self.losses.notice(held, infos)
        # Listed after the sandboxes: an owner's record is made before its first sandbox,
        # so every sandbox listed whose owner lives has its record listed here.
        backend = await self._backend_owners()
        if adopt and judge and backend is not None:
            backend = await self._judge_predecessors(infos, backend)
        liveness = owners.Liveness(backend)
        records = self.ledger.records
        plan = plan_reconcile(
            infos,
            known=records,
            pool=self.config.name,
            owner=self.owner(),
            liveness=liveness,
            now=time.time(),
            adopt=adopt,
            judge=judge,
            stray_grace=self.config.stray_grace,
        )
        for orphan in plan.orphan:
            if orphan.info.id not in records:  # an adoption's await may have let one in
                self._orphan(orphan.info, expires=orphan.expires, reason=orphan.reason)
        for adoption in plan.adopt:
            if adoption.info.id not in records:
                await self._adopt(adoption)
        self.leases.elsewhere = plan.elsewhere
        await self.book.reconcile(lambda owner: liveness(owner) != "dead")
        if backend is not None and self.config.reap_dead_owners is not False:
            await self._reap_dead_owners(backend)

    async def _adopt(self, adoption: Adopt) -> None:
        info, session = adoption.info, adoption.session
        record = self._record_of(info, adoption.expires)
        try:
            # Ours before it counts as adopted: a sweep by its old owner spares it.
            await self.provider.relabel(info.id, {owners.LABEL_OWNER: self.owner()})
        except errors.SandboxError as exc:
            self.emit("reconcile.orphan", record, state=info.state, error=repr(exc))
            self.leases.release(record, reason="orphan")
            return
        record.labels[owners.LABEL_OWNER] = self.owner()
        self.open_session(session)
        self.leases.lease(record, session)
        self.losses.watch(info)
        self.emit("reconcile.adopted", record)

    async def _backend_owners(self) -> BackendOwners | None:
        """The provider's owner records judged now, if it keeps them; None (nothing judged
        dead or alive by them this time) when they cannot be read."""
        if self._keeper is None:
            return None
        try:
            return await self._keeper.owners()
        except errors.SandboxError as exc:
            self.emit("owners.failed", None, error=repr(exc))
            return None

    async def _judge_predecessors(
        self, infos: Iterable[SandboxInfo], backend: BackendOwners
    ) -> BackendOwners:
        """Before adopting: wait until each other owner of this pool's sandboxes is judged,
        dead (a previous life of this pool, killed: adopt) or renewing (another live
        process: leave alone). A record of a process killed a moment ago still reads
        alive; judging it dead takes its duration and grace (`BackendOwners.longest`)."""
        assert self._keeper is not None
        first = dict(backend.versions)
        pending = {
            owner
            for info in infos
            if info.labels.get(LABEL_POOL) == self.config.name
            and (owner := info.labels.get(owners.LABEL_OWNER)) is not None
            and owner != self.owner()
            and backend.knows(owner)
            and backend(owner) != "dead"
        }
        if pending:
            self.emit("reconcile.judging_owners", None, owners=sorted(pending))
        deadline = time.monotonic() + 2 * backend.longest + 1.0
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, backend.longest / 4 or 1.0))
            judged = await self._backend_owners()
            if judged is None:
                continue
            backend = judged
            pending = {
                o
                for o in pending
                if backend(o) != "dead" and backend.versions.get(o) == first.get(o)
            }
        return backend

    async def _reap_dead_owners(self, backend: BackendOwners) -> None:
        """Delete the sandboxes of every owner the provider's records say is dead (whatever
        their pool); once none is left, remove that owner's record."""
        assert self._keeper is not None
        for dead in backend.dead:
            if dead == self.owner():
                continue
            try:
                theirs = await self.provider.list(labels={owners.LABEL_OWNER: dead})
                for info in theirs:
                    if info.id not in self.ledger.records:
                        self._orphan(info, reason=f"owner {owners.describe(dead)} is dead")
                if not theirs:
                    await self._keeper.forget_owner(dead, backend.versions.get(dead))
            except errors.SandboxError as exc:  # the next reconcile tries again
                self.emit("owners.reap_failed", None, owner=dead, error=repr(exc))

    def _record_of(self, info: SandboxInfo, expires: float = 0.0) -> Record:
        record = Record(
            id=info.id,
            spec=SandboxSpec(image=info.image or "unknown"),
            state="ready",
            labels=dict(info.labels),
            expires_at=expires,
            info=info,
        )
        self.ledger.add(record)
        return record

    def _orphan(self, info: SandboxInfo, *, expires: float = 0.0, reason: str = "orphan") -> None:
        record = self._record_of(info, expires)
        self.emit("reconcile.orphan", record, state=info.state, reason=reason)
        self.leases.release(record, reason=reason)
