"""Creation and delivery: the requests waiting for a sandbox of each spec, the creates
the pacer lets start, and where each new sandbox goes.

A request is queued with the pacer (per client, served round robin); its create records
the intent before it calls the provider, waits until the daemon answers, then hands the
sandbox to its requester, else to the next waiter of the same spec, else to the warm
spares, else has it deleted: never leaked. A create that fails is retried (throttling,
capacity) or fails its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from sandman import errors
from sandman._tracing import span
from sandman.models import SandboxSpec
from sandman.pool import owner as owners
from sandman.pool.config import PoolConfig
from sandman.pool.events import Emit
from sandman.pool.failures import cause, classify
from sandman.pool.leases import Leases
from sandman.pool.ledger import Ledger
from sandman.pool.losses import Losses
from sandman.pool.pacing import Pacer
from sandman.pool.records import LABEL_EXPIRES, LABEL_POOL, Record
from sandman.pool.spares import Spares, key_of
from sandman.providers.base import Provider

__all__ = ["Creation", "Request"]

_WARM_CLIENT = "__warm__"


@dataclass(eq=False)
class Request:
    """One caller's wait for a sandbox of ``spec`` (or a warm spare's, with ``warm``)."""

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
        self.key = key_of(self.spec)


@dataclass(eq=False, repr=False)
class Creation:
    """The waiting requests and the creates in flight of one pool."""

    provider: Provider
    config: PoolConfig
    pacer: Pacer[Request]
    ledger: Ledger
    leases: Leases
    spares: Spares
    losses: Losses
    emit: Emit
    _: KW_ONLY
    owner: Callable[[], str]
    touch: Callable[[], None]
    """Tells that the provider answered."""
    waiting: dict[str, deque[Request]] = field(default_factory=dict, init=False)
    """Keyed by the spec's JSON (`key_of`): specs hold dicts, so they are not hashable."""
    creates: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    closed: bool = field(default=False, init=False)

    async def take(self, spec: SandboxSpec, session: str, timeout: float | None) -> Record:
        """A sandbox leased to ``session`` in memory: a spare, or one made for it."""
        idle = self.spares.take(spec, self.ledger.records)
        if idle is not None:
            self.leases.lease(idle, session)
            return idle
        request = Request(spec, session, asyncio.get_running_loop().create_future(), time.time())
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
                self.leases.release(future.result(), reason="caller gone after the hand-over")
            if isinstance(exc, TimeoutError):
                raise errors.CreateTimeout(
                    f"no sandbox of {spec.image!r} within {timeout} s "
                    f"(pool {self.config.name!r}): " + self._whereabouts(request)
                ) from None
            if (
                isinstance(exc, asyncio.CancelledError)
                and future.cancelled()
                and session not in self.leases
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
            if self.pacer.cancel(request):
                self.wake.set()
            self._drop_waiting(request)

    def _whereabouts(self, request: Request) -> str:
        """Where a request that timed out had got to, for its error: the pacer's queue
        (the cluster is busy), a create (slow), or retries (what failed)."""
        if request.creating_since is None:
            where = (
                f"still queued, {self.pacer.queued()} requests waiting to be created "
                f"at {self.pacer.rate:.3g}/s with {self.pacer.in_flight} of "
                f"{self.pacer.window} creates in flight"
            )
        else:
            where = f"its sandbox was being created for {time.monotonic() - request.creating_since:.1f} s"
            detail = self.provider.progress(request.creating) if request.creating else None
            if detail:
                where += f" ({detail})"
        if request.last_error is not None:
            where += f"; try {request.attempts} failed: {request.last_error}"
        return where

    def warm(self, spec: SandboxSpec, count: int) -> None:
        """Keep ``count`` ready spares of ``spec`` (made as `top_up` finds them missing)."""
        self.spares.want(spec, count)
        self.wake.set()

    def top_up(self) -> None:
        """Queue a create for each warm spare missing."""
        for _key, spec in self.spares.missing():
            request = Request(
                spec,
                _WARM_CLIENT,
                asyncio.get_running_loop().create_future(),
                time.time(),
                warm=True,
            )
            self.pacer.enqueue(_WARM_CLIENT, request)
            self.wake.set()

    def cancel_waiters(self, session_id: str) -> None:
        """The session ended: its requests still waiting are cancelled."""
        for queue in self.waiting.values():
            for request in queue:
                if request.session == session_id and not request.future.done():
                    request.future.cancel()

    async def close(self) -> None:
        """Fail every waiting request (PoolClosed) and abandon the creates in flight: each
        deletes what it made. Nothing is created or handed out from now on."""
        self.closed = True
        for queue in self.waiting.values():
            for request in queue:
                if not request.future.done():
                    request.future.set_exception(errors.PoolClosed("the pool is closed"))
        self.waiting.clear()
        for create in self.creates:
            create.cancel()
        await asyncio.gather(*self.creates, return_exceptions=True)

    def _queue(self, request: Request) -> None:
        self.waiting.setdefault(request.key, deque()).append(request)
        self.pacer.enqueue(_WARM_CLIENT if request.warm else request.session, request)
        self.wake.set()

    async def schedule(self) -> None:
        """Start creations as the pacer allows, oldest-first per client, clients round robin."""
        while True:
            now = time.monotonic()
            request = self.pacer.next(now)
            if request is None:
                wait = self.pacer.wait_time(now)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self.wake.wait()
                continue
            if request.future.done() and not request.warm:
                self.pacer.on_abandoned(now)  # its caller left between queue and turn
                continue
            task = asyncio.create_task(self._create(request), name="sandman-create")
            self.creates.add(task)
            task.add_done_callback(self.creates.discard)

    async def _create(self, request: Request) -> None:
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
                owners.LABEL_OWNER: self.owner(),
            },
            expires_at=expires,
            session=None if request.warm else request.session,
        )
        record.stamp("queued", request.queued_at)
        record.stamp("create_called")
        # The intent is recorded before the backend is called.
        self.ledger.add(record)
        self.emit("create.started", record)
        started = request.creating_since = time.monotonic()
        request.creating = record.id
        try:
            with span("create", sandbox=record.id, image=request.spec.image):
                info = await self.provider.create(
                    request.spec, sandbox_id=record.id, labels=record.labels
                )
            self.touch()
            record.info = info
            self.ledger.set_state(record, "starting")
            self.losses.watch(info)
            record.stamp("accepted")
            record.stamp("running")
            if info.endpoint is not None:
                with span("ready", sandbox=record.id):
                    async with info.endpoint.client() as daemon:
                        await daemon.wait_ready(self.config.ready_timeout)
        except asyncio.CancelledError:
            self.pacer.on_abandoned(time.monotonic())
            self.leases.release(
                record, reason="cancelled during create", state="failed", force=True
            )
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a provider raises fails this create
            self._failed(request, record, exc)
            return
        self.ledger.set_state(record, "ready")
        record.stamp("daemon_ready")
        self.pacer.on_ready(time.monotonic(), time.monotonic() - started)
        self.wake.set()
        self.emit("create.complete", record, seconds=round(time.monotonic() - started, 4))
        if record.release_requested:
            self._drop_waiting(request)
            self.leases.release(record, reason="released while creating")
            return
        self._deliver(record, request)

    def _failed(self, request: Request, record: Record, exc: Exception) -> None:
        kind, retry_after = classify(exc)
        self.pacer.on_failed(time.monotonic(), kind, retry_after)
        self.wake.set()
        record.error = exc
        request.last_error, request.creating_since = exc, None
        self.emit("create.failed", record, error=repr(exc), kind=kind, cause=cause(exc))
        # The backend may hold something even after an error: delete it too.
        self.leases.release(record, reason="create failed", state="failed", force=True)
        retryable = getattr(exc, "retryable", False) or kind in ("throttled", "capacity")
        request.attempts += 1
        if request.future.done() and not request.warm:
            self._drop_waiting(request)
            return
        if retryable and request.attempts <= self.config.retry_limit and not self.closed:
            self.pacer.enqueue(_WARM_CLIENT if request.warm else request.session, request)
            self.wake.set()
        elif request.warm:
            self.spares.made(request.key)
        else:
            self._drop_waiting(request)
            request.future.set_exception(exc)

    def _drop_waiting(self, request: Request) -> None:
        """Take ``request`` off its spec's waiters; a spec nobody waits on has no entry
        (specs often carry a task id: one entry per spec ever seen would grow forever)."""
        queue = self.waiting.get(request.key)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(request)
            if not queue:
                del self.waiting[request.key]

    def _deliver(self, record: Record, request: Request) -> None:
        """Hand a ready sandbox to its requester, else the next waiter, else the spares, else delete."""
        self._drop_waiting(request)
        if request.warm:
            self.spares.made(request.key)
        if self.closed:
            self.leases.release(record, reason="pool closed")
            return
        if not request.warm and not request.future.done() and request.session in self.leases:
            self.leases.lease(record, request.session)
            request.future.set_result(record)
            return
        queue = self.waiting.get(request.key, deque())
        while queue:
            other = queue.popleft()
            # Only a waiter still queued (not being created for) takes it over.
            if (
                not other.future.done()
                and other.session in self.leases
                and self.pacer.cancel(other)
            ):
                if not queue:
                    del self.waiting[request.key]
                self.leases.lease(record, other.session)
                other.future.set_result(record)
                self.emit("sandbox.handed_over", record, from_session=request.session)
                return
            if not other.future.done():
                queue.appendleft(other)
                break
        if request.key in self.waiting and not queue:
            del self.waiting[request.key]
        if self.spares.keep(record, request.key):
            return
        self.leases.release(record, reason="caller gave up")


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
