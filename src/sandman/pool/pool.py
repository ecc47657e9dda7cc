"""The pool: between callers and a provider, it paces creation, waits for readiness,
hands sandboxes out under leases, and keeps cleanup responsibility whatever callers do.

(About 1,200 lines: one state machine over one set of records; issue 30
asks for its reconcile and adopt decisions to move out as a pure plan.)

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
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from sandman import errors
from sandman._tracing import span
from sandman.models import SandboxSpec, Usage
from sandman.pool import owner as owners
from sandman.pool.events import EventHook, PoolEvent, emit
from sandman.pool.pacing import FailureKind, Pacer, PacingConfig
from sandman.pool.plan import Adopt, plan_reconcile
from sandman.pool.records import LABEL_EXPIRES, LABEL_POOL, LABEL_SESSION, Record, State
from sandman.pool.snapshots import SnapshotBook
from sandman.pool.tally import HELD, Tally
from sandman.providers.base import (
    BackendOwners,
    KeepsOwners,
    Lost,
    LostReports,
    Provider,
    ReportsUsage,
    SandboxInfo,
    SnapshotInfo,
    WatchesLost,
)

__all__ = ["Pool", "PoolConfig", "PoolHealth"]

logger = logging.getLogger(__name__)

_WARM_CLIENT = "__warm__"
HAND_OVER_GRACE = 5.0
"""Seconds recording a hand-over may take past the caller's deadline."""


@dataclass(frozen=True)
class PoolConfig:
    """How the pool behaves. Times are seconds."""

    name: str = "default"
    """Every sandbox carries the label ``sandman.io/pool=<name>``; the reconciler owns those."""
    lease: float = 30.0
    """A session that has not heartbeated for this long loses its sandboxes."""
    lifetime: float = 6 * 3600.0
    """Hard lifetime of every sandbox (``sandman.io/expires-at``), enforced even across restarts."""
    ready_timeout: float = 120.0
    """How long a created sandbox may take until its daemon answers health."""
    reconcile_interval: float = 15.0
    """Seconds between reconcile passes, at least; a pass lists every sandbox, so when
    one takes longer than ``reconcile_share`` of this, the next waits longer (at 10k
    local sandboxes one takes seconds)."""
    reconcile_share: float = 0.05
    """The most of the pool's time its reconcile passes may take, together."""
    delete_backoff: float = 0.2
    delete_backoff_max: float = 10.0
    retry_limit: int = 5
    """How often one request is re-queued after retryable failures (throttling, capacity)."""
    remember_lost: int = 1000
    """How many lost sandboxes (deleted already) are remembered, so that their holders'
    next calls say why (`SandboxLost`); the oldest are forgotten first."""
    adopt_orphans: bool = False
    """At start, keep running sandboxes a previous life of this pool left instead of deleting
    them: those whose hand-over it recorded, as leased to that session. The rest (being
    created, or spares no caller received) are deleted."""
    record_hand_over: bool = True
    """Record each hand-over on the sandbox itself (its ``sandman.io/session`` label, one
    `Provider.relabel`) before the caller is answered, so a later pool of this name adopts
    exactly what callers received. Only a pool no one will ever adopt (a unique name,
    swept by its watchdog: ``sandman.local()``) may save the call."""
    reap_dead_owners: bool | None = None
    """Reconcile also deletes sandboxes of any pool whose owner (``sandman.io/owner``, see
    `sandman.pool.owner`) is a dead process, and records of nothing that run nothing
    (older than ``stray_grace``). None: on the local provider, where listing every
    sandbox is cheap and owners are processes of this host; and on a provider that keeps
    owner records itself (`KeepsOwners`: Kubernetes' Leases), for the sandboxes of the
    owners its records say are dead only (one list of records, then one of sandboxes per
    dead owner). False: neither."""
    stray_grace: float = 60.0
    """How old a record of nothing must be before it is reaped: a create in flight is one
    for a moment."""
    pacing: PacingConfig = field(default_factory=PacingConfig)

    def __post_init__(self) -> None:
        if not 0 < self.reconcile_share <= 1:
            raise errors.ConfigError(
                f"reconcile_share must be in (0, 1], not {self.reconcile_share!r}"
            )


@dataclass(frozen=True)
class PoolHealth:
    """How the pool is doing now (`Pool.health`): what a service's probes are made of."""

    started: bool
    closed: bool
    provider_age: float | None
    """Seconds since the provider last answered (a reconcile pass's list, a create);
    None if it never has."""
    reconcile_interval: float
    """Seconds between reconcile passes now (longer while passes are slow)."""
    stopped: tuple[str, ...]
    """The background loops that ended by themselves (a bug): nothing is handed out,
    expired or reconciled any more, and only a restart helps."""

    @property
    def provider_reached(self) -> bool:
        """Whether the provider answered recently: within two and a half reconcile
        intervals (so one pass may fail on a moment's trouble, and a pass's own list
        takes a fraction of an interval), so a pool that cannot reach its backend says so."""
        return (
            self.provider_age is not None
            and self.provider_age <= _REACHED_INTERVALS * self.reconcile_interval
        )


_REACHED_INTERVALS = 2.5


def _key(spec: SandboxSpec) -> str:
    return spec.model_dump_json()


@dataclass(eq=False)
class _Request:
    spec: SandboxSpec
    session: str
    future: asyncio.Future[Record]
    queued_at: float
    warm: bool = False
    attempts: int = 0
    key: str = ""
    creating_since: float | None = None  # monotonic; None while queued
    creating: str | None = None  # the id of the sandbox being created for it
    last_error: Exception | None = None  # of the last failed try, when it is retried

    def __post_init__(self) -> None:
        self.key = _key(self.spec)


@dataclass
class _Session:
    id: str
    lease: float
    last_seen: float
    sandboxes: set[str] = field(default_factory=set)


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
        self.config = config or PoolConfig()
        self._hook = hook
        self._pacer: Pacer[_Request] = Pacer(self.config.pacing, time.monotonic())
        self._records: dict[str, Record] = {}
        self._tallies: weakref.WeakSet[Tally] = weakref.WeakSet()  # kept by their readers
        # Lost and deleted, kept (a bounded few) until their holders are told.
        self._lost: OrderedDict[str, Record] = OrderedDict()
        # Session -> the labels of one of its sandboxes that another live process of this
        # pool's name held at the last reconcile pass (see `held_elsewhere`).
        self._elsewhere: dict[str, dict[str, str]] = {}
        self._watcher = provider if isinstance(provider, WatchesLost) else None
        self._keeper = provider if isinstance(provider, KeepsOwners) else None
        self._owner_open = False
        self._sessions: dict[str, _Session] = {}
        # Keyed by the spec's JSON: specs hold dicts, so they are not hashable.
        self._waiting: dict[str, deque[_Request]] = {}
        self._idle: dict[str, deque[str]] = {}
        self._warm: dict[str, tuple[SandboxSpec, int]] = {}
        self._warm_pending: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._creates: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._contact: float | None = None  # monotonic: the provider answered last
        self._reconcile_every = self.config.reconcile_interval
        self.owner = owners.current()
        """This pool's process, as every sandbox it creates or adopts names it: on a provider
        that keeps owner records (`KeepsOwners`), its record there, once started."""
        self._book = SnapshotBook(
            provider, self.config.name, lambda: self.owner, self.config.lifetime
        )

    def __repr__(self) -> str:
        return f"Pool({self.config.name!r}, provider={self.provider.name!r}, sandboxes={len(self._records)})"

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
        if self._keeper is not None:
            # Before the first create: a sandbox must never name an owner not on record.
            owner = await self._keeper.open_owner()
            self._owner_open = True
            if owner is not None:
                self.owner = owner
        # Asked for first, so that no loss among the sandboxes adopted is missed.
        losses = self._watcher.lost() if self._watcher is not None else None
        try:
            await self.reconcile(adopt=self.config.adopt_orphans)
        except BaseException:
            if losses is not None:
                await losses.aclose()
            await self._close_owner()
            raise
        self._loops = [
            asyncio.create_task(self._schedule(), name="sandman-pool-scheduler"),
            asyncio.create_task(self._maintain(), name="sandman-pool-maintenance"),
        ]
        if losses is not None:
            self._loops.append(
                asyncio.create_task(self._follow_losses(losses), name="sandman-pool-losses")
            )

    async def aclose(self, *, release: bool = True, timeout: float = 60.0) -> None:
        """Stop handing out sandboxes; release them all (default) and wait until they are gone."""
        if self._closed:
            return
        self._closed = True
        for loop in self._loops:
            loop.cancel()
        for queue in self._waiting.values():
            for request in queue:
                if not request.future.done():
                    request.future.set_exception(errors.PoolClosed("the pool is closed"))
        self._waiting.clear()
        # Creations in flight are abandoned: each deletes what it made.
        for create in self._creates:
            create.cancel()
        await asyncio.gather(*self._creates, return_exceptions=True)
        if release:
            for record in list(self._records.values()):
                self._release(record, reason="pool closed")
        else:
            self._spawn(self._disown(), "sandman-pool-disown")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._drain()
                # A delete cut short (its task cancelled: asyncio.run cancels every
                # task left when its main one returns, this close's caller among
                # them) is done again: what is released here must be gone.
                for record in list(self._records.values()):
                    if release or record.state not in ("ready", "leased"):
                        self._spawn(self._delete(record), f"sandman-delete-{record.id}")
                await self._drain()
        for loop in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        if release:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._book.close()
        await self._close_owner()

    async def _close_owner(self) -> None:
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
            self._emit("owner.close_failed", None, error=repr(exc))

    async def _drain(self) -> None:
        """Wait until the background tasks are done, those they start meanwhile too."""
        # The pending ones only: a task stays in the set until its done callback
        # runs, and on Python 3.12 gather() of tasks already done completes without
        # yielding, so waiting on the whole set spun for ever (a hung interpreter
        # exit after asyncio.run had cancelled the pool's deletes).
        while pending := [task for task in self._tasks if not task.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _disown(self) -> None:
        """Left for the next pool of this name: no longer this process's, whose exit
        would make them a dead owner's, for any pool (and `sandman gc`) to reap."""
        gate = asyncio.Semaphore(32)

        async def one(record: Record) -> None:
            async with gate:
                try:
                    await self.provider.relabel(record.id, {owners.LABEL_OWNER: None})
                except errors.SandboxError as exc:
                    self._emit("disown.failed", record, error=repr(exc))

        kept = [r for r in self._records.values() if r.state in ("ready", "leased")]
        await asyncio.gather(*(one(record) for record in kept))

    def _check_open(self) -> None:
        if self._closed:
            raise errors.PoolClosed("the pool is closed")
        if not self._started:
            raise errors.ConfigError("the pool is not started: use `async with Pool(...)`")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        self._sessions.setdefault(
            sid, _Session(sid, lease or self.config.lease, time.monotonic())
        ).last_seen = time.monotonic()
        return sid

    def heartbeat(self, session_id: str) -> None:
        """Extend the session's lease; SessionExpired if it already expired."""
        session = self._sessions.get(session_id)
        if session is None:
            raise errors.SessionExpired(f"session {session_id} is unknown or expired")
        session.last_seen = time.monotonic()

    def close_session(self, session_id: str) -> None:
        """End the session: everything it holds is released."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        for queue in self._waiting.values():
            for request in queue:
                if request.session == session_id and not request.future.done():
                    request.future.cancel()
        for sandbox_id in list(session.sandboxes):
            record = self._records.get(sandbox_id)
            if record is not None:
                self._release(record, reason="session closed")

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
        if session not in self._sessions:
            raise errors.SessionExpired(f"session {session} is unknown or expired")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        for attempt in (1, 2):
            left = None if deadline is None else max(0.0, deadline - loop.time())
            record = await self._take(spec, session, left)
            # A sandbox ready in time is not thrown away for a write of a few ms.
            until = None if deadline is None else max(deadline, loop.time() + HAND_OVER_GRACE)
            try:
                async with asyncio.timeout_at(until):
                    await self._record_hand_over(record, session)
            except BaseException as exc:
                # Nobody may get, or keep, a sandbox whose hand-over is not on record.
                self._release(record, reason="hand-over not recorded")
                if isinstance(exc, TimeoutError):
                    raise errors.CreateTimeout(
                        f"no sandbox of {spec.image!r} within {timeout} s (pool "
                        f"{self.config.name!r}): recording the hand-over of {record.id} "
                        "did not finish"
                    ) from None
                if not isinstance(exc, Exception):
                    raise
                self._emit("handover.failed", record, error=repr(exc), attempt=attempt)
                if session not in self._sessions:
                    raise errors.SessionExpired(f"session {session} ended while waiting") from exc
                if attempt == 2 or self._closed:
                    raise errors.ProviderError(
                        f"could not record the hand-over of sandbox {record.id} to session "
                        f"{session}: {exc}"
                    ) from exc
                continue
            if record.state != "leased" or record.session != session:
                # Released (its session ended) or lost while the hand-over was recorded.
                if session not in self._sessions:
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

    async def _record_hand_over(self, record: Record, session: str) -> None:
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

    async def _take(self, spec: SandboxSpec, session: str, timeout: float | None) -> Record:
        """A sandbox leased to ``session`` in memory: a spare, or one made for it."""
        idle = self._take_idle(spec)
        if idle is not None:
            self._lease(idle, session)
            return idle
        request = _Request(spec, session, asyncio.get_running_loop().create_future(), time.time())
        self._queue(request)
        try:
            async with asyncio.timeout(timeout):
                return await request.future
        except BaseException as exc:
            future = request.future
            if future.done() and not future.cancelled() and future.exception() is None:
                # Handed over, but the caller was cut off (cancelled, or its
                # deadline fired) before it resumed: it never gets the
                # sandbox, so no one may keep holding it.
                self._release(future.result(), reason="caller gone after the hand-over")
            if isinstance(exc, TimeoutError):
                raise errors.CreateTimeout(
                    f"no sandbox of {spec.image!r} within {timeout} s "
                    f"(pool {self.config.name!r}): " + self._whereabouts(request)
                ) from None
            if (
                isinstance(exc, asyncio.CancelledError)
                and future.cancelled()
                and session not in self._sessions
                and not _cancelling()
            ):
                # Not this caller cancelled: its session ended (`close_session`).
                raise errors.SessionExpired(f"session {session} ended while waiting") from None
            raise
        finally:
            if not request.future.done():
                request.future.cancel()
            # Dropped before any create if it was still queued; no longer a waiter
            # either way (a create under way for it hands its sandbox on by itself).
            if self._pacer.cancel(request):
                self._wake.set()
            self._drop_waiting(request)

    def _whereabouts(self, request: _Request) -> str:
        """Where a request that timed out had got to, for its error: the pacer's queue
        (the cluster is busy), a create (slow), or retries (what failed)."""
        if request.creating_since is None:
            where = (
                f"still queued, {self._pacer.queued()} requests waiting to be created "
                f"at {self._pacer.rate:.3g}/s with {self._pacer.in_flight} of "
                f"{self._pacer.window} creates in flight"
            )
        else:
            where = f"its sandbox was being created for {time.monotonic() - request.creating_since:.1f} s"
            detail = self.provider.progress(request.creating) if request.creating else None
            if detail:
                where += f" ({detail})"
        if request.last_error is not None:
            where += f"; try {request.attempts} failed: {request.last_error}"
        return where

    def release(self, sandbox_id: str) -> None:
        """Give a sandbox back; it is deleted in the background. Idempotent."""
        # A lost one's holder has heard of it, or no longer cares: forget it.
        self._lost.pop(sandbox_id, None)
        record = self._records.get(sandbox_id)
        if record is not None:
            if record.state == "lost":
                record.release_requested = True  # not remembered once deleted
            self._release(record, reason="released")

    def get(self, sandbox_id: str) -> Record:
        """The sandbox's record: one the pool holds, or one recently lost (state ``lost``)."""
        record = self._records.get(sandbox_id) or self._lost.get(sandbox_id)
        if record is None:
            raise errors.SandboxNotFound(
                f"sandbox {sandbox_id} is not in pool {self.config.name!r}"
            )
        return record

    async def check(self, sandbox_id: str) -> Record:
        """The sandbox's record if it is leased and the provider says it runs.

        Raises `SandboxLost` (with the reason) for one that died by itself, also
        when only this question finds it so (the provider says it stopped, or has it
        no more: it is marked lost here), and `SandboxNotFound` for one released,
        expired or unknown.
        """
        record = self.get(sandbox_id)
        if record.state == "leased":
            changes = record.changes
            try:
                info: SandboxInfo | None = await self.provider.inspect(sandbox_id)
            except errors.SandboxNotFound:
                info = None
            if record.state == "leased" and _dead(info) and record.changes == changes:
                self._lose(record, _loss_of(sandbox_id, info))
        if record.lost is not None:
            raise errors.SandboxLost.of(sandbox_id, record.lost.reason, record.lost.detail)
        if record.state != "leased":
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is gone ({record.state})")
        return record

    def list(self, *, session: str | None = None) -> list[Record]:
        return [r for r in self._records.values() if session is None or r.session == session]

    def stats(self) -> dict[str, float]:
        """Counts per state plus the pacer's numbers, for metrics and dashboards."""
        counts: dict[str, float] = {}
        for record in self._records.values():
            counts[record.state] = counts.get(record.state, 0) + 1
        counts["sessions"] = len(self._sessions)
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
        tally = Tally(key)
        for record in self._records.values():
            if record.state in HELD:
                tally.held(record)
        self._tallies.add(tally)
        return tally

    async def usage(self, sandbox_id: str) -> Usage | None:
        """What the sandbox has used: read now while it is held, else as last read (at
        its release); None if the provider cannot tell."""
        record = self.get(sandbox_id)
        if isinstance(self.provider, ReportsUsage) and record.state in ("ready", "leased"):
            record.usage = await self.provider.usage(sandbox_id)
        return record.usage

    # -- snapshots, restore, pause ----------------------------------------------------

    def _held(self, sandbox_id: str) -> Record:
        record = self.get(sandbox_id)
        if record.lost is not None:
            raise errors.SandboxLost.of(sandbox_id, record.lost.reason, record.lost.detail)
        if record.state not in ("ready", "leased"):
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is gone ({record.state})")
        return record

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
        record = self._held(sandbox_id)
        with _changing(record):
            info = await self._book.make(sandbox_id, memory=memory, ttl=ttl, labels=labels)
        self._emit("snapshot.made", self._records.get(sandbox_id), snapshot=info.id, size=info.size)
        return info

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
        record = self._held(sandbox_id)
        self._book.get(snapshot_id)
        keeper = self._book.keeper()
        with _changing(record):
            info = await keeper.restore(sandbox_id, snapshot_id)
            if info.endpoint is not None:
                async with info.endpoint.client() as daemon:
                    await daemon.wait_ready(self.config.ready_timeout)
            record.paused_memory = False
        record.info = info
        self._watch(info)
        self._emit("sandbox.restored", record, snapshot=snapshot_id)
        return record

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        """Stop a held sandbox's processes until `resume` (with ``memory``, checkpointed
        to disk: no memory held either); its lease and expiry go on."""
        self._check_open()
        record = self._held(sandbox_id)
        with _changing(record):
            await self._book.keeper().pause(sandbox_id, memory=memory)
            record.paused_memory = memory  # no container until resumed: no loss
        self._emit("sandbox.paused", self._records.get(sandbox_id))

    async def resume(self, sandbox_id: str) -> Record:
        """Let a paused sandbox run again."""
        self._check_open()
        record = self._held(sandbox_id)
        with _changing(record):
            info = await self._book.keeper().resume(sandbox_id)
            record.paused_memory = False
        if info.endpoint is not None:
            record.info = info
            self._watch(info)
        self._emit("sandbox.resumed", record)
        return record

    def warm(self, spec: SandboxSpec, count: int) -> None:
        """Keep ``count`` ready spares of ``spec``; an acquire they serve costs only the hand-over."""
        self._check_open()
        if count < 0:
            raise errors.ConfigError("warm count must be >= 0")
        self._warm[_key(spec)] = (spec, count)
        self._wake.set()

    # -- internals: queueing and creation ------------------------------------------

    def _queue(self, request: _Request) -> None:
        self._waiting.setdefault(request.key, deque()).append(request)
        self._pacer.enqueue(_WARM_CLIENT if request.warm else request.session, request)
        self._wake.set()

    def _take_idle(self, spec: SandboxSpec) -> Record | None:
        spares = self._idle.get(_key(spec))
        while spares:
            record = self._records.get(spares.popleft())
            if record is not None and record.state == "ready":
                return record
        return None

    def _lease(self, record: Record, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            self._release(record, reason="session gone before hand-over")
            return
        record.session = session_id
        self._set_state(record, "leased")
        record.stamp("handed_out")
        session.sandboxes.add(record.id)
        self._emit("sandbox.leased", record)

    async def _schedule(self) -> None:
        """Start creations as the pacer allows, oldest-first per client, clients round robin."""
        while True:
            now = time.monotonic()
            request = self._pacer.next(now)
            if request is None:
                wait = self._pacer.wait_time(now)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                continue
            if request.future.done() and not request.warm:
                self._pacer.on_abandoned(now)  # its caller left between queue and turn
                continue
            task = asyncio.create_task(self._create(request), name="sandman-create")
            self._creates.add(task)
            task.add_done_callback(self._creates.discard)

    async def _create(self, request: _Request) -> None:
        now = time.time()
        expires = now + self.config.lifetime
        record = Record(
            id=f"sb-{secrets.token_hex(6)}",
            spec=request.spec,
            state="creating",
            # No session label: that records the hand-over (`acquire`), not the request.
            labels={
                LABEL_POOL: self.config.name,
                LABEL_EXPIRES: f"{expires:.0f}",
                owners.LABEL_OWNER: self.owner,
            },
            expires_at=expires,
            session=None if request.warm else request.session,
        )
        record.stamp("queued", request.queued_at)
        record.stamp("create_called")
        # The intent is recorded before the backend is called.
        self._add(record)
        self._emit("create.started", record)
        started = request.creating_since = time.monotonic()
        request.creating = record.id
        try:
            with span("create", sandbox=record.id, image=request.spec.image):
                info = await self.provider.create(
                    request.spec, sandbox_id=record.id, labels=record.labels
                )
            self._contact = time.monotonic()
            record.info = info
            self._set_state(record, "starting")
            self._watch(info)
            record.stamp("accepted")
            record.stamp("running")
            if info.endpoint is not None:
                with span("ready", sandbox=record.id):
                    async with info.endpoint.client() as daemon:
                        await daemon.wait_ready(self.config.ready_timeout)
        except asyncio.CancelledError:
            self._pacer.on_abandoned(time.monotonic())
            self._release(record, reason="cancelled during create", state="failed", force=True)
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a provider raises fails this create
            self._failed(request, record, exc)
            return
        self._set_state(record, "ready")
        record.stamp("daemon_ready")
        self._pacer.on_ready(time.monotonic(), time.monotonic() - started)
        self._wake.set()
        self._emit("create.complete", record, seconds=round(time.monotonic() - started, 4))
        if record.release_requested:
            self._drop_waiting(request)
            self._release(record, reason="released while creating")
            return
        self._deliver(record, request)

    def _failed(self, request: _Request, record: Record, exc: Exception) -> None:
        kind, retry_after = _classify(exc)
        self._pacer.on_failed(time.monotonic(), kind, retry_after)
        self._wake.set()
        record.error = exc
        request.last_error, request.creating_since = exc, None
        self._emit("create.failed", record, error=repr(exc), kind=kind, cause=_cause(exc))
        # The backend may hold something even after an error: delete it too.
        self._release(record, reason="create failed", state="failed", force=True)
        retryable = getattr(exc, "retryable", False) or kind in ("throttled", "capacity")
        request.attempts += 1
        if request.future.done() and not request.warm:
            self._drop_waiting(request)
            return
        if retryable and request.attempts <= self.config.retry_limit and not self._closed:
            self._pacer.enqueue(_WARM_CLIENT if request.warm else request.session, request)
            self._wake.set()
        elif request.warm:
            self._warm_pending[request.key] = self._warm_pending.get(request.key, 1) - 1
        else:
            self._drop_waiting(request)
            request.future.set_exception(exc)

    def _drop_waiting(self, request: _Request) -> None:
        """Take ``request`` off its spec's waiters; a spec nobody waits on has no entry
        (specs often carry a task id: one entry per spec ever seen would grow forever)."""
        queue = self._waiting.get(request.key)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(request)
            if not queue:
                del self._waiting[request.key]

    def _deliver(self, record: Record, request: _Request) -> None:
        """Hand a ready sandbox to its requester, else the next waiter, else the spares, else delete."""
        self._drop_waiting(request)
        if request.warm:
            self._warm_pending[request.key] = self._warm_pending.get(request.key, 1) - 1
        if self._closed:
            self._release(record, reason="pool closed")
            return
        if not request.warm and not request.future.done() and request.session in self._sessions:
            self._lease(record, request.session)
            request.future.set_result(record)
            return
        queue = self._waiting.get(request.key, deque())
        while queue:
            other = queue.popleft()
            # Only a waiter still queued (not being created for) takes it over.
            if (
                not other.future.done()
                and other.session in self._sessions
                and self._pacer.cancel(other)
            ):
                if not queue:
                    del self._waiting[request.key]
                self._lease(record, other.session)
                other.future.set_result(record)
                self._emit("sandbox.handed_over", record, from_session=request.session)
                return
            if not other.future.done():
                queue.appendleft(other)
                break
        if request.key in self._waiting and not queue:
            del self._waiting[request.key]
        _, target = self._warm.get(request.key, (record.spec, 0))
        if len(self._idle.get(request.key, ())) < target:
            record.session = None
            self._idle.setdefault(request.key, deque()).append(record.id)
            return
        self._release(record, reason="caller gave up")

    # -- internals: the records ----------------------------------------------------

    def _add(self, record: Record) -> None:
        self._records[record.id] = record
        if record.state in HELD:
            for tally in self._tallies:
                tally.held(record)

    def _set_state(self, record: Record, state: State) -> None:
        """Every change of a recorded sandbox's state, so that the tallies follow it."""
        was_held = record.state in HELD
        record.state = state
        if was_held and state not in HELD:
            for tally in self._tallies:
                tally.let_go(record.id)
        elif state in HELD and not was_held:
            for tally in self._tallies:
                tally.held(record)

    def _forget(self, record: Record) -> None:
        self._records.pop(record.id, None)
        for tally in self._tallies:
            tally.let_go(record.id)

    # -- internals: release and delete ---------------------------------------------

    def _release(
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
        if record.session is not None and (session := self._sessions.get(record.session)):
            session.sandboxes.discard(record.id)
        self._set_state(record, state)
        record.stamp("released")
        self._emit("sandbox.released", record, reason=reason)
        self._spawn(self._delete(record), f"sandman-delete-{record.id}")

    async def _delete(self, record: Record) -> None:
        backoff = self.config.delete_backoff
        lost = record.state == "lost"  # stays so: its holder is told why, not "gone"
        if not lost:
            self._set_state(record, "releasing")
        await self._last_usage(record)
        while True:
            try:
                await self.provider.delete(record.id)
                break
            except errors.ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - any backend failure: retry until gone
                self._emit("delete.failed", record, error=repr(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.delete_backoff_max)
        record.stamp("gone")
        self._forget(record)
        if not lost:
            self._set_state(record, "gone")
        elif record.session is not None and not record.release_requested:
            self._remember_lost(record)
        # Where its time went, with the sandbox it was: `sandman report` reads it.
        self._emit(
            "delete.complete", record, image=record.spec.image, timeline=dict(record.timeline)
        )

    async def _last_usage(self, record: Record) -> None:
        """Read what a sandbox used, once more before it is deleted (a rollout's cost);
        a read that fails or takes long is skipped: the delete goes first."""
        if not isinstance(self.provider, ReportsUsage) or record.info is None:
            return
        try:
            async with asyncio.timeout(2.0):
                record.usage = await self.provider.usage(record.id)
        except (errors.SandboxError, OSError, TimeoutError):
            return
        self._emit("sandbox.usage", record, **record.usage.model_dump())

    # -- internals: lost sandboxes ---------------------------------------------------

    def _watch(self, info: SandboxInfo) -> None:
        """Have the provider tell of this sandbox's death at once, if it can."""
        if self._watcher is None:
            return
        try:
            self._watcher.watch_lost(info)
        except Exception:  # the reconcile pass still finds it
            logger.warning("cannot watch %s for its loss", info.id, exc_info=True)

    async def _follow_losses(self, losses: LostReports) -> None:
        """Mark lost what the provider says died; should its reports fail, ask again."""
        assert self._watcher is not None
        backoff = self.config.delete_backoff
        try:
            while True:
                try:
                    async for lost in losses:
                        backoff = self.config.delete_backoff
                        record = self._records.get(lost.sandbox_id)
                        if record is not None:
                            self._lose(record, lost)
                    raise errors.ProviderError("the provider's reports of lost sandboxes ended")
                except Exception as exc:  # noqa: BLE001 - reconcile covers the gap; ask again
                    self._emit("lost.watch_failed", None, error=repr(exc))
                    await losses.aclose()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.config.delete_backoff_max)
                    losses = self._watcher.lost()
        finally:
            await losses.aclose()

    def _lose(self, record: Record, lost: Lost) -> None:
        """A ready or leased sandbox died by itself: mark it lost, delete what is left."""
        if record.state not in ("ready", "leased") or record.changing or record.paused_memory:
            return  # being created (its create fails), released, or restored (no daemon for now)
        record.lost = lost
        if record.session is not None and (session := self._sessions.get(record.session)):
            session.sandboxes.discard(record.id)
        spares = self._idle.get(_key(record.spec))
        if spares is not None and record.id in spares:
            spares.remove(record.id)  # or the warm count would take it for a spare
        self._set_state(record, "lost")
        record.stamp("lost")
        self._emit("sandbox.lost", record, reason=lost.reason, detail=lost.detail)
        self._spawn(self._delete(record), f"sandman-delete-{record.id}")

    def _remember_lost(self, record: Record) -> None:
        self._lost[record.id] = record
        self._lost.move_to_end(record.id)
        while len(self._lost) > max(0, self.config.remember_lost):
            self._lost.popitem(last=False)

    # -- internals: maintenance -----------------------------------------------------

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
                for session in self._sessions.values():
                    session.last_seen += stalled
            for session in list(self._sessions.values()):
                if now - session.last_seen > session.lease:
                    self._emit("session.expired", None, session=session.id)
                    self.close_session(session.id)
            wall = time.time()
            for record in list(self._records.values()):
                if record.expires_at < wall and record.state not in ("releasing", "gone"):
                    self._release(record, reason="expired")
            self._top_up()
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

    def _top_up(self) -> None:
        for key, (spec, target) in self._warm.items():
            have = len(self._idle.get(key, ())) + self._warm_pending.get(key, 0)
            for _ in range(target - have):
                self._warm_pending[key] = self._warm_pending.get(key, 0) + 1
                request = _Request(
                    spec,
                    _WARM_CLIENT,
                    asyncio.get_running_loop().create_future(),
                    time.time(),
                    warm=True,
                )
                self._pacer.enqueue(_WARM_CLIENT, request)
                self._wake.set()

    def _notice_lost(
        self, held: Iterable[tuple[Record, int]], infos: Iterable[SandboxInfo]
    ) -> None:
        """Mark lost each of ``held`` (ready or leased before the provider listed ``infos``,
        with its count of changes then) that the provider lists as dead (stopped, its
        container gone), or no more; not one whose container changed meanwhile."""
        listed = {info.id: info for info in infos}
        for record, changes in held:
            info = listed.get(record.id)
            if _dead(info) and record.changes == changes:
                self._lose(record, _loss_of(record.id, info))

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
        everyone = self.config.reap_dead_owners
        if everyone is None:
            everyone = self.provider.name == "local"
        mine = {LABEL_POOL: self.config.name}
        held = [(r, r.changes) for r in self._records.values() if r.state in ("ready", "leased")]
        infos = await self.provider.list(labels=None if everyone else mine)
        self._contact = time.monotonic()
        self._notice_lost(held, infos)
        # Listed after the sandboxes: an owner's record is made before its first sandbox,
        # so every sandbox listed whose owner lives has its record listed here.
        backend = await self._backend_owners()
        if adopt and judge and backend is not None:
            backend = await self._judge_predecessors(infos, backend)
        liveness = owners.Liveness(backend)
        plan = plan_reconcile(
            infos,
            known=self._records,
            pool=self.config.name,
            owner=self.owner,
            liveness=liveness,
            now=time.time(),
            adopt=adopt,
            judge=judge,
            stray_grace=self.config.stray_grace,
        )
        for orphan in plan.orphan:
            if orphan.info.id not in self._records:  # an adoption's await may have let one in
                self._orphan(orphan.info, expires=orphan.expires, reason=orphan.reason)
        for adoption in plan.adopt:
            if adoption.info.id not in self._records:
                await self._adopt(adoption)
        elsewhere = plan.elsewhere
        self._elsewhere = elsewhere
        await self._book.reconcile(lambda owner: liveness(owner) != "dead")
        if backend is not None and self.config.reap_dead_owners is not False:
            await self._reap_dead_owners(backend)

    async def _adopt(self, adoption: Adopt) -> None:
        info, session = adoption.info, adoption.session
        record = self._record_of(info, adoption.expires)
        try:
            # Ours before it counts as adopted: a sweep by its old owner spares it.
            await self.provider.relabel(info.id, {owners.LABEL_OWNER: self.owner})
        except errors.SandboxError as exc:
            self._emit("reconcile.orphan", record, state=info.state, error=repr(exc))
            self._release(record, reason="orphan")
            return
        record.labels[owners.LABEL_OWNER] = self.owner
        self.open_session(session)
        self._lease(record, session)
        self._watch(info)
        self._emit("reconcile.adopted", record)

    def held_elsewhere(self, session: str) -> Mapping[str, str] | None:
        """The labels of a sandbox of ``session`` that another live process of this pool's
        name held at the last reconcile pass, or None. A session this pool does not know
        but a predecessor still holds (two replicas of a service overlapping) is about to
        be adopted here, not over: callers should retry rather than give it up."""
        return self._elsewhere.get(session)

    async def _backend_owners(self) -> BackendOwners | None:
        """The provider's owner records judged now, if it keeps them; None (nothing judged
        dead or alive by them this time) when they cannot be read."""
        if self._keeper is None:
            return None
        try:
            return await self._keeper.owners()
        except errors.SandboxError as exc:
            self._emit("owners.failed", None, error=repr(exc))
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
            and owner != self.owner
            and backend.knows(owner)
            and backend(owner) != "dead"
        }
        if pending:
            self._emit("reconcile.judging_owners", None, owners=sorted(pending))
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
            if dead == self.owner:
                continue
            try:
                theirs = await self.provider.list(labels={owners.LABEL_OWNER: dead})
                for info in theirs:
                    if info.id not in self._records:
                        self._orphan(info, reason=f"owner {owners.describe(dead)} is dead")
                if not theirs:
                    await self._keeper.forget_owner(dead, backend.versions.get(dead))
            except errors.SandboxError as exc:  # the next reconcile tries again
                self._emit("owners.reap_failed", None, owner=dead, error=repr(exc))

    def _record_of(self, info: SandboxInfo, expires: float = 0.0) -> Record:
        record = Record(
            id=info.id,
            spec=SandboxSpec(image=info.image or "unknown"),
            state="ready",
            labels=dict(info.labels),
            expires_at=expires,
            info=info,
        )
        self._add(record)
        return record

    def _orphan(self, info: SandboxInfo, *, expires: float = 0.0, reason: str = "orphan") -> None:
        record = self._record_of(info, expires)
        self._emit("reconcile.orphan", record, state=info.state, reason=reason)
        self._release(record, reason=reason)


@contextlib.contextmanager
def _changing(record: Record) -> Iterator[None]:
    """While the block changes the record's container (`Record.changing`)."""
    record.changing += 1
    record.changes += 1
    try:
        yield
    finally:
        record.changing -= 1
        record.changes += 1


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _dead(info: SandboxInfo | None) -> bool:
    """Whether a sandbox that was ready, as the provider lists it now (None: not at all),
    is dead: stopped, gone, or back to ``creating`` (its record without its container)."""
    return info is None or info.state in ("stopped", "creating")


def _loss_of(sandbox_id: str, info: SandboxInfo | None) -> Lost:
    """Why a sandbox the provider lists as ``info`` (None: not at all) is lost."""
    if info is None:
        return Lost(sandbox_id=sandbox_id, reason="deleted", detail="the backend has it no more")
    return info.lost or Lost(
        sandbox_id=sandbox_id, reason="unknown", detail=f"the backend says it is {info.state}"
    )


def _cause(exc: BaseException) -> str:
    """What failed, in a word a table can show: the exception's name in snake case
    (``ImageNotFound`` -> ``image_not_found``)."""
    name = type(exc).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _classify(exc: BaseException) -> tuple[FailureKind, float | None]:
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(exc, errors.ThrottledError):
        return "throttled", retry_after
    if isinstance(exc, errors.CapacityError):
        return "capacity", retry_after
    if isinstance(exc, TimeoutError):
        return "timeout", None
    if isinstance(exc, errors.ImageError):
        # The caller's mistake (a typo in an image name), not backend strain:
        # it must not slow creation down for every other tenant.
        return "other", None
    if isinstance(exc, errors.ProviderError | errors.DaemonUnavailable):
        return "server_error", None
    return "other", None
