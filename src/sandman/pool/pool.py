"""The pool: between callers and a provider, it paces creation, waits for readiness,
hands sandboxes out under leases, and keeps cleanup responsibility whatever callers do.

`Pool` is the public face and the loops; its parts do the work, each given what it
needs: the records (`ledger`), sessions, leases and deletes (`leases`), creation and
delivery (`creation`, paced by `pacing`, with warm `spares`), lost sandboxes
(`losses`), snapshot, restore and pause (`changes`), and reconcile passes
(`reconcile`, deciding by `plan`). docs/architecture.md says where each lives.

Lifecycle of a sandbox (see `records.State`)::

    queued -> creating -> starting -> ready -> leased -> releasing -> gone
                  \\           \\                            ^
                   `-----------`-> failed ----------------'   (deleted until the backend says gone)
    ready, leased -> lost   (died by itself: deleted the same way, the record stays lost)

A ready or leased sandbox whose daemon dies (OOM, a crash, killed from the host, its
pod evicted) is ``lost``: the provider tells at once (`WatchesLost`), else the
reconcile pass finds it stopped or missing. Its resources are deleted as for a
release, and its holder's next call raises `SandboxLost` with the reason; the record
stays (in state ``lost``) among the last `PoolConfig.remember_lost` lost ones only.

Invariants kept here:
- the intent (id, labels, expiry) is recorded before the provider is called, so
  a crash in between leaks nothing the reconciler cannot find by label;
- a sandbox whose caller gave up is handed to the next waiter for the same
  spec, kept as a warm spare, or deleted: never leaked;
- a released, expired, failed or orphaned sandbox is deleted with retries
  until the provider confirms it is gone;
- a session that stops heartbeating loses its sandboxes when its lease ends;
- a hand-over is recorded on the sandbox (its session label) before the caller
  is answered, and adoption leases only sandboxes whose hand-over is on record.
- a sandbox that died by itself is deleted, and its holder told why.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Self

from sandman import errors
from sandman.egress import Egress
from sandman.models import SandboxSpec, Usage
from sandman.pool import owner as owners
from sandman.pool.changes import Changes
from sandman.pool.config import PoolConfig, PoolHealth
from sandman.pool.creation import Creation, Request
from sandman.pool.events import EventHook, PoolEvent, emit
from sandman.pool.leases import Leases
from sandman.pool.ledger import Ledger
from sandman.pool.losses import Losses
from sandman.pool.pacing import Pacer
from sandman.pool.reconcile import Reconciler
from sandman.pool.records import Record
from sandman.pool.snapshots import SnapshotBook
from sandman.pool.spares import Spares
from sandman.pool.tally import Tally
from sandman.providers.base import ChangesEgress, Provider, ReportsUsage, SnapshotInfo

__all__ = ["Pool", "PoolConfig", "PoolHealth"]

logger = logging.getLogger(__name__)

HAND_OVER_GRACE = 5.0
"""Seconds recording a hand-over may take past the caller's deadline."""


class Pool:
    """Sandboxes from one provider for many callers, paced, leased and always cleaned up.

    Use as ``async with Pool(provider) as pool``; `aclose` releases everything
    (or, with ``release=False``, leaves running sandboxes for the next pool of
    the same name to adopt).
    """

    def __init__(
        self,
        provider: Provider,
        config: PoolConfig | None = None,
        *,
        hook: EventHook | None = None,
    ) -> None:
        self.provider = provider
        self.config = config = config or PoolConfig()
        self._hook = hook
        self._pacer: Pacer[Request] = Pacer(config.pacing, time.monotonic())
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._contact: float | None = None  # monotonic: the provider answered last
        self._reconcile_every = config.reconcile_interval
        self.owner = owners.current()
        """This pool's process, as every sandbox it creates or adopts names it: on a provider
        that keeps owner records (`KeepsOwners`), its record there, once started."""
        self._book = SnapshotBook(provider, config.name, lambda: self.owner, config.lifetime)
        # The parts, each given what it needs (docs/architecture.md: "The pool's parts").
        emit, owner, touch = self._emit, lambda: self.owner, self._touch
        ledger = self._ledger = Ledger(config.name, config.remember_lost)
        leases = self._leases = Leases(provider, config, ledger, emit, self._spawn)
        spares = self._spares = Spares()
        losses = self._losses = Losses(provider, config, ledger, leases, spares, emit)
        self._creation = Creation(
            provider, config, self._pacer, ledger, leases, spares, losses, emit,
            owner=owner, touch=touch,
        )  # fmt: skip
        self._changes = Changes(config, self._book, ledger, losses, emit)
        self._reconciler = Reconciler(
            provider, config, ledger, leases, losses, self._book, emit,
            owner=owner, open_session=self.open_session, touch=touch,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"Pool({self.config.name!r}, provider={self.provider.name!r}, sandboxes={len(self._ledger.records)})"

    # -- lifecycle of the pool ------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Reconcile with the provider once, then start the background loops."""
        if self._started:
            return
        self._started = True
        # Before the first create: a sandbox must never name an owner not on record.
        owner = await self._reconciler.open_owner()
        if owner is not None:
            self.owner = owner
        # Asked for first, so that no loss among the sandboxes adopted is missed.
        losses = self._losses.reports()
        try:
            await self.reconcile(adopt=self.config.adopt_orphans)
        except BaseException:
            if losses is not None:
                await losses.aclose()
            await self._reconciler.close_owner()
            raise
        self._loops = [
            asyncio.create_task(self._creation.schedule(), name="sandman-pool-scheduler"),
            asyncio.create_task(self._maintain(), name="sandman-pool-maintenance"),
        ]
        if losses is not None:
            self._loops.append(
                asyncio.create_task(self._losses.follow(losses), name="sandman-pool-losses")
            )

    async def aclose(self, *, release: bool = True, timeout: float = 60.0) -> None:
        """Stop handing out sandboxes; release them all (default) and wait until they are gone."""
        if self._closed:
            return
        self._closed = True
        for loop in self._loops:
            loop.cancel()
        # Waiters fail; creations in flight are abandoned: each deletes what it made.
        await self._creation.close()
        records = self._ledger.records
        if release:
            for record in list(records.values()):
                self._leases.release(record, reason="pool closed")
        else:
            self._spawn(self._reconciler.disown(), "sandman-pool-disown")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._drain()
                # A delete cut short (its task cancelled: asyncio.run cancels every
                # task left when its main one returns, this close's caller among
                # them) is done again: what is released here must be gone.
                for record in list(records.values()):
                    if release or record.state not in ("ready", "leased"):
                        self._leases.delete_later(record)
                await self._drain()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        if release:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._book.close()
        await self._reconciler.close_owner()

    async def _drain(self) -> None:
        """Wait until the background tasks are done, those they start meanwhile too."""
        # The pending ones only: a task stays in the set until its done callback
        # runs, and on Python 3.12 gather() of tasks already done completes without
        # yielding, so waiting on the whole set spun for ever (a hung interpreter
        # exit after asyncio.run had cancelled the pool's deletes).
        while pending := [task for task in self._tasks if not task.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.PoolClosed("the pool is closed")
        if not self._started:
            raise errors.ConfigError("the pool is not started: use `async with Pool(...)`")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _touch(self) -> None:
        """The provider answered."""
        self._contact = time.monotonic()

    def add_hook(self, hook: EventHook) -> None:
        """Also call ``hook`` with every lifecycle event, after the hooks already set
        (the service feeds its metrics this way). A failing hook is logged, never raised."""
        previous = self._hook
        if previous is None:
            self._hook = hook
            return

        def both(event: PoolEvent) -> None:
            try:
                previous(event)
            finally:
                hook(event)

        self._hook = both

    def _emit(self, name: str, record: Record | None = None, **detail: object) -> None:
        emit(
            self._hook,
            PoolEvent(
                name,
                self.config.name,
                sandbox_id=record.id if record else None,
                session=record.session if record else None,
                detail=dict(detail),
            ),
        )

    # -- sessions -------------------------------------------------------------------

    def open_session(self, session_id: str | None = None, *, lease: float | None = None) -> str:
        """A client session; keep it alive with `heartbeat` or lose its sandboxes after the lease."""
        self._check_open()
        sid = session_id or f"s-{secrets.token_hex(6)}"
        self._leases.open(sid, lease)
        return sid

    def heartbeat(self, session_id: str) -> None:
        """Extend the session's lease; SessionExpired if it already expired."""
        self._leases.heartbeat(session_id)

    def close_session(self, session_id: str) -> None:
        """End the session: everything it holds is released."""
        session = self._leases.end(session_id)
        if session is None:
            return
        self._creation.cancel_waiters(session_id)
        for record in self._leases.held_by(session):
            self._leases.release(record, reason="session closed")

    # -- acquire / release ----------------------------------------------------------

    async def acquire(
        self, spec: SandboxSpec, *, session: str, timeout: float | None = None
    ) -> Record:
        """A ready sandbox for ``spec``, leased to ``session``.

        Waits at most ``timeout`` seconds (CreateTimeout). If the caller gives up
        (timeout or cancellation), a sandbox being made for it goes to the next
        waiter for the same spec, to the warm spares, or is deleted. The
        hand-over is recorded on the sandbox (`PoolConfig.record_hand_over`)
        before this returns; a sandbox whose hand-over cannot be recorded is
        deleted, never returned (one more is tried, then ProviderError).
        SessionExpired if the session is over, or ends while this waits.
        """
        self._check_open()
        if session not in self._leases:
            raise errors.SessionExpired(f"session {session} is unknown or expired")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        for attempt in (1, 2):
            left = None if deadline is None else max(0.0, deadline - loop.time())
            record = await self._creation.take(spec, session, left)
            # A sandbox ready in time is not thrown away for a write of a few ms.
            until = None if deadline is None else max(deadline, loop.time() + HAND_OVER_GRACE)
            try:
                async with asyncio.timeout_at(until):
                    await self._leases.record_hand_over(record, session)
            except BaseException as exc:
                # Nobody may get, or keep, a sandbox whose hand-over is not on record.
                self._leases.release(record, reason="hand-over not recorded")
                if isinstance(exc, TimeoutError):
                    raise errors.CreateTimeout(
                        f"no sandbox of {spec.image!r} within {timeout} s (pool "
                        f"{self.config.name!r}): recording the hand-over of {record.id} "
                        "did not finish"
                    ) from None
                if not isinstance(exc, Exception):
                    raise
                self._emit("handover.failed", record, error=repr(exc), attempt=attempt)
                if session not in self._leases:
                    raise errors.SessionExpired(f"session {session} ended while waiting") from exc
                if attempt == 2 or self._closed:
                    raise errors.ProviderError(
                        f"could not record the hand-over of sandbox {record.id} to session "
                        f"{session}: {exc}"
                    ) from exc
                continue
            if record.state != "leased" or record.session != session:
                # Released (its session ended) or lost while the hand-over was recorded.
                if session not in self._leases:
                    raise errors.SessionExpired(f"session {session} ended while waiting")
                self._check_open()
                self._emit("handover.failed", record, error=record.state, attempt=attempt)
                if attempt == 2:
                    raise errors.ProviderError(
                        f"sandbox {record.id} was {record.state} at its hand-over"
                    )
                continue
            return record
        raise AssertionError("unreachable")  # pragma: no cover

    def release(self, sandbox_id: str) -> None:
        """Give a sandbox back; it is deleted in the background. Idempotent."""
        # A lost one's holder has heard of it, or no longer cares: forget it.
        self._ledger.lost.pop(sandbox_id, None)
        record = self._ledger.records.get(sandbox_id)
        if record is not None:
            if record.state == "lost":
                record.release_requested = True  # not remembered once deleted
            self._leases.release(record, reason="released")

    def get(self, sandbox_id: str) -> Record:
        """The sandbox's record: one the pool holds, or one recently lost (state ``lost``)."""
        return self._ledger.get(sandbox_id)

    async def check(self, sandbox_id: str) -> Record:
        """The sandbox's record if it is leased and the provider says it runs.

        Raises `SandboxLost` (with the reason) for one that died by itself, also
        when only this question finds it so (the provider says it stopped, or has it
        no more: it is marked lost here), and `SandboxNotFound` for one released,
        expired or unknown.
        """
        record = self.get(sandbox_id)
        if record.state == "leased":
            await self._losses.inspect(record)
        if record.lost is not None:
            raise errors.SandboxLost.of(sandbox_id, record.lost.reason, record.lost.detail)
        if record.state != "leased":
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is gone ({record.state})")
        return record

    def list(self, *, session: str | None = None) -> list[Record]:
        return [r for r in self._ledger.records.values() if session is None or r.session == session]

    def stats(self) -> dict[str, float]:
        """Counts per state plus the pacer's numbers, for metrics and dashboards."""
        counts: dict[str, float] = {}
        for record in self._ledger.records.values():
            counts[record.state] = counts.get(record.state, 0) + 1
        counts["sessions"] = len(self._leases.sessions)
        counts["snapshots"] = len(self._book.list())
        counts.update({f"pacing_{k}": v for k, v in self._pacer.stats().items()})
        return counts

    def health(self) -> PoolHealth:
        """Started, closed, when the provider last answered, and any background loop that
        ended by itself (cheap: no call to the provider)."""
        stopped = () if self._closed else tuple(t.get_name() for t in self._loops if t.done())
        now = time.monotonic()
        return PoolHealth(
            started=self._started,
            closed=self._closed,
            provider_age=None if self._contact is None else now - self._contact,
            reconcile_interval=self._reconcile_every,
            stopped=stopped,
        )

    def tally(self, key: Callable[[Record], str | None]) -> Tally:
        """A live count of the sandboxes held (from the recorded intent until released,
        failed or lost) by ``key(record)``, None for one not counted: kept up to date as
        sandboxes come and go, so reading it never scans the records. Kept only as long
        as the caller keeps it."""
        return self._ledger.tally(key)

    async def usage(self, sandbox_id: str) -> Usage | None:
        """What the sandbox has used: read now while it is held, else as last read (at
        its release); None if the provider cannot tell."""
        record = self.get(sandbox_id)
        if isinstance(self.provider, ReportsUsage) and record.state in ("ready", "leased"):
            record.usage = await self.provider.usage(sandbox_id)
            record.usage_read_at = time.monotonic()
        return record.usage

    # -- snapshots, restore, pause ----------------------------------------------------

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        memory: bool = False,
        ttl: float | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> SnapshotInfo:
        """Keep a held sandbox's files (with ``memory``, its processes too) as a snapshot of
        this pool's, deleted after ``ttl`` seconds (the sandbox lifetime by default), when
        the pool closes, or by its watchdog if the pool dies. The sandbox goes on."""
        self._check_open()
        return await self._changes.snapshot(sandbox_id, memory=memory, ttl=ttl, labels=labels)

    def snapshots(self) -> builtins.list[SnapshotInfo]:
        """This pool's snapshots, oldest first."""
        return self._book.list()

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """One of this pool's snapshots; `SnapshotNotFound` if there is none (any more)."""
        return self._book.get(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot; sandboxes made from it keep their files. Idempotent."""
        await self._book.delete(snapshot_id)
        self._emit("snapshot.deleted", None, snapshot=snapshot_id)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> Record:
        """Reset a held sandbox to a snapshot in place: same id, same lease; its processes
        are the snapshot's (none but the daemon for a files-only one). Its record's
        endpoint is the new daemon's."""
        self._check_open()
        return await self._changes.restore(sandbox_id, snapshot_id)

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Stop a held sandbox's processes until `resume` (with ``memory``, checkpointed
        to disk: no memory held either); its lease and expiry go on."""
        self._check_open()
        await self._changes.pause(sandbox_id, memory=memory)

    async def resume(self, sandbox_id: str) -> Record:
        """Let a paused sandbox run again."""
        self._check_open()
        return await self._changes.resume(sandbox_id)

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        """Change where a held egress sandbox may connect (`Egress`), at once: connections
        it has open are judged by the new rules too. ConfigError if the provider cannot."""
        self._check_open()
        record = self._changes.held(sandbox_id)
        if not isinstance(self.provider, ChangesEgress):
            raise errors.ConfigError(
                f"the {self.provider.name} provider cannot change egress rules"
            )
        await self.provider.set_egress(sandbox_id, egress)
        self._emit("sandbox.egress", record, allow=egress.allow, deny=egress.deny)

    def warm(self, spec: SandboxSpec, count: int) -> None:
        """Keep ``count`` ready spares of ``spec``; an acquire they serve costs only the hand-over."""
        self._check_open()
        if count < 0:
            raise errors.ConfigError("warm count must be >= 0")
        self._creation.warm(spec, count)

    # -- maintenance and reconciliation ----------------------------------------------

    async def _maintain(self) -> None:
        """Expire sessions and sandboxes, top up warm spares, reconcile now and then."""
        last_reconcile = previous = time.monotonic()
        interval = min(1.0, self.config.lease / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            # This loop itself stood still (a debugger, a long synchronous step,
            # SIGSTOP): no heartbeat could have been served meanwhile, so that
            # time does not count against any session's lease.
            stalled = now - previous - interval
            previous = now
            if stalled > interval:
                self._emit("pool.stalled", None, seconds=round(stalled, 3))
                self._leases.stalled(stalled)
            for session_id in self._leases.expired(now):
                self._emit("session.expired", None, session=session_id)
                self.close_session(session_id)
            wall = time.time()
            for record in list(self._ledger.records.values()):
                if record.expires_at < wall and record.state not in ("releasing", "gone"):
                    self._leases.release(record, reason="expired")
            self._creation.top_up()
            await self._book.expire()
            if now - last_reconcile > self._reconcile_every:
                last_reconcile = now
                try:
                    await self.reconcile(adopt=self.config.adopt_orphans, judge=False)
                    took = time.monotonic() - now
                    self._reconcile_every = max(
                        self.config.reconcile_interval, took / self.config.reconcile_share
                    )
                except Exception as exc:
                    # Whatever fails, expiry and reaping go on: an untyped failure here
                    # once ended this loop for good (found by the chaos suite).
                    if not isinstance(exc, errors.SandboxError):
                        logger.exception("reconcile of pool %r failed", self.config.name)
                    self._emit("reconcile.failed", None, error=repr(exc))

    async def reconcile(self, *, adopt: bool = False, judge: bool = True) -> None:
        """Delete what the provider holds for this pool that the pool does not know, or expired;
        mark lost what the pool holds that the provider lists as stopped, or no more.

        With ``adopt``, running unexpired orphans whose hand-over was recorded
        are kept as leased to that session (a session that then never heartbeats
        loses them), each relabelled as this process's first; the rest no caller
        ever received, and they are deleted (only their image is on record, too
        little to serve as a spare of some spec). A sandbox of this pool's name
        that another live process owns is left alone. ``judge`` (at start) first waits
        until each other owner of this pool's sandboxes is judged; without it (the
        periodic passes of a pool that adopts) only the sandboxes of an owner judged
        dead now are adopted: a predecessor that left them while this pool already ran
        (two replicas of a service overlapping in a rolling update or an eviction),
        never one that cannot be judged. With ``reap_dead_owners``,
        also deleted: any pool's sandboxes whose owner process is dead, and
        records of nothing that run nothing (a crash's leftovers).
        """
        await self._reconciler.reconcile(adopt=adopt, judge=judge)

    def held_elsewhere(self, session: str) -> Mapping[str, str] | None:
        """The labels of a sandbox of ``session`` that another live process of this pool's
        name held at the last reconcile pass, or None. A session this pool does not know
        but a predecessor still holds (two replicas of a service overlapping) is about to
        be adopted here, not over: callers should retry rather than give it up."""
        return self._leases.held_elsewhere(session)
