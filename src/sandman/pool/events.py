"""Lifecycle events: one helper logs each at DEBUG and hands it to an optional hook."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self

if TYPE_CHECKING:
    from sandman.pool.records import Record

__all__ = ["Emit", "EventHook", "EventLog", "PoolEvent", "emit"]

logger = logging.getLogger("sandman.pool")


@dataclass(frozen=True)
class PoolEvent:
    """``name`` is e.g. ``create.started``, ``create.complete``, ``create.failed``,
    ``sandbox.ready``, ``sandbox.leased``, ``sandbox.released``, ``delete.complete``,
    ``delete.failed``, ``session.expired``, ``reconcile.adopted``, ``reconcile.orphan``
    (``reason``: ``orphan, never handed over`` when no hand-over was on record),
    ``handover.failed`` (the hand-over could not be recorded: the sandbox is deleted),
    ``pool.stalled`` (its own loop stood still for ``seconds``: not counted against any
    session), ``disown.failed`` (a sandbox left at close kept this process as its owner),
    ``sandbox.lost`` (it died by itself: ``reason``, one of `sandman.SandboxLost.REASONS`,
    and ``detail``), ``lost.watch_failed`` (the provider's reports of lost sandboxes
    broke; asked again); and from a client, ``session.replaced`` (see `AsyncClient`)."""

    name: str
    pool: str
    sandbox_id: str | None = None
    session: str | None = None
    at: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)


EventHook = Callable[[PoolEvent], None]


class Emit(Protocol):
    """How a part of the pool tells of an event (the pool's own `emit`, which names the
    pool): the event's name, the sandbox it is about, if any, and its details."""

    def __call__(self, name: str, record: Record | None = None, **detail: object) -> None: ...


def emit(hook: EventHook | None, event: PoolEvent) -> None:
    """Log the event and call the hook; a failing hook is logged, never raised."""
    logger.debug(
        "%s pool=%s sandbox=%s session=%s %s",
        event.name,
        event.pool,
        event.sandbox_id,
        event.session,
        event.detail,
    )
    if hook is not None:
        try:
            hook(event)
        except Exception:
            logger.exception("pool event hook failed on %s", event.name)


class EventLog:
    """A hook that appends every event to ``path`` as a JSON line, for `sandman report`:
    ``sandman.local(hook=EventLog("run.jsonl"))``. Each line is written whole and flushed,
    so a run killed midway leaves every event up to then. Close it (or use ``with``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # hooks of several pools, or a sync client's thread

    def __call__(self, event: PoolEvent) -> None:
        line = json.dumps(
            {"name": event.name, "pool": event.pool, "sandbox": event.sandbox_id,
             "session": event.session, "at": event.at, "detail": event.detail},
            default=str,
        )  # fmt: skip
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        """Stop writing; idempotent."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
