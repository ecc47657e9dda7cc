"""The service's state over one `Pool`: tenants, their sessions and limits, acquires in
flight, recently gone sandboxes, and shutdown. HTTP lives in `app`; this is plain asyncio.

(About 620 lines, one piece: every route's tenant check, count and limit reads and
writes the same per-tenant state under one event loop; split, each half would need
the other's invariants.)

Ownership needs no table of its own: every sandbox acquired through the service
carries its tenant as the label ``sandman.io/tenant`` (in its spec, so the
backend keeps it), which survives a restart of the service and an adoption by
the next instance. Sessions are mapped to tenants here; a session the pool
adopted is mapped back through the labels of its sandboxes.

(About 600 lines, one piece: a tenant's counts, its sessions' holdings and the
acquires it has in flight change together under one lock; the waiting by ticket
is apart in `sandman.server.tickets`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from sandman import errors
from sandman.egress import Egress
from sandman.models import SandboxSpec, Usage
from sandman.pool import Pool, PoolEvent, PoolHealth, Record, Tally
from sandman.pool.records import LABEL_TENANT
from sandman.providers.base import SnapshotInfo
from sandman.server.errors import ApiError, from_exception
from sandman.server.schemas import AcquirePending, AcquireRequest, SandboxPage, SandboxRow
from sandman.server.settings import ServerSettings
from sandman.server.tickets import Ticket, Tickets

__all__ = ["LABEL_TENANT", "ClientGone", "Service", "tenant_of"]

logger = logging.getLogger(__name__)


def tenant_of(record: Record) -> str | None:
    """The tenant a sandbox was acquired for, None for one the service did not hand out."""
    return record.spec.labels.get(LABEL_TENANT) or record.labels.get(LABEL_TENANT)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ClientGone(Exception):
    """The HTTP client went away while its acquire waited; nobody is left to answer."""


class Service:
    """Everything the routes do, over the same `Pool` an embedded client would use."""

    def __init__(self, pool: Pool, settings: ServerSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.accepting = True
        self._keys = {_digest(k.key.get_secret_value()): k.tenant for k in settings.api_keys}
        self._sessions: dict[str, str] = {}
        self._leases: dict[str, float] = {}
        self._pending: Counter[str] = Counter()
        # Sandboxes held per tenant, kept by the pool as they come and go: the limit
        # is checked on every acquire, and a scan of 50,000 records took 9.7 ms.
        self._held: Tally = pool.tally(tenant_of)
        self._acquires: set[asyncio.Task[Record]] = set()
        self.tickets = Tickets(pool.release, max_attached=settings.max_waiting_requests)
        self._recent: OrderedDict[str, Record] = OrderedDict()
        self._shutdown: asyncio.Task[None] | None = None
        pool.add_hook(self._on_event)

    def _on_event(self, event: PoolEvent) -> None:
        if event.name == "session.expired":
            self._forget(str(event.detail.get("session")))

    # -- auth and ownership ---------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of ``Authorization: Bearer <key>``; `ApiError` ``unauthorized`` if none."""
        if not authorization:
            if self.settings.anonymous_tenant is not None:
                return self.settings.anonymous_tenant
            raise _unauthorized("an API key is required: Authorization: Bearer <key>")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("use Authorization: Bearer <key>")
        # A lookup by digest: no early exit on a matching prefix of the key.
        tenant = self._keys.get(_digest(key.strip()))
        if tenant is None:
            raise _unauthorized("unknown API key")
        return tenant

    def _own_session(self, tenant: str, session: str) -> None:
        owner = self._sessions.get(session)
        if owner is None:
            # Adopted by the pool at start (a previous instance's): its sandboxes say whose.
            owners = {tenant_of(r) for r in self.pool.list(session=session)}
            if len(owners) == 1 and None not in owners:
                owner = owners.pop()
                if owner is not None:
                    self._sessions[session] = owner
        if owner is None:
            # Not over, if another live instance of this pool (the replica this one
            # replaces, not gone yet) holds it for this tenant: adopted here soon.
            moving = self.pool.held_elsewhere(session)
            if moving is not None and moving.get(LABEL_TENANT) == tenant:
                raise ApiError(
                    "session_moving",
                    f"session {session} is still held by another instance of this service; "
                    "retry shortly",
                    headers={"Retry-After": "2"},
                )
        if owner != tenant:
            raise ApiError("session_expired", f"session {session} is unknown or expired")

    # -- probes -----------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Refuse new work and say not ready from now on (at SIGTERM, before the graceful
        shutdown, so that a load balancer takes this instance out first)."""
        self.accepting = False

    def unready(self) -> list[str]:
        """Why acquires cannot be served now (``/v1/ready``); empty when they can."""
        health = self.pool.health()
        reasons = []
        if not self.accepting:
            reasons.append("the service is shutting down")
        if not health.started:
            reasons.append("the pool is not started")
        elif health.closed:
            reasons.append("the pool is closed")
        reasons += self._stopped(health)
        if health.started and not health.closed and not health.provider_reached:
            provider = self.pool.provider.name
            if health.provider_age is None:
                reasons.append(f"the {provider} provider has not answered yet")
            else:
                reasons.append(
                    f"the {provider} provider has not answered for {health.provider_age:.0f} s"
                )
        return reasons

    def unlive(self) -> list[str]:
        """Why this process should be restarted (``/v1/live``); empty when it is worth
        keeping. Never the provider's fault: a slow backend must not restart every replica."""
        return self._stopped(self.pool.health())

    @staticmethod
    def _stopped(health: PoolHealth) -> list[str]:
        return [f"the pool's loop {name} stopped" for name in health.stopped]

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise ApiError(
                "shutting_down", "the service is shutting down", headers={"Retry-After": "1"}
            )

    # -- sessions -------------------------------------------------------------------

    def open_session(self, tenant: str, lease: float | None) -> tuple[str, float]:
        """A new session of ``tenant``: its id and lease in seconds."""
        self._check_accepting()
        lease = min(lease or self.pool.config.lease, self.settings.max_lease)
        try:
            session = self.pool.open_session(lease=lease)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc
        self._sessions[session] = tenant
        self._leases[session] = lease
        return session, lease

    def heartbeat(self, tenant: str, session: str) -> float:
        """Extend the session's lease; its length in seconds."""
        self._own_session(tenant, session)
        try:
            self.pool.heartbeat(session)
        except errors.SandboxNotFound as exc:
            self._forget(session)
            raise ApiError("session_expired", f"session {session} is unknown or expired") from exc
        return self._leases.get(session, self.pool.config.lease)

    def close_session(self, tenant: str, session: str) -> None:
        """End the session; everything it holds is released, its waiting acquires end."""
        self._own_session(tenant, session)
        self._forget(session)
        self.pool.close_session(session)

    def _forget(self, session: str) -> None:
        self._sessions.pop(session, None)
        self._leases.pop(session, None)

    # -- sandboxes --------------------------------------------------------------------

    def queue_depths(self) -> dict[str, int]:
        """Acquires waiting now, per tenant."""
        return {tenant: n for tenant, n in self._pending.items() if n}

    async def acquire(
        self,
        tenant: str,
        request: AcquireRequest,
        disconnected: Callable[[], Coroutine[Any, Any, None]],
    ) -> Record:
        """A ready sandbox for the tenant's session, or `ApiError`.

        Waits until the deadline, the session's end, or ``disconnected()``
        returns (the HTTP client went away: `ClientGone`). Whenever this
        gives up, the pool hands what it was making to the next waiter or
        deletes it. (``request.wait`` is `poll`'s.)
        """
        got = await self.poll(tenant, request.model_copy(update={"wait": None}), disconnected)
        assert isinstance(got, Record)  # without a wait, never pending
        return got

    async def poll(
        self,
        tenant: str,
        request: AcquireRequest,
        disconnected: Callable[[], Coroutine[Any, Any, None]],
    ) -> Record | AcquirePending:
        """`acquire`; with ``request.wait``, the request gives up after that long, not the
        acquire: `AcquirePending`, whose ticket a later request (``request.ticket``)
        waits on again (`sandman.server.tickets`). A client gone then leaves the ticket
        to be asked for again, until it is dropped."""
        if request.ticket is None:
            self._check_accepting()  # a draining service says so before the session
            self._own_session(tenant, request.session)
            ticket = self._start_acquire(tenant, request)
        else:
            self._own_session(tenant, request.session)
            found = self.tickets.find(tenant, request.session, request.ticket)
            if found is None:
                raise ApiError(
                    "not_found",
                    f"no acquire {request.ticket} of session {request.session} is waiting "
                    "(answered, given up, or not asked for again in time)",
                )
            ticket = found
        polled = request.wait is not None
        wait = request.wait if not polled or self.tickets.room() else 0.0
        task = ticket.task
        watcher = asyncio.ensure_future(disconnected())
        try:
            with self.tickets.attach(ticket):
                await asyncio.wait({task, watcher}, timeout=wait, return_when="FIRST_COMPLETED")
        except BaseException:
            # This handler was cancelled itself: a sandbox already handed over
            # would otherwise stay leased to a caller who never hears of it.
            if ticket.told:
                self.tickets.detach(ticket)  # it may ask again, for a while
            else:
                await self._give_up(ticket)
            raise
        finally:
            watcher.cancel()
        gone = watcher.done() and not watcher.cancelled()
        if not task.done():
            if not polled or (gone and not ticket.told):
                await self._give_up(ticket)  # nobody knows its ticket: nobody will ask
            else:
                position, retry_after = self.tickets.detach(ticket)
                if gone:
                    raise ClientGone(request.session)  # it may ask again, for a while
                ticket.told = True
                return AcquirePending(ticket=ticket.id, position=position, retry_after=retry_after)
        self.tickets.close(ticket)
        if task.cancelled():
            if gone:
                raise ClientGone(request.session)
            self._check_accepting()
            raise ApiError("session_expired", f"session {request.session} ended while waiting")
        exc = task.exception()
        if isinstance(exc, errors.SandboxError):
            raise from_exception(exc) from exc
        if exc is not None:
            raise exc
        record = task.result()
        if gone:
            self.pool.release(record.id)
            raise ClientGone(request.session)
        self._remember(record)
        return record

    def _start_acquire(self, tenant: str, request: AcquireRequest) -> Ticket:
        """The pool's acquire for ``request``, under a new ticket, once it passes the
        tenant's limits."""
        limits = self.settings.limits(tenant)
        pending = self._pending[tenant]
        if limits.max_pending is not None and pending >= limits.max_pending:
            raise ApiError(
                "tenant_pending_limit",
                f"tenant {tenant} already waits for {pending} sandboxes "
                f"(limit {limits.max_pending})",
                headers={"Retry-After": "1"},
            )
        if limits.max_sandboxes is not None:
            held = self._held[tenant] + pending
            if held >= limits.max_sandboxes:
                raise ApiError(
                    "tenant_sandbox_limit",
                    f"tenant {tenant} holds or waits for {held} sandboxes "
                    f"(limit {limits.max_sandboxes})",
                    headers={"Retry-After": "1"},
                )
        self._check_spec(tenant, request.spec)
        if request.spec.snapshot is not None:
            self.get_snapshot(tenant, request.spec.snapshot)  # the tenant's, or not found
        spec = request.spec.model_copy(
            update={"labels": {**request.spec.labels, LABEL_TENANT: tenant}}
        )
        cap = self.settings.max_acquire_timeout
        timeout = cap if request.timeout is None else min(request.timeout, cap)
        task = asyncio.ensure_future(
            self.pool.acquire(spec, session=request.session, timeout=timeout)
        )
        self._acquires.add(task)
        self._pending[tenant] += 1

        def done(task: asyncio.Task[Record]) -> None:
            self._acquires.discard(task)
            self._pending[tenant] -= 1
            if not self._pending[tenant]:
                del self._pending[tenant]  # no entry for a tenant that waits for none

        task.add_done_callback(done)
        return self.tickets.open(tenant, request.session, task)

    async def _give_up(self, ticket: Ticket) -> None:
        """Nobody will take this acquire's answer: cancelled in the pool (queued work is
        dropped, a sandbox in the making goes to the next waiter or is deleted), or
        its sandbox released."""
        self.tickets.close(ticket)
        task = ticket.task
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        elif not task.cancelled() and task.exception() is None:
            self.pool.release(task.result().id)

    async def forget_acquire(self, tenant: str, session: str, ticket_id: str) -> None:
        """Give up a waiting acquire by its ticket (its caller no longer wants it); a
        ticket already answered or given up is fine."""
        self._own_session(tenant, session)
        ticket = self.tickets.find(tenant, session, ticket_id)
        if ticket is not None:
            await self._give_up(ticket)

    def _check_spec(self, tenant: str, spec: SandboxSpec) -> None:
        """The pod settings and seccomp the spec asks for are the tenant's to choose."""
        refusal = self.settings.limits(tenant).refusal(spec.kubernetes)
        if refusal is not None:
            raise ApiError("invalid_request", f"kubernetes: {refusal}")
        if spec.seccomp not in self.settings.tenant_seccomp:
            raise ApiError(
                "invalid_request",
                f"seccomp {spec.seccomp!r} is not allowed here "
                f"(allowed: {', '.join(self.settings.tenant_seccomp)})",
            )

    def warm(self, tenant: str, spec: SandboxSpec, count: int) -> None:
        """Keep ``count`` ready spares of ``spec`` for the tenant (0 stops); they count
        against its ``max_sandboxes``, and an acquire of the same spec takes one."""
        self._check_accepting()
        self._check_spec(tenant, spec)
        if spec.snapshot is not None:
            raise ApiError("invalid_request", "spares are made from images, not snapshots")
        limit = self.settings.limits(tenant).max_sandboxes
        if limit is not None and count > limit:
            raise ApiError(
                "tenant_sandbox_limit",
                f"tenant {tenant} may hold {limit} sandboxes; {count} spares would be more",
            )
        labelled = spec.model_copy(update={"labels": {**spec.labels, LABEL_TENANT: tenant}})
        try:
            self.pool.warm(labelled, count)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    def _remember(self, record: Record) -> None:
        if self.settings.recent_sandboxes <= 0:
            return
        self._recent[record.id] = record
        self._recent.move_to_end(record.id)
        while len(self._recent) > self.settings.recent_sandboxes:
            self._recent.popitem(last=False)

    def sandbox(self, tenant: str, sandbox_id: str) -> Record:
        """The tenant's sandbox (live, or recently gone); ``sandbox_not_found`` otherwise,
        foreign ones included: another tenant's ids are not even confirmed to exist."""
        try:
            record = self.pool.get(sandbox_id)
        except errors.SandboxNotFound:
            found = self._recent.get(sandbox_id)
            if found is None:
                raise _not_found(sandbox_id) from None
            record = found
        if tenant_of(record) != tenant:
            raise _not_found(sandbox_id)
        return record

    async def running(self, record: Record) -> bool:
        """Whether the backend says the sandbox runs (asked now). One it says stopped,
        or has no more, is lost from then on (``record.state``)."""
        if record.state != "leased":
            return False
        try:
            await self.pool.check(record.id)
        except errors.SandboxNotFound:
            return False
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc
        return True

    @staticmethod
    def lost_error(record: Record) -> ApiError:
        """``sandbox_lost`` for a sandbox that died by itself, with its reason."""
        lost = record.lost
        reason, detail = (lost.reason, lost.detail) if lost else ("unknown", "")
        return from_exception(errors.SandboxLost.of(record.id, reason, detail))

    def release(self, tenant: str, sandbox_id: str) -> None:
        """Give the tenant's sandbox back (deleted in the background). Idempotent."""
        self.sandbox(tenant, sandbox_id)
        self.pool.release(sandbox_id)

    async def release_with_usage(self, tenant: str, sandbox_id: str) -> Usage | None:
        """`release`, answering what it used, read just before (None if unreadable): the
        pool's delete takes that read as its last."""
        record = self.sandbox(tenant, sandbox_id)
        used = record.usage
        if record.state in ("ready", "leased"):
            with contextlib.suppress(errors.SandboxError, OSError, TimeoutError):
                async with asyncio.timeout(2.0):  # briefly: the release goes first
                    used = await self.pool.usage(sandbox_id)
        self.pool.release(sandbox_id)
        return used

    async def usage(self, tenant: str, sandbox_id: str) -> Usage | None:
        """What the tenant's sandbox used: now while held, else as read at its release."""
        record = self.sandbox(tenant, sandbox_id)
        if record.state not in ("ready", "leased"):
            return record.usage
        try:
            return await self.pool.usage(sandbox_id)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    async def page(self, tenant: str, page: int, size: int) -> SandboxPage:
        """Page ``page`` of the tenant's live sandboxes, oldest first, with what each uses
        now (read for that page only: a page costs the same at 10 or 10,000)."""
        now = time.time()
        live = [
            r
            for r in self.pool.list()
            if tenant_of(r) == tenant and r.state not in ("releasing", "gone", "failed")
        ]
        live.sort(key=lambda r: (r.timeline.get("create_called", now), r.id))
        chosen = live[page * size : (page + 1) * size]

        async def used(record: Record) -> Usage | None:
            if record.state not in ("ready", "leased"):
                return None
            with contextlib.suppress(errors.SandboxError, OSError):
                return await self.pool.usage(record.id)
            return None

        usages = await asyncio.gather(*(used(r) for r in chosen))
        rows = [
            SandboxRow(
                id=r.id,
                state=r.state,
                image=r.spec.image,
                age=max(0.0, now - r.timeline.get("create_called", now)),
                session=r.session,
                cpu_seconds=u.cpu_seconds if u else None,
                memory_bytes=u.memory_bytes if u else None,
            )
            for r, u in zip(chosen, usages, strict=True)
        ]
        return SandboxPage(total=len(live), page=page, size=size, sandboxes=rows)

    # -- snapshots ----------------------------------------------------------------------

    def get_snapshot(self, tenant: str, snapshot_id: str) -> SnapshotInfo:
        """The tenant's snapshot; ``snapshot_not_found`` otherwise (another tenant's too)."""
        try:
            info = self.pool.get_snapshot(snapshot_id)
        except errors.SnapshotNotFound:
            info = None
        if info is None or info.labels.get(LABEL_TENANT) != tenant:
            raise ApiError("snapshot_not_found", f"no snapshot {snapshot_id}")
        return info

    def snapshots(self, tenant: str) -> list[SnapshotInfo]:
        """The tenant's snapshots, oldest first."""
        return [s for s in self.pool.snapshots() if s.labels.get(LABEL_TENANT) == tenant]

    async def snapshot(
        self, tenant: str, sandbox_id: str, *, memory: bool, ttl: float | None
    ) -> SnapshotInfo:
        """A snapshot of the tenant's leased sandbox, counted against its limit."""
        self._check_accepting()
        record = self._leased(tenant, sandbox_id)
        limit = self.settings.limits(tenant).max_snapshots
        if limit is not None and len(self.snapshots(tenant)) >= limit:
            raise ApiError(
                "tenant_snapshot_limit",
                f"tenant {tenant} keeps {limit} snapshots, its limit: delete one first",
            )
        try:
            return await self.pool.snapshot(
                record.id, memory=memory, ttl=ttl, labels={LABEL_TENANT: tenant}
            )
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        """Delete the tenant's snapshot."""
        self.get_snapshot(tenant, snapshot_id)
        try:
            await self.pool.delete_snapshot(snapshot_id)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    async def restore(self, tenant: str, sandbox_id: str, snapshot_id: str) -> Record:
        """Reset the tenant's leased sandbox to the tenant's snapshot."""
        self._leased(tenant, sandbox_id)
        self.get_snapshot(tenant, snapshot_id)
        try:
            return await self.pool.restore(sandbox_id, snapshot_id)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    async def pause(
        self, tenant: str, sandbox_id: str, *, resume: bool = False, memory: bool = False
    ) -> Record:
        """Pause (or resume) the tenant's leased sandbox."""
        record = self._leased(tenant, sandbox_id)
        try:
            if resume:
                await self.pool.resume(sandbox_id)
            else:
                await self.pool.pause(sandbox_id, memory=memory)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc
        return record

    async def set_egress(self, tenant: str, sandbox_id: str, egress: Egress) -> None:
        """Change where the tenant's leased sandbox may connect."""
        self._leased(tenant, sandbox_id)
        try:
            await self.pool.set_egress(sandbox_id, egress)
        except errors.SandboxError as exc:
            raise from_exception(exc) from exc

    def _leased(self, tenant: str, sandbox_id: str) -> Record:
        record = self.sandbox(tenant, sandbox_id)
        if record.state == "lost":
            raise self.lost_error(record)
        if record.state != "leased":
            raise _not_found(sandbox_id)
        return record

    def list(
        self,
        tenant: str,
        *,
        session: str | None = None,
        state: str | None = None,
        image: str | None = None,
    ) -> list[Record]:
        """The tenant's sandboxes (the recently gone too), filtered."""
        live = self.pool.list()
        seen = {r.id for r in live}
        records: Iterable[Record] = [*live, *(r for r in self._recent.values() if r.id not in seen)]
        return [
            r
            for r in records
            if tenant_of(r) == tenant
            and (session is None or r.session == session)
            and (state is None or r.state == state)
            and (image is None or r.spec.image == image)
        ]

    # -- shutdown ---------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop accepting, let acquires in flight be answered (up to ``shutdown_grace``),
        then close the pool: release everything, or leave it for the next instance
        (``release_on_shutdown``). Idempotent; concurrent calls wait for the first."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._shutdown)

    async def _shut_down(self) -> None:
        self.stop_accepting()
        await self.tickets.aclose()
        if self._acquires:
            logger.info("shutdown: waiting for %d acquires in flight", len(self._acquires))
            _, late = await asyncio.wait(set(self._acquires), timeout=self.settings.shutdown_grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.pool.aclose(release=self.settings.release_on_shutdown)


def _unauthorized(message: str) -> ApiError:
    return ApiError("unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def _not_found(sandbox_id: str) -> ApiError:
    return ApiError("sandbox_not_found", f"no sandbox {sandbox_id}")
