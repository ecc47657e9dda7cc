"""AsyncClient and AsyncSandbox: the one implementation; `Client`/`Sandbox` are a facade over it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from pydantic import ValidationError

from sandman import errors
from sandman._tracing import span
from sandman.client.backends import Backend, Lease
from sandman.daemon.client import DaemonClient
from sandman.egress import Egress
from sandman.models import SandboxSpec, Snapshot, Usage, explain
from sandman.pool.events import EventHook, PoolEvent, emit

__all__ = ["AsyncClient", "AsyncSandbox"]

logger = logging.getLogger(__name__)


P = ParamSpec("P")
T = TypeVar("T")


def _guarded(
    method: Callable[Concatenate[DaemonClient, P], Awaitable[T]],
    *,
    traced: str | None = None,
) -> Callable[Concatenate[AsyncSandbox, P], Coroutine[Any, Any, T]]:
    """The daemon's ``method`` as a sandbox's: same signature and docstring, with
    "the daemon is gone" turned into SandboxLost (why) or SandboxNotFound when the
    sandbox is; with ``traced``, in a span of that name where tracing is set up."""

    @functools.wraps(method)
    async def call(self: AsyncSandbox, /, *args: P.args, **kwargs: P.kwargs) -> T:
        with span(traced, sandbox=self.id) if traced is not None else contextlib.nullcontext():
            async with self._guard():
                return await method(self._daemon, *args, **kwargs)

    return call


def _guarded_stream(
    method: Callable[Concatenate[DaemonClient, P], AbstractAsyncContextManager[T]],
) -> Callable[Concatenate[AsyncSandbox, P], AbstractAsyncContextManager[T]]:
    """`_guarded` for a call that is an async context manager (a stream)."""

    @functools.wraps(method)
    @asynccontextmanager
    async def call(self: AsyncSandbox, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        async with self._guard(), method(self._daemon, *args, **kwargs) as value:
            yield value

    return call


class AsyncSandbox:
    """One leased sandbox. Commands and files go straight to its daemon.

    A non-zero exit code is data (``ExecResult.exit_code``). A sandbox that
    died (OOM, a crash, killed, its pod evicted) raises `SandboxLost` on the next
    call, whose ``reason`` says why; one released or expired `SandboxNotFound`
    (which `SandboxLost` is too): catch it to drop that rollout. Its operations
    are `DaemonClient`'s, with the same names, parameters and words.
    """

    def __init__(
        self,
        lease: Lease,
        backend: Backend,
        *,
        on_release: Callable[[AsyncSandbox], None] | None = None,
        client: AsyncClient | None = None,
    ) -> None:
        self._lease = lease
        self._backend = backend
        self._daemon = lease.endpoint.client()
        self._released = False
        self._lost: str | None = None  # why, once its client's session was replaced
        self._paused = False
        self._on_release = on_release
        self._client = client

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    @property
    def id(self) -> str:
        """The sandbox's id (also its hostname)."""
        return self._lease.id

    @property
    def expires_at(self) -> float:
        """Wall-clock time at which the sandbox is deleted whatever happens."""
        return self._lease.expires_at

    async def timeline(self) -> dict[str, float]:
        """When each step happened (queued, create_called, ..., handed_out, released, gone)."""
        return await self._backend.timeline(self._lease)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    async def release(self) -> Usage | None:
        """Give the sandbox back; it is deleted. Returns what it used (CPU, memory, disk,
        network: the rollout's cost) where the backend can tell, read just before.
        Idempotent (None the second time)."""
        if self._released:
            return None
        self._released = True
        if self._on_release is not None:
            self._on_release(self)
        with span("release", sandbox=self.id):
            await self._daemon.aclose()
            return await self._backend.release(self.id)

    async def usage(self) -> Usage | None:
        """What the sandbox has used so far: CPU seconds, peak and current memory, disk
        written, network bytes in and out (`Usage`); None where the backend cannot tell."""
        self._check_usable()
        return await self._backend.usage(self.id)

    # -- snapshots, forks, restore, pause ------------------------------------------------

    async def snapshot(self, *, memory: bool = False, ttl: float | None = None) -> Snapshot:
        """Keep this sandbox's files (with ``memory``, its processes too, where the
        runtime can) as a `Snapshot` to make sandboxes from (``client.sandbox(snapshot=)``)
        or to `restore`. The sandbox goes on. The snapshot is deleted after ``ttl``
        seconds (the pool's sandbox lifetime by default), by `AsyncClient.delete_snapshot`,
        or when its pool closes."""
        self._check_usable()
        return await self._backend.snapshot(self.id, memory=memory, ttl=ttl)

    async def fork(
        self, n: int = 1, *, timeout: float | None = None, **spec: Any
    ) -> list[AsyncSandbox]:
        """``n`` new sandboxes, each holding this one's files as of now (copy-on-write: they
        share what none of them changed). This one goes on. Release each (or the client
        does at its close). ``spec`` changes the forks' limits (``memory``, ``cpu``...).
        The snapshot they are made from is deleted once they are."""
        if n < 1:
            raise errors.ConfigError(f"fork needs n >= 1, got {n}")
        if self._client is None:
            raise errors.ConfigError("this sandbox has no client to acquire forks from")
        snapshot = await self.snapshot()
        try:
            made = await asyncio.gather(
                *(
                    self._client.acquire(snapshot=snapshot, timeout=timeout, **spec)
                    for _ in range(n)
                ),
                return_exceptions=True,
            )
        finally:
            with contextlib.suppress(errors.SandboxError):
                await self._backend.delete_snapshot(snapshot.id)
        forks = [sb for sb in made if isinstance(sb, AsyncSandbox)]
        failure = next((e for e in made if isinstance(e, BaseException)), None)
        if failure is not None:
            for sb in forks:
                await sb.release()
            raise failure
        return forks

    async def restore(self, snapshot: Snapshot | str) -> None:
        """Reset this sandbox to ``snapshot`` (of the same image) in place: same id, same
        lease; every process now running ends (a snapshot with memory brings back its own)."""
        self._check_usable()
        snapshot_id = snapshot if isinstance(snapshot, str) else snapshot.id
        endpoint = await self._backend.restore(self.id, snapshot_id)
        old, self._daemon = self._daemon, endpoint.client()
        self._lease = Lease(self.id, endpoint, self._lease.expires_at, self._lease.timeline)
        self._paused = False
        await old.aclose()

    async def pause(self, *, memory: bool = False) -> None:
        """Stop every process of the sandbox: it uses no CPU until `resume`. Its memory
        stays held, unless ``memory`` (gVisor with its own network stack: see
        `snapshot`) checkpoints the processes to disk, to be restored on `resume`. Its
        lease and lifetime go on; calls meanwhile raise `SandboxPaused`."""
        self._check_usable()
        await self._backend.pause(self.id, memory=memory)
        self._paused = True

    async def resume(self) -> None:
        """Let a paused sandbox's processes run again."""
        if self._released:
            raise errors.SandboxNotFound(f"sandbox {self.id} was released")
        await self._backend.resume(self.id)
        self._paused = False

    async def set_egress(
        self,
        egress: Egress | None = None,
        *,
        allow: Sequence[str] | None = None,
        deny: Sequence[str] = (),
    ) -> None:
        """Change where this egress sandbox may connect, at once: ``set_egress(allow=[])``
        closes the network (after installing the dependencies), ``set_egress(allow=None)``
        opens it again (but the walls). Connections it has open are judged by the new
        rules too. ``egress`` is the same as an `Egress`. A sandbox made without egress,
        or a rule the backend cannot hold (a domain on Kubernetes), is a `ConfigError`."""
        self._check_usable()
        rules = egress if egress is not None else Egress(allow=allow, deny=deny)
        await self._backend.set_egress(self.id, rules)

    @property
    def paused(self) -> bool:
        """Whether `pause` stopped it (and no `resume` since)."""
        return self._paused

    def _check_usable(self) -> None:
        if self._released:
            raise errors.SandboxNotFound(f"sandbox {self.id} was released")
        if self._lost is not None:
            raise errors.SandboxNotFound(f"sandbox {self.id} is gone: {self._lost}")

    @asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        """Turn "the daemon is gone" into SandboxLost (why) or SandboxNotFound when the
        sandbox really is gone."""
        self._check_usable()
        if self._paused:
            raise errors.SandboxPaused(f"sandbox {self.id} is paused: resume() it first")
        try:
            yield
        except errors.DaemonUnavailable as exc:
            try:
                await self._backend.check(self.id)
            except errors.SandboxNotFound as gone:
                raise gone from exc
            raise

    # -- the daemon's operations, each guarded ------------------------------------
    # One vocabulary: every call of `DaemonClient` but its connection's own
    # (`aclose`, `wait_ready`), with its signature and docstring.

    health = _guarded(DaemonClient.health)
    exec = _guarded(DaemonClient.exec, traced="exec")
    exec_stream = _guarded_stream(DaemonClient.exec_stream)

    spawn = _guarded(DaemonClient.spawn)
    poll = _guarded(DaemonClient.poll)
    wait = _guarded(DaemonClient.wait)
    signal = _guarded(DaemonClient.signal)
    kill = _guarded(DaemonClient.kill)
    resize = _guarded(DaemonClient.resize)
    read_output = _guarded(DaemonClient.read_output)
    write_stdin = _guarded(DaemonClient.write_stdin)
    list_processes = _guarded(DaemonClient.list_processes)

    create_shell = _guarded(DaemonClient.create_shell)
    run_in_shell = _guarded(DaemonClient.run_in_shell)
    close_shell = _guarded(DaemonClient.close_shell)
    get_shell = _guarded(DaemonClient.get_shell)
    list_shells = _guarded(DaemonClient.list_shells)
    # Deprecated: the shells' old names (CHANGELOG), the same calls.
    create_session = create_shell
    run_in_session = run_in_shell
    close_session = close_shell
    get_session = get_shell
    list_sessions = list_shells

    read_file = _guarded(DaemonClient.read_file)
    read_file_stream = _guarded_stream(DaemonClient.read_file_stream)
    write_file = _guarded(DaemonClient.write_file)
    stat = _guarded(DaemonClient.stat)
    exists = _guarded(DaemonClient.exists)
    list_dir = _guarded(DaemonClient.list_dir)
    mkdir = _guarded(DaemonClient.mkdir)
    move = _guarded(DaemonClient.move)
    remove = _guarded(DaemonClient.remove)

    upload = _guarded(DaemonClient.upload)
    download = _guarded(DaemonClient.download)
    download_file = _guarded(DaemonClient.download_file)
    upload_archive = _guarded(DaemonClient.upload_archive)
    download_archive = _guarded(DaemonClient.download_archive)
    download_tree = _guarded(DaemonClient.download_tree)

    expose = _guarded(DaemonClient.expose)


def _spec(image: str, fields: dict[str, Any]) -> SandboxSpec:
    """The spec of ``image`` and ``fields``; a `ConfigError` (not pydantic's) if one is bad."""
    try:
        return SandboxSpec(image=image, **fields)
    except ValidationError as exc:
        problems = "; ".join(f"{field}: {words}" for field, words in explain(exc))
        raise errors.ConfigError(f"invalid sandbox spec: {problems}") from None


class AsyncClient:
    """Sandboxes for one client session, from a backend (``sandman.local()`` for the embedded pool).

    ``async with client.sandbox(image=...) as sb:`` acquires a ready sandbox
    and releases it at the end of the block, whatever happens in it. The
    session is kept alive by heartbeats while the client is open; `aclose`
    ends it, releasing whatever it still holds.

    A session can still end behind the client's back (the process was
    stopped for longer than the lease, the service restarted without its
    state): when a heartbeat or an acquire finds it gone, the client opens a
    new session and carries on (that acquire is tried once more, in the new
    session). What the old session held is lost: those sandboxes raise
    `SandboxNotFound` on their next call, and the client logs a warning and
    sends ``hook`` a ``session.replaced`` event (``session`` is the new id;
    ``detail``: ``old_session``, ``lost``, the ids of the sandboxes lost, and
    ``reason``, what found the session gone).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        heartbeat_interval: float = 5.0,
        hook: EventHook | None = None,
    ) -> None:
        self._backend = backend
        self._heartbeat_interval = heartbeat_interval
        self._hook = hook
        self._session: str | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        # The sandboxes handed to this client and not released, and the session of each.
        self._held: dict[str, tuple[str, AsyncSandbox]] = {}

    @property
    def session(self) -> str | None:
        """The id of the client's session now (None before the first acquire); it changes
        when an expired session is replaced (see the class)."""
        return self._session

    async def __aenter__(self) -> Self:
        await self._ensure_session()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _ensure_session(self) -> str:
        if self._closed:
            raise errors.PoolClosed("the client is closed")
        async with self._lock:
            if self._session is None:
                self._session = await self._backend.open_session()
                self._heartbeats = asyncio.create_task(self._beat())
            return self._session

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            session = self._session
            if session is None:
                continue
            try:
                await self._backend.heartbeat(session)
            except errors.SessionExpired:
                # Not reachable now: the next beat tries again.
                with contextlib.suppress(errors.SandboxError):
                    await self._replace_session(session, reason="heartbeat")
            except errors.SandboxError:
                pass  # the service may be back by the next beat

    async def _replace_session(self, old: str, *, reason: str) -> str:
        """A new session in place of ``old``, which is over; once, however many find it."""
        async with self._lock:
            if self._closed:
                raise errors.PoolClosed("the client is closed")
            if self._session != old:
                assert self._session is not None
                return self._session  # replaced already
            new = await self._backend.open_session()
            self._session = new
        lost = [sb for session, sb in self._held.values() if session == old]
        for sb in lost:
            sb._lost = f"the session {old} that held it expired (replaced by {new})"
            self._held.pop(sb.id, None)
        ids = [sb.id for sb in lost]
        logger.warning(
            "session %s expired (found by %s); carrying on in a new session %s; "
            "%d sandboxes it held are lost: %s",
            old,
            reason,
            new,
            len(ids),
            ", ".join(ids) or "none",
        )
        emit(
            self._hook,
            PoolEvent(
                "session.replaced",
                self._backend.name,
                session=new,
                detail={"old_session": old, "lost": ids, "reason": reason},
            ),
        )
        return new

    def _forget(self, sandbox: AsyncSandbox) -> None:
        self._held.pop(sandbox.id, None)

    async def acquire(
        self,
        image: str | SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        snapshot: Snapshot | str | None = None,
        **spec: Any,
    ) -> AsyncSandbox:
        """A ready sandbox; release it with `AsyncSandbox.release` (or use `sandbox`).

        ``image`` is an image reference (other `SandboxSpec` fields as keywords:
        ``cpu``, ``memory``, ``pids``, ``network``, ``env``...) or a whole spec.
        With ``snapshot`` (a `Snapshot` or its id), the sandbox starts from its files,
        with its spec unless keywords change it; ``image`` may then be left out.
        ``timeout`` bounds the wait: CreateTimeout after it. If the client's
        session turns out to be over, a new one replaces it and the acquire is
        tried once more in it, within the same ``timeout``. A bad value
        (``memory="lots"``, ``cpu=0``) is a `ConfigError` naming each field.
        """
        if snapshot is not None:
            full = await self._from_snapshot(snapshot, image, spec)
        elif image is None:
            raise errors.ConfigError("acquire needs an image (or a snapshot)")
        else:
            full = image if isinstance(image, SandboxSpec) else _spec(image, spec)
        session = await self._ensure_session()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with span("acquire", image=full.image, snapshot=full.snapshot) as current:
            try:
                lease = await self._backend.acquire(full, session=session, timeout=timeout)
            except errors.SessionExpired:
                session = await self._replace_session(session, reason="acquire")
                left = None if timeout is None else max(0.0, timeout - (loop.time() - started))
                lease = await self._backend.acquire(full, session=session, timeout=left)
            if current is not None:
                current.set_attribute("sandman.sandbox", lease.id)
        sandbox = AsyncSandbox(lease, self._backend, on_release=self._forget, client=self)
        self._held[sandbox.id] = (session, sandbox)
        return sandbox

    async def _from_snapshot(
        self, snapshot: Snapshot | str, image: str | SandboxSpec | None, changes: dict[str, Any]
    ) -> SandboxSpec:
        if isinstance(snapshot, str):
            await self._ensure_session()
            snapshot = await self._backend.get_snapshot(snapshot)
        if isinstance(image, SandboxSpec):
            changes = {**image.model_dump(exclude_unset=True), **changes}
        elif image is not None and image != snapshot.image:
            raise errors.ConfigError(
                f"snapshot {snapshot.id} is of image {snapshot.image!r}, not {image!r}"
            )
        try:
            return snapshot.fork_spec(**changes)
        except ValidationError as exc:
            problems = "; ".join(f"{field}: {words}" for field, words in explain(exc))
            raise errors.ConfigError(f"invalid sandbox spec: {problems}") from None

    async def warm(self, image: str | SandboxSpec, count: int, **spec: Any) -> None:
        """Keep ``count`` ready sandboxes of this spec (0: none): an acquire of the same spec
        then takes one at once. On a service they are the tenant's, and count against its
        sandbox limit. Spares live until used or the pool closes."""
        if count < 0:
            raise errors.ConfigError(f"warm needs count >= 0, got {count}")
        full = image if isinstance(image, SandboxSpec) else _spec(image, spec)
        await self._ensure_session()
        await self._backend.warm(full, count)

    async def build_image(
        self,
        dockerfile: str | os.PathLike[str],
        context: str | os.PathLike[str],
        *,
        name: str,
        network: bool = False,
        cache: bool = True,
        reuse: bool = False,
    ) -> str:
        """Build ``dockerfile`` over the directory ``context`` into image ``name`` where this
        client's sandboxes are made (the local provider's store, with buildah: see
        `sandman.images.ImageStore.build`), and return ``name`` for specs to use. ``RUN``
        steps get no network unless ``network``. With ``reuse``, an image already stored
        under ``name`` is taken without building (name it by its content). A service or
        a cluster does not build: `ConfigError` says where to build instead."""
        await self._backend.build_image(
            Path(dockerfile),
            Path(context),
            name=name,
            network=network,
            cache=cache,
            reuse=reuse,
        )
        return name

    async def snapshots(self) -> list[Snapshot]:
        """The snapshots this client can make sandboxes from (its pool's, or its tenant's
        on a service)."""
        await self._ensure_session()
        return await self._backend.snapshots()

    async def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """Delete a snapshot; sandboxes made from it keep their files. Idempotent."""
        await self._ensure_session()
        await self._backend.delete_snapshot(snapshot if isinstance(snapshot, str) else snapshot.id)

    @asynccontextmanager
    async def sandbox(
        self,
        image: str | SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        snapshot: Snapshot | str | None = None,
        **spec: Any,
    ) -> AsyncIterator[AsyncSandbox]:
        """``async with client.sandbox(image=...) as sb``: acquired, then always released."""
        sb = await self.acquire(image, timeout=timeout, snapshot=snapshot, **spec)
        try:
            yield sb
        finally:
            await sb.release()

    async def aclose(self) -> None:
        """End the session (releasing what it holds) and the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
        if self._session is not None:
            await self._backend.close_session(self._session)
        await self._backend.aclose()
