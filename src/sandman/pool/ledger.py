"""What a pool knows of its sandboxes: their records by id, the tallies that follow them,
and the last few lost ones, kept (deleted already) until their holders are told.

Every change of a record's state goes through `Ledger.set_state`, so that the tallies
(`Pool.tally`) never need a scan of the records.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

from sandman import errors
from sandman.pool.records import Record, State
from sandman.pool.tally import HELD, Tally

__all__ = ["Ledger"]


class Ledger:
    """The records of one pool's sandboxes, from the recorded intent until gone."""

    def __init__(self, pool: str, remember_lost: int) -> None:
        self._pool = pool
        self._remember = remember_lost
        self.records: dict[str, Record] = {}
        # Lost and deleted, kept (a bounded few) until their holders are told.
        self.lost: OrderedDict[str, Record] = OrderedDict()
        self.tallies: weakref.WeakSet[Tally] = weakref.WeakSet()  # kept by their readers

    def get(self, sandbox_id: str) -> Record:
        """The sandbox's record: one the pool holds, or one recently lost (state ``lost``)."""
        record = self.records.get(sandbox_id) or self.lost.get(sandbox_id)
        if record is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is not in pool {self._pool!r}")
        return record

    def add(self, record: Record) -> None:
        self.records[record.id] = record
        if record.state in HELD:
            for tally in self.tallies:
                tally.held(record)

    def set_state(self, record: Record, state: State) -> None:
        """Every change of a recorded sandbox's state, so that the tallies follow it."""
        was_held = record.state in HELD
        record.state = state
        if was_held and state not in HELD:
            for tally in self.tallies:
                tally.let_go(record.id)
        elif state in HELD and not was_held:
            for tally in self.tallies:
                tally.held(record)

    def forget(self, record: Record) -> None:
        self.records.pop(record.id, None)
        for tally in self.tallies:
            tally.let_go(record.id)

    def tally(self, key: Callable[[Record], str | None]) -> Tally:
        """A live count of the sandboxes held by ``key(record)`` (see `Pool.tally`)."""
        tally = Tally(key)
        for record in self.records.values():
            if record.state in HELD:
                tally.held(record)
        self.tallies.add(tally)
        return tally

    def remember_lost(self, record: Record) -> None:
        """Keep a lost one, deleted now, for its holder's next call; the oldest go first."""
        self.lost[record.id] = record
        self.lost.move_to_end(record.id)
        while len(self.lost) > max(0, self._remember):
            self.lost.popitem(last=False)

    def held(self) -> list[tuple[Record, int]]:
        """The ready and leased ones, each with its count of changes now (see
        `Record.changes`): what a listing made from now on may find lost."""
        return [(r, r.changes) for r in self.records.values() if r.state in ("ready", "leased")]
