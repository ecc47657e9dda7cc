"""Acquires that wait without an HTTP request held open for each: tickets.

An acquire held open until its sandbox is ready costs the service about 37 KiB
for as long as it waits (uvicorn's protocol and buffers, the ASGI stack's frames,
FastAPI's parsed request): a burst of 16,000 waiting took 590 MiB. The pool's own
acquire, a queue entry and a task, is a tenth of that.

So an acquire that asks with ``wait`` is answered ``202`` once that many seconds
pass without a sandbox, with a ticket, its place in the line and when to ask
again; the pool's acquire goes on meanwhile. The client asks again with the
ticket (a long poll, ``wait`` seconds again) and gets the sandbox, or another
``202``. At most ``max_attached`` requests wait open at once; beyond them an
acquire is answered at once. A ticket nobody asks for again within its
``retry_after`` and a grace is cancelled (the pool hands what it made to the
next waiter, or deletes it), or, when its sandbox was ready, released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sandman.pool.records import Record

__all__ = ["Ticket", "Tickets"]

logger = logging.getLogger(__name__)

_GRACE = 30.0  # seconds past its retry_after an unattended ticket is kept
_SWEEP_EVERY = 5.0
_RETRY_MIN, _RETRY_MAX = 1.0, 60.0
# Before any acquire was answered: a burst's thousands then ask again over a minute,
# not all every few seconds (each ask costs about a millisecond of the service's CPU).
_FIRST_RATE = 10.0
_WINDOW = 30.0


@dataclass(eq=False, slots=True)
class Ticket:
    """One acquire of a tenant's session, answered or not yet."""

    id: str
    tenant: str
    session: str
    task: asyncio.Task[Record]
    seq: int
    expires: float = math.inf
    """Monotonic time after which, unattended, it is dropped (`Tickets.sweep`)."""
    attached: int = field(default=0)
    """Requests waiting on it now."""
    told: bool = False
    """Whether a caller was answered with it (and so may ask again)."""
    opened: float = field(default_factory=time.monotonic)
    """Monotonic time its acquire was asked for (its first request)."""


class Tickets:
    """The service's acquires by ticket, oldest first; ``release`` gives a sandbox
    back (that of a ticket whose caller never came back for it)."""

    def __init__(self, release: Callable[[str], None], *, max_attached: int) -> None:
        self._release = release
        self.max_attached = max_attached
        self._open: dict[str, Ticket] = {}
        self._seq = 0
        self.attached = 0
        """Requests waiting on tickets now (those with ``wait`` and those without)."""
        # Acquires answered with a sandbox: in the window since ``_since``, and the rate
        # over the last whole window (a burst of spares handed out at once is averaged).
        self._since = time.monotonic()
        self._count = 0
        self._rate: float | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def open(self, tenant: str, session: str, task: asyncio.Task[Record]) -> Ticket:
        """A ticket for the pool's acquire ``task`` (started by the caller)."""
        self._seq += 1
        ticket = Ticket(secrets.token_urlsafe(12), tenant, session, task, self._seq)
        self._open[ticket.id] = ticket
        task.add_done_callback(self._succeeded)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep_now_and_then())
        return ticket

    def find(self, tenant: str, session: str, ticket_id: str) -> Ticket | None:
        """The open ticket of this tenant's session, or None."""
        ticket = self._open.get(ticket_id)
        if ticket is None or ticket.tenant != tenant or ticket.session != session:
            return None
        return ticket

    def opened(self, tenant: str, session: str, ticket_id: str | None) -> float | None:
        """When the acquire of an open ticket of this tenant's session was first asked
        for (an acquire's time counts from there, across its requests), or None."""
        ticket = None if ticket_id is None else self.find(tenant, session, ticket_id)
        return None if ticket is None else ticket.opened

    def close(self, ticket: Ticket) -> None:
        """Done with: its answer was given (or will never be)."""
        self._open.pop(ticket.id, None)

    def room(self) -> bool:
        """Whether another request may wait open."""
        return self.attached < self.max_attached

    @contextlib.contextmanager
    def attach(self, ticket: Ticket) -> Iterator[None]:
        """A request waits on ``ticket`` for the block."""
        ticket.attached += 1
        self.attached += 1
        ticket.expires = math.inf
        try:
            yield
        finally:
            ticket.attached -= 1
            self.attached -= 1

    def detach(self, ticket: Ticket) -> tuple[int, float]:
        """Its caller will ask again: its place in the line (acquires before it still
        open) and the seconds after which to ask, from the pace acquires are answered
        at; kept that long and a grace more."""
        first = next(iter(self._open.values()), ticket)
        position = max(0, ticket.seq - first.seq)
        wait = (position + 1) / (self.rate() or _FIRST_RATE)
        retry_after = round(min(_RETRY_MAX, max(_RETRY_MIN, wait)), 1)
        if ticket.attached == 0:
            ticket.expires = time.monotonic() + retry_after + _GRACE
        return position, retry_after

    def rate(self) -> float | None:
        """Acquires answered with a sandbox per second over the last ``_WINDOW`` seconds
        or more; None before the first window ends."""
        span = time.monotonic() - self._since
        return self._count / span if span >= _WINDOW else self._rate

    def _succeeded(self, task: asyncio.Task[Record]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        now = time.monotonic()
        if now - self._since >= _WINDOW:
            self._rate = self._count / (now - self._since)
            self._since, self._count = now, 0
        self._count += 1

    def sweep(self, now: float | None = None) -> int:
        """Drop every unattended ticket past its time: its acquire cancelled, or its
        sandbox released. How many."""
        now = time.monotonic() if now is None else now
        late = [t for t in self._open.values() if t.attached == 0 and t.expires < now]
        for ticket in late:
            self.close(ticket)
            task = ticket.task
            if not task.done():
                task.cancel()  # the pool hands what it was making on, or deletes it
            elif not task.cancelled() and task.exception() is None:
                self._release(task.result().id)
        if late:
            logger.info("dropped %d acquire tickets nobody asked for again", len(late))
        return len(late)

    async def _sweep_now_and_then(self) -> None:
        while self._open:
            await asyncio.sleep(_SWEEP_EVERY)
            self.sweep()

    async def aclose(self) -> None:
        """Stop sweeping (at shutdown; the pool's close ends what is left)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
