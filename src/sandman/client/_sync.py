"""Client and Sandbox: the blocking facade. Each method is one call through an anyio portal
into the async implementation, which runs on the portal's event loop thread; the
sandbox's methods are derived from `AsyncSandbox`'s (`_blocking`), never written again."""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from functools import partial
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from sandman.client._async import AsyncClient, AsyncSandbox
from sandman.models import SandboxSpec, Snapshot

__all__ = ["Client", "Sandbox"]

P = ParamSpec("P")
T = TypeVar("T")


def _iterate(portal: BlockingPortal, events: AsyncIterator[T]) -> Iterator[T]:
    while True:
        try:
            yield portal.call(events.__anext__)
        except StopAsyncIteration:
            return


def _blocking(
    method: Callable[Concatenate[AsyncSandbox, P], Awaitable[T]],
) -> Callable[Concatenate[Sandbox, P], T]:
    """The sandbox's async ``method`` as a blocking one: same signature and docstring."""

    @functools.wraps(method)
    def call(self: Sandbox, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._portal.call(partial(method, self._async, *args, **kwargs))

    return call


def _blocking_stream(
    method: Callable[Concatenate[AsyncSandbox, P], AbstractAsyncContextManager[AsyncIterator[T]]],
) -> Callable[Concatenate[Sandbox, P], AbstractContextManager[Iterator[T]]]:
    """`_blocking` for a stream: a context manager around an iterator."""

    @functools.wraps(method)
    @contextmanager
    def call(self: Sandbox, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[Iterator[T]]:
        stream = method(self._async, *args, **kwargs)
        with self._portal.wrap_async_context_manager(stream) as items:
            yield _iterate(self._portal, items)

    return call


class Sandbox:
    """The blocking face of `AsyncSandbox`: the same operations, each one call through
    the client's portal; see there (and `DaemonClient`) for each."""

    def __init__(self, sandbox: AsyncSandbox, portal: BlockingPortal) -> None:
        self._async = sandbox
        self._portal = portal

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    @property
    def id(self) -> str:
        """The sandbox's id (also its hostname)."""
        return self._async.id

    @property
    def expires_at(self) -> float:
        """Wall-clock time at which the sandbox is deleted whatever happens."""
        return self._async.expires_at

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    timeline = _blocking(AsyncSandbox.timeline)
    release = _blocking(AsyncSandbox.release)
    usage = _blocking(AsyncSandbox.usage)

    # Snapshots: `fork` makes Sandboxes, so it is written out.
    snapshot = _blocking(AsyncSandbox.snapshot)
    restore = _blocking(AsyncSandbox.restore)
    pause = _blocking(AsyncSandbox.pause)
    resume = _blocking(AsyncSandbox.resume)
    set_egress = _blocking(AsyncSandbox.set_egress)

    def fork(self, n: int = 1, *, timeout: float | None = None, **spec: Any) -> list[Sandbox]:
        """See `AsyncSandbox.fork`."""
        made = self._portal.call(partial(self._async.fork, n, timeout=timeout, **spec))
        return [Sandbox(sb, self._portal) for sb in made]

    @property
    def paused(self) -> bool:
        """See `AsyncSandbox.paused`."""
        return self._async.paused

    # Streams: a context manager around an iterator.
    exec_stream = _blocking_stream(AsyncSandbox.exec_stream)
    read_file_stream = _blocking_stream(AsyncSandbox.read_file_stream)

    # Everything else, in `AsyncSandbox`'s order.
    health = _blocking(AsyncSandbox.health)
    exec = _blocking(AsyncSandbox.exec)
    spawn = _blocking(AsyncSandbox.spawn)
    poll = _blocking(AsyncSandbox.poll)
    wait = _blocking(AsyncSandbox.wait)
    signal = _blocking(AsyncSandbox.signal)
    kill = _blocking(AsyncSandbox.kill)
    resize = _blocking(AsyncSandbox.resize)
    read_output = _blocking(AsyncSandbox.read_output)
    write_stdin = _blocking(AsyncSandbox.write_stdin)
    list_processes = _blocking(AsyncSandbox.list_processes)
    create_shell = _blocking(AsyncSandbox.create_shell)
    run_in_shell = _blocking(AsyncSandbox.run_in_shell)
    close_shell = _blocking(AsyncSandbox.close_shell)
    get_shell = _blocking(AsyncSandbox.get_shell)
    list_shells = _blocking(AsyncSandbox.list_shells)
    read_file = _blocking(AsyncSandbox.read_file)
    write_file = _blocking(AsyncSandbox.write_file)
    stat = _blocking(AsyncSandbox.stat)
    exists = _blocking(AsyncSandbox.exists)
    list_dir = _blocking(AsyncSandbox.list_dir)
    mkdir = _blocking(AsyncSandbox.mkdir)
    move = _blocking(AsyncSandbox.move)
    remove = _blocking(AsyncSandbox.remove)
    upload = _blocking(AsyncSandbox.upload)
    download = _blocking(AsyncSandbox.download)
    download_file = _blocking(AsyncSandbox.download_file)
    upload_archive = _blocking(AsyncSandbox.upload_archive)
    download_archive = _blocking(AsyncSandbox.download_archive)
    download_tree = _blocking(AsyncSandbox.download_tree)
    # Its listener runs on the portal's loop; `ExposedPort.close` (and ``with``) reach it there.
    expose = _blocking(AsyncSandbox.expose)
    # Deprecated: the shells' old names (CHANGELOG), the same calls.
    create_session = create_shell
    run_in_session = run_in_shell
    close_session = close_shell
    get_session = get_shell
    list_sessions = list_shells


class Client:
    """The blocking face of `AsyncClient`. Close it (or use ``with``); an atexit hook is the backstop."""

    def __init__(self, client: AsyncClient) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._async = client
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    @property
    def session(self) -> str | None:
        """The id of the client's session now; see `AsyncClient.session`."""
        return self._async.session

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def acquire(
        self,
        image: str | SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        snapshot: Snapshot | str | None = None,
        **spec: Any,
    ) -> Sandbox:
        """A ready sandbox; release it with `Sandbox.release` (or use `sandbox`). See
        `AsyncClient.acquire`."""
        acquire = partial(self._async.acquire, image, timeout=timeout, snapshot=snapshot, **spec)
        return Sandbox(self._portal.call(acquire), self._portal)

    @contextmanager
    def sandbox(
        self,
        image: str | SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        snapshot: Snapshot | str | None = None,
        **spec: Any,
    ) -> Iterator[Sandbox]:
        """``with client.sandbox(image=...) as sb``: acquired, then always released."""
        with self.acquire(image, timeout=timeout, snapshot=snapshot, **spec) as sb:
            yield sb

    def warm(self, image: str | SandboxSpec, count: int, **spec: Any) -> None:
        """See `AsyncClient.warm`."""
        self._portal.call(partial(self._async.warm, image, count, **spec))

    def build_image(
        self,
        dockerfile: str | os.PathLike[str],
        context: str | os.PathLike[str],
        *,
        name: str,
        network: bool = False,
        cache: bool = True,
        reuse: bool = False,
    ) -> str:
        """See `AsyncClient.build_image`."""
        build = partial(self._async.build_image, network=network, cache=cache, reuse=reuse)
        return self._portal.call(partial(build, dockerfile, context, name=name))

    def snapshots(self) -> list[Snapshot]:
        """See `AsyncClient.snapshots`."""
        return self._portal.call(self._async.snapshots)

    def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """See `AsyncClient.delete_snapshot`."""
        self._portal.call(self._async.delete_snapshot, snapshot)

    def close(self) -> None:
        """End the session, release everything, stop the portal. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            self._portal.call(self._async.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)
