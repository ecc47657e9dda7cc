"""Live counts of the sandboxes a pool holds, grouped by a key of the caller's choosing
(the service's: the tenant). Kept as sandboxes come and go, so that reading one costs
the same at 50 sandboxes as at 50,000: the pool tells a `Tally` each time a sandbox
starts or stops being held, instead of anyone scanning its records."""

from __future__ import annotations

from collections.abc import Callable

from sandman.pool.records import Record, State

__all__ = ["HELD", "Tally"]

HELD: frozenset[State] = frozenset({"queued", "creating", "starting", "ready", "leased"})
"""The states in which a sandbox counts as held: from its recorded intent until it is
released, fails or is lost."""


class Tally:
    """How many sandboxes each key holds now (`Pool.tally`): ``tally[key]``, 0 for none.

    A sandbox is counted under the key it had when it became held and taken off that
    same count when it stops being held, whatever its labels became meanwhile. Only
    the sandboxes held with a key take room here, and a key with none held has no entry.
    """

    def __init__(self, key: Callable[[Record], str | None]) -> None:
        self._key = key
        self._counts: dict[str, int] = {}
        self._keyed: dict[str, str] = {}  # sandbox id -> its key, while held

    def __getitem__(self, key: str) -> int:
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        """How many keys hold at least one sandbox."""
        return len(self._counts)

    def __repr__(self) -> str:
        return f"Tally({self._counts!r})"

    def counts(self) -> dict[str, int]:
        """Every key holding sandboxes, with how many (a copy)."""
        return dict(self._counts)

    def held(self, record: Record) -> None:
        """``record`` is held from now on (counted once, however often told)."""
        if record.id in self._keyed:
            return
        key = self._key(record)
        if key is None:
            return
        self._keyed[record.id] = key
        self._counts[key] = self._counts.get(key, 0) + 1

    def let_go(self, sandbox_id: str) -> None:
        """The sandbox is held no more (released, failed, lost or forgotten)."""
        key = self._keyed.pop(sandbox_id, None)
        if key is None:
            return
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]
