"""Warm spares: ready sandboxes no session holds, kept per spec for the next acquire
(`Pool.warm`), and how many are wanted and being made."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

from sandman.models import SandboxSpec
from sandman.pool.records import Record

__all__ = ["Spares", "key_of"]


def key_of(spec: SandboxSpec) -> str:
    """A spec as a key: specs hold dicts, so they are not hashable."""
    return spec.model_dump_json()


class Spares:
    """The spares of each spec (by `key_of`), the number wanted, and those being made."""

    def __init__(self) -> None:
        self.idle: dict[str, deque[str]] = {}
        self.wanted: dict[str, tuple[SandboxSpec, int]] = {}
        self.pending: dict[str, int] = {}

    def want(self, spec: SandboxSpec, count: int) -> None:
        self.wanted[key_of(spec)] = (spec, count)

    def take(self, spec: SandboxSpec, records: Mapping[str, Record]) -> Record | None:
        """A ready spare of ``spec``, if there is one (those no longer ready are dropped)."""
        spares = self.idle.get(key_of(spec))
        while spares:
            record = records.get(spares.popleft())
            if record is not None and record.state == "ready":
                return record
        return None

    def keep(self, record: Record, key: str) -> bool:
        """Keep ``record`` as a spare if fewer than wanted are kept; whether it was."""
        _, target = self.wanted.get(key, (record.spec, 0))
        if len(self.idle.get(key, ())) >= target:
            return False
        record.session = None
        self.idle.setdefault(key, deque()).append(record.id)
        return True

    def drop(self, record: Record) -> None:
        """``record`` is a spare no more (it was lost): or the count would take it for one."""
        spares = self.idle.get(key_of(record.spec))
        if spares is not None and record.id in spares:
            spares.remove(record.id)

    def missing(self) -> Iterator[tuple[str, SandboxSpec]]:
        """One (key, spec) for each spare wanted that is neither kept nor being made,
        counted as being made from then on."""
        for key, (spec, target) in self.wanted.items():
            have = len(self.idle.get(key, ())) + self.pending.get(key, 0)
            for _ in range(target - have):
                self.pending[key] = self.pending.get(key, 0) + 1
                yield key, spec

    def made(self, key: str) -> None:
        """One spare of ``key`` is no longer being made (it is ready, or failed for good)."""
        self.pending[key] = self.pending.get(key, 1) - 1
