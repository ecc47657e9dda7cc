"""Client and Sandbox: the blocking facade. Each method is one call through an anyio portal
into the async implementation, which runs on the portal's event loop thread."""

from __future__ import annotations

import atexit
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from sandman.client._async import AsyncClient, AsyncSandbox
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

__all__ = ["Client", "Sandbox"]

T = TypeVar("T")


def _iterate(portal: BlockingPortal, events: AsyncIterator[T]) -> Iterator[T]:
    while True:
        try:
            yield portal.call(events.__anext__)
        except StopAsyncIteration:
            return


class Sandbox:
    """The blocking face of `AsyncSandbox`; see there for each method."""

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

    def timeline(self) -> dict[str, float]:
        """When each step happened (queued, create_called, ..., handed_out, released, gone)."""
        return self._portal.call(self._async.timeline)

    def release(self) -> None:
        """Give the sandbox back; it is deleted. Idempotent."""
        return self._portal.call(self._async.release)

    def exec(
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
        return self._portal.call(partial(self._async.exec, command, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output, encoding=encoding, check=check))  # fmt: skip

    run = exec

    @contextmanager
    def exec_stream(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[Iterator[ExecEvent]]:
        """Run a command and read its output as it happens; the last event is ``exit``."""
        with self._portal.wrap_async_context_manager(self._async.exec_stream(command, cwd=cwd, env=env, timeout=timeout)) as events:  # fmt: skip
            yield _iterate(self._portal, events)

    def spawn(
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
        """Start a background process; it outlives this call (``tty=True``: on a terminal)."""
        return self._portal.call(partial(self._async.spawn, command, cwd=cwd, env=env, stdin=stdin, tty=tty, rows=rows, cols=cols))  # fmt: skip

    def resize(self, process_id: str, *, rows: int, cols: int) -> None:
        """Set the size of a ``tty=True`` process's terminal."""
        return self._portal.call(partial(self._async.resize, process_id, rows=rows, cols=cols))

    def poll(self, process_id: str) -> ProcessInfo:
        """The process's state now."""
        return self._portal.call(self._async.poll, process_id)

    def read_output(
        self,
        process_id: str,
        *,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        wait: float | None = None,
        encoding: Encoding = "utf-8",
    ) -> ProcessOutput:
        """Its output from the given offsets; ``wait`` long-polls for new output."""
        return self._portal.call(partial(self._async.read_output, process_id, stdout_offset=stdout_offset, stderr_offset=stderr_offset, wait=wait, encoding=encoding))  # fmt: skip

    def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Write to a process started with ``stdin=True``."""
        return self._portal.call(partial(self._async.write_stdin, process_id, data, close=close))

    def signal(self, process_id: str, signal: str | int = "TERM") -> ProcessInfo:
        """Signal the process's group."""
        return self._portal.call(self._async.signal, process_id, signal)

    def wait(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait for the process to exit."""
        return self._portal.call(partial(self._async.wait, process_id, timeout=timeout))

    def shell(self, *, cwd: str | None = None, env: Mapping[str, str] | None = None) -> SessionInfo:
        """A persistent shell session."""
        return self._portal.call(partial(self._async.shell, cwd=cwd, env=env))

    def shell_run(
        self, session_id: str, cmd: str, *, timeout: float | None = None, check: bool = False
    ) -> SessionRunResult:
        """Run one command in the shell session."""
        return self._portal.call(partial(self._async.shell_run, session_id, cmd, timeout=timeout, check=check))  # fmt: skip

    def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file's bytes; FileTooLarge past ``max_bytes`` (64 MiB by default)."""
        return self._portal.call(partial(self._async.read_file, path, max_bytes=max_bytes))

    @contextmanager
    def read_file_stream(
        self, path: str, *, max_bytes: int | None = None
    ) -> Iterator[Iterator[bytes]]:
        """Read a file in pieces as they arrive: ``for chunk in chunks``."""
        with self._portal.wrap_async_context_manager(self._async.read_file_stream(path, max_bytes=max_bytes)) as chunks:  # fmt: skip
            yield _iterate(self._portal, chunks)

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> FileStat:
        """Write a whole file atomically, creating parent directories."""
        return self._portal.call(partial(self._async.write_file, path, data, mode=mode))

    def stat(self, path: str) -> FileStat:
        """Stat a path (a final symlink is not followed)."""
        return self._portal.call(self._async.stat, path)

    def list_dir(self, path: str) -> list[FileStat]:
        """A directory's entries, sorted by name."""
        return self._portal.call(self._async.list_dir, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (``recursive`` for a non-empty one)."""
        return self._portal.call(partial(self._async.remove, path, recursive=recursive))

    def upload(self, local: str | Path, remote: str) -> None:
        """Copy a local file or directory tree into the sandbox."""
        return self._portal.call(self._async.upload, local, remote)

    def download(
        self,
        remote: str,
        local: str | Path,
        *,
        max_bytes: int = DEFAULT_MAX_UNPACKED,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        """Copy a file or directory tree out of the sandbox to ``local``, as it arrives."""
        return self._portal.call(partial(self._async.download, remote, local, max_bytes=max_bytes, max_entries=max_entries))  # fmt: skip


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
        self, image: str | SandboxSpec, *, timeout: float | None = None, **spec: Any
    ) -> Sandbox:
        """A ready sandbox; release it with `Sandbox.release` (or use `sandbox`)."""
        return Sandbox(self._portal.call(partial(self._async.acquire, image, timeout=timeout, **spec)), self._portal)  # fmt: skip

    @contextmanager
    def sandbox(
        self, image: str | SandboxSpec, *, timeout: float | None = None, **spec: Any
    ) -> Iterator[Sandbox]:
        """``with client.sandbox(image=...) as sb``: acquired, then always released."""
        with self.acquire(image, timeout=timeout, **spec) as sb:
            yield sb

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
