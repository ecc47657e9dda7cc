"""The pool's snapshots: whose they are, when they expire, and that none outlives its pool.

The provider keeps the files (`sandman.providers.base.Snapshots`); this keeps the
bookkeeping, exactly as the pool does for sandboxes: every snapshot is labelled with
the pool, its owner process and its expiry *by the provider* when it is made, so a
restarted pool adopts them, a dead pool's watchdog and ``sandman gc`` find them, and
the expiry holds whoever reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from sandman import errors
from sandman.models import Snapshot
from sandman.pool import owner as owners
from sandman.pool.records import LABEL_EXPIRES, LABEL_POOL
from sandman.providers.base import Provider, SnapshotInfo, Snapshots

__all__ = ["SnapshotBook", "expires_at", "sweep_snapshots", "to_snapshot"]

logger = logging.getLogger(__name__)


def expires_at(info: SnapshotInfo) -> float:
    """When the snapshot is to be deleted (0: no expiry recorded, so at once)."""
    try:
        return float(info.labels.get(LABEL_EXPIRES, "0"))
    except ValueError:
        return 0.0


def to_snapshot(info: SnapshotInfo) -> Snapshot:
    """What a caller sees of a snapshot."""
    return Snapshot(
        id=info.id,
        image=info.image,
        created_at=info.created_at,
        expires_at=expires_at(info),
        size=info.size,
        memory=info.memory,
        source=info.source,
        spec=info.spec,
    )


class SnapshotBook:
    """The snapshots one pool made or adopted, by id."""

    def __init__(
        self,
        provider: Provider,
        pool: str,
        owner: Callable[[], str],
        lifetime: float,
    ) -> None:
        self._provider = provider
        self._pool = pool
        self._owner = owner
        self._lifetime = lifetime
        self._kept: dict[str, SnapshotInfo] = {}

    def keeper(self) -> Snapshots:
        """The provider, if it keeps snapshots; a ConfigError that says so otherwise."""
        if not isinstance(self._provider, Snapshots):
            raise errors.ConfigError(
                f"the {self._provider.name} provider keeps no snapshots (the local and kubernetes "
                "providers do)"
            )
        return self._provider

    async def make(
        self,
        sandbox_id: str,
        *,
        memory: bool,
        ttl: float | None,
        labels: Mapping[str, str] | None,
    ) -> SnapshotInfo:
        """A snapshot of the sandbox, labelled as this pool's, expiring after ``ttl``
        seconds (the pool's sandbox lifetime by default)."""
        if ttl is not None and ttl <= 0:
            raise errors.ConfigError(f"a snapshot's ttl must be > 0 seconds, got {ttl}")
        keeper = self.keeper()
        expires = time.time() + (self._lifetime if ttl is None else ttl)
        own = {
            **(labels or {}),
            LABEL_POOL: self._pool,
            owners.LABEL_OWNER: self._owner(),
            LABEL_EXPIRES: f"{expires:.0f}",
        }
        info = await keeper.snapshot(sandbox_id, labels=own, memory=memory)
        self._kept[info.id] = info
        return info

    def get(self, snapshot_id: str) -> SnapshotInfo:
        """One of this pool's snapshots; SnapshotNotFound otherwise (or once expired)."""
        info = self._kept.get(snapshot_id)
        if info is None or expires_at(info) < time.time():
            raise errors.SnapshotNotFound(
                f"no snapshot {snapshot_id} in pool {self._pool!r} (deleted or expired?)"
            )
        return info

    def list(self) -> list[SnapshotInfo]:
        """This pool's snapshots, oldest first."""
        return sorted(self._kept.values(), key=lambda info: info.created_at)

    async def delete(self, snapshot_id: str) -> None:
        """Delete one; idempotent. Sandboxes made from it keep their files."""
        self._kept.pop(snapshot_id, None)
        await self.keeper().delete_snapshot(snapshot_id)

    async def expire(self) -> None:
        """Delete the snapshots past their expiry (a failure is retried next time)."""
        now = time.time()
        for info in [i for i in self._kept.values() if expires_at(i) < now]:
            try:
                await self.delete(info.id)
            except errors.SandboxError as exc:
                self._kept[info.id] = info
                logger.warning("cannot delete expired snapshot %s: %s", info.id, exc)

    async def reconcile(self, alive: Callable[[str], bool]) -> None:
        """Adopt this pool's snapshots the provider keeps and this book does not (a
        predecessor's), unless their owner still lives; forget those gone."""
        if not isinstance(self._provider, Snapshots):
            return
        listed = await self._provider.snapshots(labels={LABEL_POOL: self._pool})
        ids = {info.id for info in listed}
        for gone in self._kept.keys() - ids:
            del self._kept[gone]
        for info in listed:
            owner = info.labels.get(owners.LABEL_OWNER, "")
            if info.id not in self._kept and (owner == self._owner() or not alive(owner)):
                self._kept[info.id] = info

    async def close(self) -> None:
        """Delete every snapshot this pool keeps (the pool is closing and releasing)."""
        for info in self.list():
            try:
                await self.delete(info.id)
            except errors.SandboxError as exc:
                logger.warning("cannot delete snapshot %s at close: %s", info.id, exc)


async def sweep_snapshots(provider: Provider, labels: Mapping[str, str]) -> int:
    """Delete every snapshot whose labels include ``labels`` (a dead pool's); how many."""
    if not isinstance(provider, Snapshots):
        return 0
    deleted = 0
    for info in await provider.snapshots(labels=labels):
        try:
            await provider.delete_snapshot(info.id)
            deleted += 1
        except errors.SandboxError as exc:
            logger.warning("sweep: cannot delete snapshot %s: %s", info.id, exc)
    return deleted
