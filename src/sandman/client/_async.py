"""AsyncClient and AsyncSandbox: the one implementation; `Client`/`Sandbox` are a facade over it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import tarfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from sandman import errors
from sandman.client.backends import Backend, Lease
from sandman.daemon.client import DEFAULT_MAX_READ
from sandman.daemon.untar import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_UNPACKED
from sandman.models import (
    Encoding,
    ExecEvent,
    ExecResult,
    FileStat,
    ProcessInfo,
    ProcessOutput,
    SandboxSpec,
    SessionInfo,
    SessionRunResult,
)
from sandman.pool.events import EventHook, PoolEvent, emit

__all__ = ["AsyncClient", "AsyncSandbox"]

logger = logging.getLogger(__name__)


class AsyncSandbox:
    """One leased sandbox. Commands and files go straight to its daemon.

    A non-zero exit code is data (``ExecResult.exit_code``). A sandbox that
    died, was evicted or expired raises `SandboxNotFound` on the next call:
    catch it to drop that rollout.
    """

    def __init__(
        self,
        lease: Lease,
        backend: Backend,
        *,
        on_release: Callable[[AsyncSandbox], None] | None = None,
    ) -> None:
        self._lease = lease
        self._backend = backend
        self._daemon = lease.endpoint.client()
        self._released = False
        self._lost: str | None = None  # why, once its client's session was replaced
        self._on_release = on_release

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
        return await self._backend.timeline(self.id)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    async def release(self) -> None:
        """Give the sandbox back; it is deleted. Idempotent."""
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            self._on_release(self)
        await self._daemon.aclose()
        await self._backend.release(self.id)

    @asynccontextmanager
    async def _guard(self) -> AsyncIterator[None]:
        """Turn "the daemon is gone" into SandboxNotFound when the sandbox really is."""
        if self._released:
            raise errors.SandboxNotFound(f"sandbox {self.id} was released")
        if self._lost is not None:
            raise errors.SandboxNotFound(f"sandbox {self.id} is gone: {self._lost}")
        try:
            yield
        except errors.DaemonUnavailable as exc:
            if not await self._backend.alive(self.id):
                raise errors.SandboxNotFound(f"sandbox {self.id} is gone: {exc.message}") from exc
            raise

    # -- commands -----------------------------------------------------------------

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        encoding: Encoding = "utf-8",
        check: bool = False,
    ) -> ExecResult:
        """Run a command to completion: a string runs in ``sh -c``, a sequence as argv."""
        async with self._guard():
            return await self._daemon.exec(
                command, cwd=cwd, env=env, stdin=stdin, timeout=timeout,
                max_output=max_output, encoding=encoding, check=check,
            )  # fmt: skip

    run = exec

    @asynccontextmanager
    async def exec_stream(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """Run a command and read its output as it happens; the last event is ``exit``."""
        async with (
            self._guard(),
            self._daemon.exec_stream(command, cwd=cwd, env=env, timeout=timeout) as events,
        ):
            yield events

    # -- background processes -------------------------------------------------------

    async def spawn(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        tty: bool = False,
        rows: int | None = None,
        cols: int | None = None,
    ) -> ProcessInfo:
        """Start a background process; it outlives this call (see `poll`, `read_output`).

        ``tty=True`` runs it on a pseudo-terminal of ``rows`` x ``cols``
        (default 24 x 80; see `resize`): all its output comes as stdout and
        stdin is always open.
        """
        async with self._guard():
            return await self._daemon.start_process(
                command, cwd=cwd, env=env, stdin=stdin, tty=tty, rows=rows, cols=cols
            )

    async def resize(self, process_id: str, *, rows: int, cols: int) -> None:
        """Set the size of a ``tty=True`` process's terminal (it gets SIGWINCH)."""
        async with self._guard():
            await self._daemon.resize_process(process_id, rows=rows, cols=cols)

    async def poll(self, process_id: str) -> ProcessInfo:
        """The process's state now (running, exit code)."""
        async with self._guard():
            return await self._daemon.get_process(process_id)

    async def read_output(
        self,
        process_id: str,
        *,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        wait: float | None = None,
        encoding: Encoding = "utf-8",
    ) -> ProcessOutput:
        """Its output from the given offsets; ``wait`` long-polls for new output.

        ``encoding="base64"`` keeps the bytes exact (``stdout`` is then base64).
        """
        async with self._guard():
            return await self._daemon.read_output(
                process_id, stdout_offset=stdout_offset, stderr_offset=stderr_offset, wait=wait,
                encoding=encoding,
            )  # fmt: skip

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Write to a process started with ``stdin=True``."""
        async with self._guard():
            await self._daemon.write_stdin(process_id, data, close=close)

    async def signal(self, process_id: str, signal: str | int = "TERM") -> ProcessInfo:
        """Signal the process's group."""
        async with self._guard():
            return await self._daemon.signal_process(process_id, signal)

    async def wait(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait for the process to exit (``running`` stays true if ``timeout`` passed first)."""
        async with self._guard():
            return await self._daemon.wait_process(process_id, timeout=timeout)

    # -- shell sessions -------------------------------------------------------------

    async def shell(
        self, *, cwd: str | None = None, env: Mapping[str, str] | None = None
    ) -> SessionInfo:
        """A persistent shell: ``cd``, exports and functions persist between `shell_run` calls."""
        async with self._guard():
            return await self._daemon.create_session(cwd=cwd, env=env)

    async def shell_run(
        self, session_id: str, cmd: str, *, timeout: float | None = None, check: bool = False
    ) -> SessionRunResult:
        """Run one command in the shell session."""
        async with self._guard():
            return await self._daemon.run_in_session(session_id, cmd, timeout=timeout, check=check)

    # -- files ------------------------------------------------------------------------

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file's bytes; FileTooLarge past ``max_bytes`` (64 MiB by default).

        A device, fifo or socket (a symlink to ``/dev/zero``) raises
        NotARegularFile. Use `read_file_stream` or `download` for large files.
        """
        async with self._guard():
            return await self._daemon.read_file(path, max_bytes=max_bytes)

    @asynccontextmanager
    async def read_file_stream(
        self, path: str, *, max_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Read a file in pieces as they arrive: ``async for chunk in chunks``.

        Memory stays bounded whatever the size; ``max_bytes`` (None: no
        limit) raises FileTooLarge once more arrived.
        """
        async with (
            self._guard(),
            self._daemon.read_file_stream(path, max_bytes=max_bytes) as chunks,
        ):
            yield chunks

    async def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None
    ) -> FileStat:
        """Write a whole file atomically, creating parent directories."""
        async with self._guard():
            return await self._daemon.write_file(path, data, mode=mode)

    async def stat(self, path: str) -> FileStat:
        """Stat a path (a final symlink is not followed)."""
        async with self._guard():
            return await self._daemon.stat(path)

    async def list_dir(self, path: str) -> list[FileStat]:
        """A directory's entries, sorted by name."""
        async with self._guard():
            return await self._daemon.list_dir(path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (``recursive`` for a non-empty one)."""
        async with self._guard():
            await self._daemon.remove(path, recursive=recursive)

    async def upload(self, local: str | Path, remote: str) -> None:
        """Copy a local file or directory tree into the sandbox at ``remote``."""
        source = Path(local)
        if await asyncio.to_thread(source.is_file):
            data, mode = await asyncio.to_thread(_read_file, source)
            await self.write_file(remote, data, mode=mode)
            return
        data = await asyncio.to_thread(_tar_directory, source)
        async with self._guard():
            await self._daemon.upload_archive(remote, data)

    async def download(
        self,
        remote: str,
        local: str | Path,
        *,
        max_bytes: int = DEFAULT_MAX_UNPACKED,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        """Copy a file or directory tree out of the sandbox to ``local``, as it arrives.

        What the sandbox sends is not trusted: a tree is unpacked without
        following any symlink and nothing lands outside ``local``
        (UnsafeArchive otherwise); more than ``max_bytes`` of files or
        ``max_entries`` entries raise FileTooLarge. A refused download leaves
        nothing of itself behind.
        """
        target = Path(local)
        async with self._guard():
            kind = (await self._daemon.stat(remote)).type
            if kind != "directory":
                await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
                await self._daemon.download_file(remote, target, max_bytes=max_bytes)
                return
            await self._daemon.download_tree(
                remote, target, max_bytes=max_bytes, max_entries=max_entries
            )


def _read_file(source: Path) -> tuple[bytes, int]:
    return source.read_bytes(), source.stat().st_mode & 0o7777


def _tar_directory(source: Path) -> bytes:
    if not source.is_dir():
        raise errors.ConfigError(f"nothing to upload at {source}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for child in sorted(source.iterdir()):
            tar.add(child, arcname=child.name)
    return buffer.getvalue()


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
            old, reason, new, len(ids), ", ".join(ids) or "none",
        )  # fmt: skip
        emit(
            self._hook,
            PoolEvent(
                "session.replaced", self._backend.name, session=new,
                detail={"old_session": old, "lost": ids, "reason": reason},
            ),
        )  # fmt: skip
        return new

    def _forget(self, sandbox: AsyncSandbox) -> None:
        self._held.pop(sandbox.id, None)

    async def acquire(
        self,
        image: str | SandboxSpec,
        *,
        timeout: float | None = None,
        **spec: Any,
    ) -> AsyncSandbox:
        """A ready sandbox; release it with `AsyncSandbox.release` (or use `sandbox`).

        ``image`` is an image reference (other `SandboxSpec` fields as keywords:
        ``cpu``, ``memory``, ``pids``, ``network``, ``env``...) or a whole spec.
        ``timeout`` bounds the wait: CreateTimeout after it. If the client's
        session turns out to be over, a new one replaces it and the acquire is
        tried once more in it, within the same ``timeout``.
        """
        full = image if isinstance(image, SandboxSpec) else SandboxSpec(image=image, **spec)
        session = await self._ensure_session()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            lease = await self._backend.acquire(full, session=session, timeout=timeout)
        except errors.SessionExpired:
            session = await self._replace_session(session, reason="acquire")
            left = None if timeout is None else max(0.0, timeout - (loop.time() - started))
            lease = await self._backend.acquire(full, session=session, timeout=left)
        sandbox = AsyncSandbox(lease, self._backend, on_release=self._forget)
        self._held[sandbox.id] = (session, sandbox)
        return sandbox

    @asynccontextmanager
    async def sandbox(
        self,
        image: str | SandboxSpec,
        *,
        timeout: float | None = None,
        **spec: Any,
    ) -> AsyncIterator[AsyncSandbox]:
        """``async with client.sandbox(image=...) as sb``: acquired, then always released."""
        sb = await self.acquire(image, timeout=timeout, **spec)
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
