"""Changes of a held sandbox's container: a snapshot (which freezes it), a restore (which
makes it again), a pause and a resume.

Each runs inside `changing`, so that what the backend lists meanwhile (the container
missing, or stopped) is not taken for the sandbox's loss (see `sandman.pool.losses`).
The snapshots' bookkeeping is the `SnapshotBook`'s; this holds no state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from sandman import errors
from sandman.pool.config import PoolConfig
from sandman.pool.events import Emit
from sandman.pool.ledger import Ledger
from sandman.pool.losses import Losses
from sandman.pool.records import Record
from sandman.pool.snapshots import SnapshotBook
from sandman.providers.base import SnapshotInfo

__all__ = ["Changes", "changing"]


@contextlib.contextmanager
def changing(record: Record) -> Iterator[None]:
    """While the block changes the record's container (`Record.changing`)."""
    record.changing += 1
    record.changes += 1
    try:
        yield
    finally:
        record.changing -= 1
        record.changes += 1


@dataclass(eq=False, repr=False)
class Changes:
    """Snapshot, restore, pause and resume a held sandbox (see `Pool.snapshot` and on)."""

    config: PoolConfig
    book: SnapshotBook
    ledger: Ledger
    losses: Losses
    emit: Emit

    def held(self, sandbox_id: str) -> Record:
        """The record of a sandbox that is ready or leased; `SandboxLost` or
        `SandboxNotFound` for any other."""
        record = self.ledger.get(sandbox_id)
        if record.lost is not None:
            raise errors.SandboxLost.of(sandbox_id, record.lost.reason, record.lost.detail)
        if record.state not in ("ready", "leased"):
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is gone ({record.state})")
        return record

    async def snapshot(
        self, sandbox_id: str, *, memory: bool, ttl: float | None, labels: Mapping[str, str] | None
    ) -> SnapshotInfo:
        record = self.held(sandbox_id)
        with changing(record):
            info = await self.book.make(sandbox_id, memory=memory, ttl=ttl, labels=labels)
        self.emit(
            "snapshot.made", self.ledger.records.get(sandbox_id), snapshot=info.id, size=info.size
        )
        return info

    async def restore(self, sandbox_id: str, snapshot_id: str) -> Record:
        record = self.held(sandbox_id)
        self.book.get(snapshot_id)
        keeper = self.book.keeper()
        with changing(record):
            info = await keeper.restore(sandbox_id, snapshot_id)
            if info.endpoint is not None:
                async with info.endpoint.client() as daemon:
                    await daemon.wait_ready(self.config.ready_timeout)
            record.paused_memory = False
        record.info = info
        self.losses.watch(info)
        self.emit("sandbox.restored", record, snapshot=snapshot_id)
        return record

    async def pause(self, sandbox_id: str, *, memory: bool) -> None:
        record = self.held(sandbox_id)
        with changing(record):
            await self.book.keeper().pause(sandbox_id, memory=memory)
            record.paused_memory = memory  # no container until resumed: no loss
        self.emit("sandbox.paused", self.ledger.records.get(sandbox_id))

    async def resume(self, sandbox_id: str) -> Record:
        record = self.held(sandbox_id)
        with changing(record):
            info = await self.book.keeper().resume(sandbox_id)
            record.paused_memory = False
        if info.endpoint is not None:
            record.info = info
            self.losses.watch(info)
        self.emit("sandbox.resumed", record)
        return record
