"""Sandboxes that die by themselves (OOM, a crash, killed from the host, an evicted pod):
found lost, deleted as for a release, and their holders told why.

The provider tells at once if it can (`WatchesLost`: `Losses.follow`); otherwise a
reconcile pass's listing (`Losses.notice`) or a holder's question (`Losses.inspect`)
finds one stopped or missing. A sandbox whose container is being changed meanwhile
(`Record.changing`, `Record.changes`) is not taken for lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from sandman import errors
from sandman.pool.config import PoolConfig
from sandman.pool.events import Emit
from sandman.pool.leases import Leases
from sandman.pool.ledger import Ledger
from sandman.pool.records import Record
from sandman.pool.spares import Spares
from sandman.providers.base import Lost, LostReports, Provider, SandboxInfo, WatchesLost

__all__ = ["Losses", "dead", "loss_of"]

logger = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Losses:
    """Marks lost the ready or leased sandboxes that died, and has them deleted."""

    provider: Provider
    config: PoolConfig
    ledger: Ledger
    leases: Leases
    spares: Spares
    emit: Emit
    _watcher: WatchesLost | None = field(init=False)

    def __post_init__(self) -> None:
        self._watcher = self.provider if isinstance(self.provider, WatchesLost) else None

    def reports(self) -> LostReports | None:
        """The provider's reports of lost sandboxes, if it makes them (ask before the first
        listing, so that no loss among what it lists is missed)."""
        return self._watcher.lost() if self._watcher is not None else None

    def watch(self, info: SandboxInfo) -> None:
        """Have the provider tell of this sandbox's death at once, if it can."""
        if self._watcher is None:
            return
        try:
            self._watcher.watch_lost(info)
        except Exception:  # the reconcile pass still finds it
            logger.warning("cannot watch %s for its loss", info.id, exc_info=True)

    async def follow(self, losses: LostReports) -> None:
        """Mark lost what the provider says died; should its reports fail, ask again."""
        assert self._watcher is not None
        backoff = self.config.delete_backoff
        try:
            while True:
                try:
                    async for lost in losses:
                        backoff = self.config.delete_backoff
                        record = self.ledger.records.get(lost.sandbox_id)
                        if record is not None:
                            self.lose(record, lost)
                    raise errors.ProviderError("the provider's reports of lost sandboxes ended")
                except Exception as exc:  # noqa: BLE001 - reconcile covers the gap; ask again
                    self.emit("lost.watch_failed", None, error=repr(exc))
                    await losses.aclose()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.config.delete_backoff_max)
                    losses = self._watcher.lost()
        finally:
            await losses.aclose()

    def lose(self, record: Record, lost: Lost) -> None:
        """A ready or leased sandbox died by itself: mark it lost, delete what is left."""
        if record.state not in ("ready", "leased") or record.changing or record.paused_memory:
            return  # being created (its create fails), released, or restored (no daemon for now)
        record.lost = lost
        self.leases.let_go(record)
        self.spares.drop(record)
        self.ledger.set_state(record, "lost")
        record.stamp("lost")
        self.emit("sandbox.lost", record, reason=lost.reason, detail=lost.detail)
        self.leases.delete_later(record)

    def notice(self, held: Iterable[tuple[Record, int]], infos: Iterable[SandboxInfo]) -> None:
        """Mark lost each of ``held`` (ready or leased before the provider listed ``infos``,
        with its count of changes then) that the provider lists as dead (stopped, its
        container gone), or no more; not one whose container changed meanwhile."""
        listed = {info.id: info for info in infos}
        for record, changes in held:
            info = listed.get(record.id)
            if dead(info) and record.changes == changes:
                self.lose(record, loss_of(record.id, info))

    async def inspect(self, record: Record) -> None:
        """Ask the provider whether a leased sandbox still runs; mark it lost if not (unless
        its container changed meanwhile, or it is leased no more)."""
        changes = record.changes
        try:
            info: SandboxInfo | None = await self.provider.inspect(record.id)
        except errors.SandboxNotFound:
            info = None
        if record.state == "leased" and dead(info) and record.changes == changes:
            self.lose(record, loss_of(record.id, info))


def dead(info: SandboxInfo | None) -> bool:
    """Whether a sandbox that was ready, as the provider lists it now (None: not at all),
    is dead: stopped, gone, or back to ``creating`` (its record without its container)."""
    return info is None or info.state in ("stopped", "creating")


def loss_of(sandbox_id: str, info: SandboxInfo | None) -> Lost:
    """Why a sandbox the provider lists as ``info`` (None: not at all) is lost."""
    if info is None:
        return Lost(sandbox_id=sandbox_id, reason="deleted", detail="the backend has it no more")
    return info.lost or Lost(
        sandbox_id=sandbox_id, reason="unknown", detail=f"the backend says it is {info.state}"
    )
