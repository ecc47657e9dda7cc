"""Who holds each sandbox, and how a hold ends: sessions and their leases, the hand-over
on record, and the release, then the delete, retried until the provider says gone.

A session that stops heartbeating loses its sandboxes when its lease ends (the pool's
maintenance asks `Leases.expired`); a released sandbox is deleted in the background,
and a lost one stays ``lost`` (remembered in the `Ledger`) so its holder is told why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sandman import errors
from sandman.pool.config import PoolConfig
from sandman.pool.events import Emit
from sandman.pool.ledger import Ledger
from sandman.pool.records import LABEL_SESSION, USAGE_FRESH, Record
from sandman.providers.base import Provider, ReportsUsage

__all__ = ["Leases", "Session", "Spawn"]

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Run a coroutine in the background, by name, until the pool is done with it."""


@dataclass
class Session:
    id: str
    lease: float
    last_seen: float
    sandboxes: set[str] = field(default_factory=set)


@dataclass(eq=False, repr=False)
class Leases:
    """The sessions of one pool, the sandboxes each holds, and the end of every hold."""

    provider: Provider
    config: PoolConfig
    ledger: Ledger
    emit: Emit
    spawn: Spawn
    sessions: dict[str, Session] = field(default_factory=dict, init=False)
    elsewhere: dict[str, dict[str, str]] = field(default_factory=dict, init=False)
    """Session -> the labels of one of its sandboxes that another live process of this
    pool's name held at the last reconcile pass (see `held_elsewhere`)."""

    def __contains__(self, session_id: object) -> bool:
        """Whether the session is open."""
        return session_id in self.sessions

    # -- sessions -------------------------------------------------------------------

    def open(self, session_id: str, lease: float | None) -> None:
        now = time.monotonic()
        self.sessions.setdefault(
            session_id, Session(session_id, lease or self.config.lease, now)
        ).last_seen = now

    def heartbeat(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is None:
            raise errors.SessionExpired(f"session {session_id} is unknown or expired")
        session.last_seen = time.monotonic()

    def end(self, session_id: str) -> Session | None:
        """Take the session off the open ones; what it held is the caller's to release."""
        return self.sessions.pop(session_id, None)

    def stalled(self, seconds: float) -> None:
        """The pool stood still for ``seconds``: no heartbeat could be served meanwhile,
        so that time does not count against any session's lease."""
        for session in self.sessions.values():
            session.last_seen += seconds

    def expired(self, now: float) -> list[str]:
        """The sessions whose lease ended by ``now`` (monotonic)."""
        return [s.id for s in self.sessions.values() if now - s.last_seen > s.lease]

    def held_elsewhere(self, session: str) -> Mapping[str, str] | None:
        """See `Pool.held_elsewhere`."""
        return self.elsewhere.get(session)

    # -- leases ---------------------------------------------------------------------

    def lease(self, record: Record, session_id: str) -> None:
        """Lease ``record`` to the session in memory; released if the session is gone."""
        session = self.sessions.get(session_id)
        if session is None:
            self.release(record, reason="session gone before hand-over")
            return
        record.session = session_id
        self.ledger.set_state(record, "leased")
        record.stamp("handed_out")
        session.sandboxes.add(record.id)
        self.emit("sandbox.leased", record)

    def let_go(self, record: Record) -> None:
        """``record`` is no longer among its session's sandboxes."""
        if record.session is not None and (session := self.sessions.get(record.session)):
            session.sandboxes.discard(record.id)

    def held_by(self, session: Session) -> Iterator[Record]:
        """The records of the sandboxes ``session`` holds (a copy: release them freely)."""
        for sandbox_id in list(session.sandboxes):
            record = self.ledger.records.get(sandbox_id)
            if record is not None:
                yield record

    async def record_hand_over(self, record: Record, session: str) -> None:
        """The session label, written durably; throttling and capacity errors are waited out."""
        if not self.config.record_hand_over:
            return
        backoff = self.config.delete_backoff
        for attempt in range(self.config.retry_limit + 1):
            try:
                await self.provider.relabel(record.id, {LABEL_SESSION: session})
            except errors.SandboxError as exc:
                if not exc.retryable or attempt == self.config.retry_limit:
                    raise
                await asyncio.sleep(getattr(exc, "retry_after", None) or backoff)
                backoff = min(backoff * 2, self.config.delete_backoff_max)
            else:
                record.labels[LABEL_SESSION] = session
                return

    # -- release and delete ---------------------------------------------------------

    def release(
        self,
        record: Record,
        *,
        reason: str,
        state: Literal["releasing", "failed"] = "releasing",
        force: bool = False,
    ) -> None:
        if record.state in ("releasing", "gone", "lost") or (
            record.state == "failed" and state == "failed"
        ):
            return
        if record.state in ("creating", "starting") and not force:
            # Deleting while the create is still running could race it: the
            # create path releases the sandbox as soon as it has one.
            record.release_requested = True
            return
        self.let_go(record)
        self.ledger.set_state(record, state)
        record.stamp("released")
        self.emit("sandbox.released", record, reason=reason)
        self.delete_later(record)

    def delete_later(self, record: Record) -> None:
        """Delete it in the background (`delete`)."""
        self.spawn(self.delete(record), f"sandman-delete-{record.id}")

    async def delete(self, record: Record) -> None:
        """Delete the sandbox, retrying until the provider says it is gone."""
        backoff = self.config.delete_backoff
        lost = record.state == "lost"  # stays so: its holder is told why, not "gone"
        if not lost:
            self.ledger.set_state(record, "releasing")
        await self._last_usage(record)
        while True:
            try:
                await self.provider.delete(record.id)
                break
            except errors.ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - any backend failure: retry until gone
                self.emit("delete.failed", record, error=repr(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.delete_backoff_max)
        record.stamp("gone")
        self.ledger.forget(record)
        if not lost:
            self.ledger.set_state(record, "gone")
        elif record.session is not None and not record.release_requested:
            self.ledger.remember_lost(record)
        # Where its time went, with the sandbox it was: `sandman report` reads it.
        self.emit(
            "delete.complete", record, image=record.spec.image, timeline=dict(record.timeline)
        )

    async def _last_usage(self, record: Record) -> None:
        """Read what a sandbox used, once more before it is deleted (a rollout's cost);
        a read that fails or takes long is skipped: the delete goes first."""
        if not isinstance(self.provider, ReportsUsage) or record.info is None:
            return
        fresh = record.usage is not None and time.monotonic() - record.usage_read_at < USAGE_FRESH
        if not fresh:  # else read by the release itself (`Pool.usage`): once is enough
            try:
                async with asyncio.timeout(2.0):
                    record.usage = await self.provider.usage(record.id)
            except (errors.SandboxError, OSError, TimeoutError):
                return
        assert record.usage is not None
        self.emit("sandbox.usage", record, **record.usage.model_dump())
