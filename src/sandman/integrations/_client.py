"""The one Sandman client the adapters share, per process and per event loop.

Frameworks build environments from a class path and keyword arguments, many per
run, so an adapter cannot be handed a client: it asks here. The client is the
service's when ``url`` is given or ``SANDMAN_URL`` is set (the key from
``SANDMAN_API_KEY`` only, so that it never lands in a config the framework
writes into its logs or trajectories), else an embedded pool on the local
provider (``sandman.local()``; its state directory from ``SANDMAN_STATE_DIR``
if set). This module and the adapters are the one place outside ``cli`` and
``server`` that read the environment: a framework passes us nothing else.

Two kinds, one per URL (per state directory for the embedded pool) each:

- `shared_client`: a `BackgroundClient`, process-wide, on an event loop of its
  own in a thread. For blocking frameworks (mini-swe-agent, called from worker
  threads and Ray tasks) and for those that start a new event loop per call
  (SWE-agent runs every runtime call in its own ``asyncio.run``): a sandbox
  acquired in one loop outlives it. Closed at interpreter exit.
- `loop_client`: an `AsyncClient` on the running loop, for frameworks that keep
  one loop for the whole run (Harbor, inspect_ai): no thread hop. Closed when
  ``asyncio.run`` ends its loop.

Nothing is left behind if the process dies without closing either: the
embedded pool's watchdog deletes its sandboxes, the service releases a
session's sandboxes when its heartbeats stop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, ParamSpec, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from sandman.client import AsyncClient, connect, local
from sandman.errors import ConfigError

__all__ = [
    "ENV_API_KEY",
    "ENV_STATE_DIR",
    "ENV_URL",
    "BackgroundClient",
    "close_loop_clients",
    "close_shared",
    "loop_client",
    "resolve_url",
    "shared_client",
]

logger = logging.getLogger(__name__)

ENV_URL = "SANDMAN_URL"
ENV_API_KEY = "SANDMAN_API_KEY"
ENV_STATE_DIR = "SANDMAN_STATE_DIR"

P = ParamSpec("P")
T = TypeVar("T")

# Which client: ("service", url) or ("local", state_dir or "").
_Key = tuple[str, str]


def resolve_url(url: str | None = None) -> str | None:
    """The service's URL: ``url``, else ``SANDMAN_URL``, else None (the embedded pool)."""
    return url or os.environ.get(ENV_URL) or None


def _key(url: str | None, state_dir: str | None = None) -> _Key:
    resolved = resolve_url(url)
    if resolved is not None:
        if state_dir:
            raise ConfigError(
                f"state_dir {state_dir} is the embedded pool's, but the sandboxes come from "
                f"the service at {resolved} (url, or {ENV_URL}): give one of them"
            )
        return ("service", resolved)
    return ("local", state_dir or os.environ.get(ENV_STATE_DIR, ""))


def _new_client(key: _Key) -> AsyncClient:
    kind, where = key
    if kind == "service":
        return connect(where, api_key=os.environ.get(ENV_API_KEY) or None)
    return local(state_dir=where) if where else local()


class BackgroundClient:
    """An `AsyncClient` on an event loop of its own (an anyio portal's thread).

    `call` runs one of its coroutines from blocking code (any thread but the
    loop's own); `run` awaits one from any other event loop, and cancelling
    that await cancels the call. The sandboxes it hands out belong to its loop:
    use them only through `call` or `run`.
    """

    def __init__(self, key: _Key) -> None:
        self._key = key
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._lock = threading.Lock()
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop  # the portal's, set by _make
        try:
            self.client: AsyncClient = self._portal.call(self._make)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    async def _make(self) -> AsyncClient:
        self._loop = asyncio.get_running_loop()
        return _new_client(self._key)

    def __repr__(self) -> str:
        return f"BackgroundClient({self._key[0]}: {self._key[1] or 'default'})"

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` on the client's loop and wait for it (blocking)."""
        return self._portal.call(partial(fn, *args, **kwargs))

    async def run(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Await ``fn(*args, **kwargs)`` run on the client's loop, from another loop."""
        future = self._portal.start_task_soon(partial(fn, *args, **kwargs))
        return await asyncio.wrap_future(future)

    def submit(self, fn: Callable[P, Awaitable[Any]], /, *args: P.args, **kwargs: P.kwargs) -> None:
        """Start ``fn(*args, **kwargs)`` on the client's loop and return at once; from any
        thread, the loop's own too (a finalizer may run there). Its failure is logged."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the client
            self._loop.call_soon_threadsafe(self._spawn, partial(fn, *args, **kwargs))

    def _spawn(self, fn: Callable[[], Awaitable[Any]]) -> None:
        task = asyncio.ensure_future(fn())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("a background call failed", exc_info=task.exception())

    def close(self) -> None:
        """Close the client (releasing what it holds) and stop its loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._portal.call(self.client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)


_shared: dict[_Key, BackgroundClient] = {}
_shared_lock = threading.Lock()


def shared_client(url: str | None = None) -> BackgroundClient:
    """The process-wide `BackgroundClient` for ``url`` (see `resolve_url`), made on first use."""
    key = _key(url)
    with _shared_lock:
        client = _shared.get(key)
        if client is None or client.closed:
            client = _shared[key] = BackgroundClient(key)
        return client


def close_shared() -> None:
    """Close every `shared_client`: their sandboxes are released. Runs at exit too.

    A service already gone is no news then (a run's end often stops both): it
    releases the session's sandboxes itself once the lease passes, and the remote
    client says so at INFO, not as a warning."""
    with _shared_lock:
        clients = list(_shared.values())
        _shared.clear()
    for client in clients:
        try:
            client.close()
        except Exception:
            # At interpreter exit Python 3.12 refuses new threads, which some
            # teardown steps need; the pool's watchdog deletes what is left.
            logger.debug("closing %r failed", client, exc_info=True)


def _forget_shared() -> None:
    # A forked child (multiprocessing, some Ray setups) inherits the parent's clients
    # without their threads: it makes its own, and never closes the parent's.
    _shared.clear()


atexit.register(close_shared)
os.register_at_fork(after_in_child=_forget_shared)


# -- one client per running event loop --------------------------------------------------------


class _LoopClients:
    """The clients of one event loop, and the task that closes them when the loop ends."""

    def __init__(self) -> None:
        self.clients: dict[_Key, AsyncClient] = {}
        self.lock = asyncio.Lock()
        self.guard: asyncio.Task[None] | None = None

    async def close(self) -> None:
        clients = list(self.clients.values())
        self.clients.clear()
        for client in clients:
            try:
                await client.aclose()
            except Exception:
                logger.warning("closing a Sandman client failed", exc_info=True)

    async def close_at_end(self) -> None:
        # asyncio.run cancels every task left when its main task is done, and
        # waits for them: the last moment the loop still runs with everything
        # in place (an async generator hook would come after the loop has
        # stopped accepting new async generators, which closing needs).
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClients] = (
    weakref.WeakKeyDictionary()
)


async def loop_client(url: str | None = None, *, state_dir: str | None = None) -> AsyncClient:
    """The running event loop's `AsyncClient` for ``url`` (see `resolve_url`), made on first use;
    without a service, the embedded pool on ``state_dir`` (default ``SANDMAN_STATE_DIR``).

    It is closed, releasing its sandboxes, when the loop ends through
    ``asyncio.run`` (which cancels the tasks left, among them the one that
    closes it), or by `close_loop_clients`.
    """
    loop = asyncio.get_running_loop()
    entry = _per_loop.get(loop)
    if entry is None:
        entry = _per_loop[loop] = _LoopClients()
    if entry.guard is None or entry.guard.done():  # new, or cancelled by someone else
        entry.guard = loop.create_task(entry.close_at_end(), name="sandman-close-at-loop-end")
    key = _key(url, state_dir)
    async with entry.lock:
        client = entry.clients.get(key)
        if client is None:
            client = entry.clients[key] = _new_client(key)
        return client


async def close_loop_clients() -> None:
    """Close the running loop's clients now (they are made again on next use)."""
    entry = _per_loop.get(asyncio.get_running_loop())
    if entry is not None:
        await entry.close()
