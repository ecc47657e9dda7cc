"""The async client of sandmand's protocol v1: commands, processes, shells, files, archives.

One piece (about 1,000 lines) because it is one protocol's client: every
method shares the connection, auth, error mapping and limits below, and the
sync facade and the SDK derive from its signatures in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from ssl import SSLContext
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack

from pydantic import BaseModel
from pydantic_core import to_json

from sandman import errors
from sandman._transport import (
    AsyncTransport,
    ConnectionLost,
    HTTPTransport,
    Response,
    ResponseStream,
    UntrustedPeer,
    iter_lines,
)
from sandman.daemon import protocol
from sandman.daemon.protocol import ExecOptions
from sandman.daemon.tunnel import Dialer, ExposedPort
from sandman.daemon.untar import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_UNPACKED, TarExtractor
from sandman.models import (
    ArchiveResult,
    Encoding,
    ExecEvent,
    ExecResult,
    FileStat,
    Health,
    OnTimeout,
    ProcessInfo,
    ProcessOutput,
    ShellInfo,
    ShellRunResult,
)

__all__ = ["DEFAULT_MAX_READ", "DaemonClient"]

DEFAULT_MAX_READ = 64 * 1024**2
"""Default cap on what `DaemonClient.read_file` (and in-memory downloads) buffer."""
# Error answers are a line of JSON; a daemon sending more is not believed.
_MAX_ERROR = 64 * 1024
# Downloads hand the disk work to a thread in pieces of about this size.
_BATCH = 1024 * 1024

_JSON = "application/json"
# Extra time the client allows past a command's own timeout and kill grace
# before it gives up on the daemon.
_DEADLINE_SLACK = 10.0
_DEFAULT_KILL_GRACE = 2.0

_M = TypeVar("_M", bound=BaseModel)
# What a gateway in front of the daemon answers when the sandbox is out of reach.
_GATEWAY_CODES = frozenset({"daemon_unavailable", "sandbox_not_found", "sandbox_lost"})


def _unavailable(address: str, exc: Exception) -> errors.DaemonError:
    """The one place where transport failures become package errors."""
    if isinstance(exc, UntrustedPeer):
        return errors.UntrustedDaemon(str(exc))
    if isinstance(exc, ConnectionLost):
        return errors.DaemonUnavailable(f"connection to {address} lost: {exc}")
    return errors.DaemonUnavailable(f"cannot reach sandmand at {address}: {exc}")


@contextmanager
def _map_transport_errors(address: str) -> Iterator[None]:
    try:
        yield
    except errors.SandboxError:
        raise  # the daemon's own answer; some are OSErrors too (PathNotFound)
    except (ConnectionLost, OSError) as exc:
        raise _unavailable(address, exc) from exc


class DaemonClient:
    """Talks to one sandmand over a unix socket (``uds``) or TCP (``host``, ``port``).

    Calls may run concurrently; each uses its own kept-alive connection.
    ``request_timeout`` bounds calls that do not run a command; command calls
    are bounded by their own ``timeout`` (plus the kill grace and some slack).
    With ``peer_pid`` (a unix socket on this host), every connection's peer
    must be that process, else `UntrustedDaemon` and nothing is sent.

    ``transport`` replaces the built-in HTTP/1.1 transport (and the address
    and header arguments, which it carries itself): anything with its
    ``request``/``stream``/``aclose`` (``sandman._transport.AsyncTransport``),
    e.g. a recording one in a test, or httpx's through ``HttpxTransport``.
    """

    def __init__(
        self,
        *,
        uds: str | None = None,
        host: str | None = None,
        port: int | None = None,
        token: str | None = None,
        request_timeout: float = 60.0,
        base_path: str = "",
        headers: Mapping[str, str] | None = None,
        ssl: SSLContext | None = None,
        peer_pid: int | None = None,
        transport: AsyncTransport | None = None,
    ) -> None:
        self._request_timeout = request_timeout
        # Behind a gateway (``base_path``, e.g. the service's proxy route), the
        # gateway's own "cannot reach it" answers mean what a failed connect means.
        self._gateway = bool(base_path)
        self._dialer: Dialer | None = None
        self._exposed: list[ExposedPort] = []
        self._closed = False
        if transport is not None:
            given = (uds, host, port, token, headers, ssl, peer_pid)
            if base_path or any(arg is not None for arg in given):
                raise errors.ConfigError(
                    "DaemonClient takes either transport= or an address, not both: "
                    "the transport carries its own address and headers"
                )
            self._transport: AsyncTransport = transport
            self._address = repr(transport)
            return
        if (uds is None) == (host is None or port is None):
            raise errors.ConfigError("DaemonClient needs either uds=, or host= and port=")
        fixed = {"Authorization": f"Bearer {token}"} if token is not None else {}
        fixed.update(headers or {})
        self._transport = HTTPTransport(
            uds=uds,
            host=host,
            port=port,
            default_headers=fixed,
            prefix=base_path,
            ssl=ssl,
            peer_pid=peer_pid,
        )
        self._address = f"unix:{uds}" if uds is not None else f"tcp:{host}:{port}"
        self._address += base_path.rstrip("/")
        # Ports connect on connections of their own (an upgrade, or the gateway's duplex form).
        self._dialer = Dialer(
            uds=uds,
            host=host,
            port=port,
            headers=fixed,
            prefix=base_path,
            ssl=ssl,
            peer_pid=peer_pid,
            duplex=self._gateway,
        )

    def _error(self, status: int, body: bytes) -> errors.DaemonError:
        exc = protocol.error_from_response(status, body)
        if self._gateway and exc.code in _GATEWAY_CODES:
            return errors.DaemonUnavailable(exc.message, code=exc.code, status=status)
        return exc

    def __repr__(self) -> str:
        return f"DaemonClient({self._address!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close idle connections and every exposed port; the client cannot be used afterwards."""
        self._closed = True
        exposed, self._exposed = self._exposed, []
        for port in exposed:
            await port.aclose()
        await self._transport.aclose()

    # -- plumbing -----------------------------------------------------------

    async def _call(
        self,
        method: str,
        target: str,
        payload: Mapping[str, Any] | None = None,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
        deadline: float | None | Literal["default"] = "default",
        timeout_error: type[errors.SandboxTimeout] = errors.SandboxTimeout,
    ) -> Response:
        if payload is not None:
            # pydantic-core's encoder: straight to UTF-8 bytes, ~8x json.dumps.
            body, content_type = to_json(payload), _JSON
        seconds = self._request_timeout if deadline == "default" else deadline
        scope: asyncio.Timeout | None = None
        try:
            if seconds is None:
                # No deadline (a command without a timeout): no timeout scope
                # to set up and tear down, a measurable share of a no-op exec.
                response = await self._transport.request(
                    method, target, body=body, content_type=content_type
                )
            else:
                async with asyncio.timeout(seconds) as scope:
                    response = await self._transport.request(
                        method, target, body=body, content_type=content_type
                    )
        except (ConnectionLost, OSError) as exc:
            # Our deadline (TimeoutError, itself an OSError) is not the
            # daemon being unreachable: only the scope knows which it was.
            if scope is not None and scope.expired():
                raise timeout_error(
                    f"sandmand at {self._address} did not answer {method} {target} "
                    f"within {seconds} s"
                ) from exc
            raise _unavailable(self._address, exc) from exc
        if response.status >= 400:
            raise self._error(response.status, response.body)
        return response

    async def _json(
        self,
        method: str,
        target: str,
        payload: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        response = await self._call(method, target, payload, **kwargs)
        return json.loads(response.body)

    async def _model(
        self,
        model: type[_M],
        method: str,
        target: str,
        payload: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> _M:
        # Parsing and validating in one step (pydantic-core's JSON parser)
        # costs a third of json.loads followed by model_validate.
        response = await self._call(method, target, payload, **kwargs)
        return model.model_validate_json(response.body)

    @staticmethod
    def _command_deadline(timeout: float | None, kill_grace: float | None) -> float | None:
        if timeout is None:
            return None
        grace = _DEFAULT_KILL_GRACE if kill_grace is None else kill_grace
        return timeout + grace + _DEADLINE_SLACK

    # -- health -------------------------------------------------------------

    async def health(self) -> Health:
        """The daemon's readiness answer. Raises ProtocolVersionError on another protocol."""
        health = await self._model(Health, "GET", "/v1/health")
        if health.protocol != protocol.PROTOCOL_VERSION:
            raise errors.ProtocolVersionError(
                f"sandmand speaks {health.protocol}, this client {protocol.PROTOCOL_VERSION}"
            )
        return health

    async def wait_ready(self, timeout: float) -> Health:
        """Poll health until the daemon answers; CreateTimeout after ``timeout`` seconds.

        A daemon that is still starting (no socket yet, connection refused)
        is retried with a short, growing pause; any other error is raised.
        """
        delay = 0.0005
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        return await self.health()
                    except errors.DaemonUnavailable:
                        await asyncio.sleep(delay)
                        delay = min(delay * 1.5, 0.02)
        except TimeoutError:
            raise errors.CreateTimeout(
                f"sandmand at {self._address} not ready within {timeout} s"
            ) from None

    # -- commands -----------------------------------------------------------

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        check: bool = False,
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """Run a command to completion: a string runs in ``shell -c``, a sequence as argv.

        Its options (`ExecOptions`, all keywords, each absent by default):

        - ``cwd``: the working directory (the daemon's by default).
        - ``env``: variables added to the image's environment.
        - ``stdin``: text or bytes (any bytes: they travel as base64), then
          end-of-file; without it the command reads ``/dev/null``.
        - ``timeout``: seconds it may run (None: no limit); then its process group
          gets SIGTERM, and SIGKILL ``kill_grace`` seconds later.
        - ``kill_grace``: those seconds (the daemon's, 2 by default).
        - ``max_output``: bytes kept per stream (1 MiB by default); the rest is
          dropped and ``truncated`` is true.
        - ``shell``: the shell a command string runs in (``/bin/sh``); not for an argv.
        - ``encoding``: ``"utf-8"`` (the default) or ``"base64"``, which keeps the
          output's bytes exact.
        - ``user``: run it as that user: a name or uid, optionally ``:group``,
          looked up in the sandbox's ``/etc/passwd`` and ``/etc/group``
          (UnknownUser if missing; its groups and ``HOME`` come along).
        - ``merge_stderr``: ``True`` gives the command one pipe for both outputs:
          ``stdout`` holds them interleaved as written, ``stderr`` is empty.

        A non-zero exit code is data (``result.exit_code``); ``check=True``
        raises CommandFailed for it, and ExecTimeout if the command timed out.
        Cancelling the call (a timeout around it, a cancelled task) kills the
        command's process group.
        """
        result = await self._model(
            ExecResult,
            "POST",
            "/v1/exec",
            protocol.exec_fields(command, options),
            deadline=self._command_deadline(options.get("timeout"), options.get("kill_grace")),
            timeout_error=errors.ExecTimeout,
        )
        if check:
            _check(command, result.exit_code, result.timed_out, result.stdout, result.stderr)
        return result

    @asynccontextmanager
    async def exec_stream(
        self, command: str | Sequence[str], **options: Unpack[ExecOptions]
    ) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """Run a command and read its output as it happens.

        ``async with client.exec_stream("make") as events: async for ev in events: ...``
        The last event is ``exit``. Leaving the block early kills the command.
        The options are `exec`'s (`ExecOptions`); with ``merge_stderr=True`` every
        output event is ``stdout``.
        """
        body = to_json(protocol.exec_fields(command, options))
        with _map_transport_errors(self._address):
            async with self._transport.stream(
                "POST", "/v1/exec/stream", body=body, content_type=_JSON
            ) as response:
                if response.status >= 400:
                    raise self._error(response.status, await response.read())

                async def events() -> AsyncIterator[ExecEvent]:
                    async for line in iter_lines(response):
                        if line:
                            yield ExecEvent.model_validate_json(line)

                yield events()

    # -- background processes -------------------------------------------------

    async def spawn(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bool = False,
        max_buffer: int | None = None,
        shell: str | None = None,
        tty: bool = False,
        rows: int | None = None,
        cols: int | None = None,
        user: str | int | None = None,
        merge_stderr: bool = False,
    ) -> ProcessInfo:
        """Start a command in the background; it outlives this call (see `poll`,
        `read_output`, `wait`).

        ``stdin=True`` keeps a pipe open for `write_stdin`. ``tty=True`` runs
        it on a pseudo-terminal of ``rows`` x ``cols`` (default 24 x 80; see
        `resize`): its output, echo included, is all stdout, and stdin is
        always open. ``max_buffer`` bounds the output kept for `read_output`.
        ``user`` and ``merge_stderr`` are as for `exec`.
        """
        payload = protocol.command_fields(
            command, shell=shell, cwd=cwd, env=env, user=user, merge_stderr=merge_stderr
        )
        if stdin:
            payload["stdin"] = True
        if max_buffer is not None:
            payload["max_buffer"] = max_buffer
        payload.update(protocol.tty_fields(tty=tty, rows=rows, cols=cols))
        return await self._model(ProcessInfo, "POST", "/v1/processes", payload)

    async def resize(self, process_id: str, *, rows: int, cols: int) -> None:
        """Set the size of a ``tty`` process's terminal (it gets SIGWINCH)."""
        payload = {"rows": rows, "cols": cols}
        await self._call("POST", _process(process_id, "resize"), payload)

    async def list_processes(self) -> list[ProcessInfo]:
        """Every background process the daemon knows, running or exited."""
        data = await self._json("GET", "/v1/processes")
        return [ProcessInfo.model_validate(item) for item in data["processes"]]

    async def poll(self, process_id: str) -> ProcessInfo:
        """The process's state now (running, exit code)."""
        return await self._model(ProcessInfo, "GET", _process(process_id))

    async def read_output(
        self,
        process_id: str,
        *,
        stdout_offset: int = 0,
        stderr_offset: int = 0,
        wait: float | None = None,
        encoding: Encoding = "utf-8",
    ) -> ProcessOutput:
        """Output of a background process from the given offsets.

        ``wait`` (seconds) long-polls until there is new output or the process
        exits. ``encoding="base64"`` keeps the bytes exact (``stdout`` is then base64).
        """
        target = protocol.target(
            _process(process_id, "output"),
            stdout_offset=stdout_offset,
            stderr_offset=stderr_offset,
            wait=wait,
            encoding=None if encoding == "utf-8" else encoding,
        )
        deadline = self._request_timeout + (wait or 0.0)
        return await self._model(ProcessOutput, "GET", target, deadline=deadline)

    async def write_stdin(self, process_id: str, data: bytes | str, *, close: bool = False) -> None:
        """Write to a background process's stdin; ``close=True`` closes it afterwards."""
        body = data.encode() if isinstance(data, str) else data
        target = protocol.target(_process(process_id, "stdin"), close=close or None)
        await self._call("POST", target, body=body, content_type="application/octet-stream")

    async def signal(
        self, process_id: str, signal: str | int = "TERM", *, group: bool = True
    ) -> ProcessInfo:
        """Send a signal (``"TERM"``, ``"KILL"``, ... or a number) to the process or its group."""
        payload = {"signal": signal, "group": group}
        return await self._model(ProcessInfo, "POST", _process(process_id, "signal"), payload)

    async def wait(self, process_id: str, *, timeout: float | None = None) -> ProcessInfo:
        """Wait for the process to exit; ``running`` is still true if ``timeout`` passed first."""
        deadline = None if timeout is None else timeout + self._request_timeout
        return await self._model(
            ProcessInfo,
            "POST",
            _process(process_id, "wait"),
            {"timeout": timeout},
            deadline=deadline,
        )

    async def kill(self, process_id: str) -> None:
        """Kill the process's group if it runs, and forget it."""
        await self._call("DELETE", _process(process_id))

    # -- shells -----------------------------------------------------------------
    # Persistent shells, called sessions until the name was left to the client's
    # lease session; the old names stay as aliases below.

    async def create_shell(
        self,
        *,
        shell: str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | int | None = None,
    ) -> ShellInfo:
        """Start a persistent shell (bash if the image has it, else sh): ``cd``,
        exports and functions persist between `run_in_shell` calls.

        ``user`` runs the shell, and so every command in it, as that user (as
        for `exec`)."""
        payload: dict[str, Any] = {}
        if shell is not None:
            payload["shell"] = shell
        if cwd is not None:
            payload["cwd"] = cwd
        if env:
            payload["env"] = dict(env)
        payload.update(protocol.user_fields(user))
        return await self._model(ShellInfo, "POST", "/v1/shells", payload)

    async def list_shells(self) -> list[ShellInfo]:
        """Every shell, alive or not."""
        data = await self._json("GET", "/v1/shells")
        return [ShellInfo.model_validate(item) for item in data["shells"]]

    async def get_shell(self, shell_id: str) -> ShellInfo:
        """One shell's state (``alive``)."""
        return await self._model(ShellInfo, "GET", _shell(shell_id))

    async def run_in_shell(
        self,
        shell_id: str,
        command: str,
        *,
        timeout: float | None = None,
        max_output: int | None = None,
        encoding: Encoding = "utf-8",
        merge_stderr: bool = False,
        on_timeout: OnTimeout = "kill",
        kill_grace: float | None = None,
        check: bool = False,
    ) -> ShellRunResult:
        """Run a command in the shell; ``cd`` and ``export`` persist.

        ``merge_stderr=True`` runs it with ``2>&1``: ``stdout`` holds both
        outputs interleaved, ``stderr`` is empty. On timeout (and if the call
        is cancelled) the shell is killed by default (``alive`` is false
        afterwards). ``on_timeout="interrupt"`` sends SIGINT instead, as
        Ctrl-C: the rest of the command line is skipped and the shell lives
        on with its state (``timed_out`` and ``alive`` true, exit code 130);
        only if the command line is still running ``kill_grace`` seconds
        later (default 2) is the shell killed.
        """
        payload: dict[str, Any] = {"cmd": command}
        payload.update(
            protocol.output_fields(max_output=max_output, encoding=encoding, timeout=timeout)
        )
        if merge_stderr:
            payload["merge_stderr"] = True
        if on_timeout != "kill":
            payload["on_timeout"] = on_timeout
        if kill_grace is not None:
            payload["kill_grace"] = kill_grace
        result = await self._model(
            ShellRunResult,
            "POST",
            _shell(shell_id, "run"),
            payload,
            deadline=self._command_deadline(timeout, kill_grace),
            timeout_error=errors.ExecTimeout,
        )
        if check:
            _check(command, result.exit_code, result.timed_out, result.stdout, result.stderr)
        return result

    async def close_shell(self, shell_id: str) -> None:
        """Kill the shell and everything it started."""
        await self._call("DELETE", _shell(shell_id))

    # Deprecated: the shells' old names (CHANGELOG), the same calls.
    create_session = create_shell
    list_sessions = list_shells
    get_session = get_shell
    run_in_session = run_in_shell
    close_session = close_shell

    # -- files ----------------------------------------------------------------

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The whole file's bytes, at most ``max_bytes`` of them (FileTooLarge past it).

        The daemon refuses a larger file before sending it, and a device,
        fifo or socket with NotARegularFile; what a daemon sends past the
        limit anyway is never buffered. For larger files use
        `read_file_stream` or `download_file`.
        """
        pieces: list[bytes] = []
        try:
            async with (
                asyncio.timeout(self._request_timeout),
                self.read_file_stream(path, max_bytes=max_bytes) as chunks,
            ):
                async for piece in chunks:
                    pieces.append(piece)  # noqa: PERF401 - an async comprehension costs a coroutine more
        except TimeoutError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            raise errors.SandboxTimeout(
                f"sandmand at {self._address} did not send {path} within {self._request_timeout} s"
            ) from exc
        return b"".join(pieces)

    @asynccontextmanager
    async def read_file_stream(
        self, path: str, *, max_bytes: int | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Read a file as it arrives: ``async with c.read_file_stream(p) as chunks: async for b in chunks``.

        Memory stays bounded whatever the file's size. ``max_bytes`` (None:
        no limit) raises FileTooLarge once more arrived, and drops the
        connection so the daemon stops sending.
        """
        _check_limit(max_bytes, "max_bytes")
        target = protocol.target("/v1/files", path=path, max_bytes=max_bytes)
        with _map_transport_errors(self._address):
            async with self._transport.stream("GET", target) as response:
                if response.status >= 400:
                    raise self._error(response.status, await _read_capped(response, _MAX_ERROR))
                yield _capped(response.iter_bytes(), max_bytes, f"{path} is larger than")

    async def download_file(
        self,
        path: str,
        local: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_UNPACKED,
        mode: int | None = None,
    ) -> int:
        """Copy file ``path`` to ``local`` as it arrives (no more than ``max_bytes``).

        Written to a temporary file beside ``local`` and renamed over it, so
        ``local`` is whole or untouched; ``mode`` (without setuid, setgid and
        sticky bits) is applied to it. Returns the bytes written.
        """
        target = Path(local)
        fd, temp = await asyncio.to_thread(
            tempfile.mkstemp, dir=target.parent, prefix=f".{target.name}.sandman-"
        )
        written = 0
        try:
            async with self.read_file_stream(path, max_bytes=max_bytes) as chunks:
                batch: list[bytes] = []
                size = 0
                async for piece in chunks:
                    batch.append(piece)
                    size += len(piece)
                    if size >= _BATCH:
                        written += await asyncio.to_thread(_write_all, fd, b"".join(batch))
                        batch, size = [], 0
                if batch:
                    written += await asyncio.to_thread(_write_all, fd, b"".join(batch))
            if mode is not None:
                os.fchmod(fd, mode & 0o777)
            os.close(fd)
            fd = -1
            await asyncio.to_thread(os.replace, temp, target)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        return written

    async def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int | None = None,
        parents: bool = True,
    ) -> FileStat:
        """Write a whole file atomically (readers see the old or the new content)."""
        body = data.encode() if isinstance(data, str) else data
        target = protocol.target(
            "/v1/files",
            path=path,
            mode=None if mode is None else format(mode, "o"),
            parents=None if parents else False,
        )
        response = await self._call(
            "PUT", target, body=body, content_type="application/octet-stream"
        )
        return FileStat.model_validate_json(response.body)

    async def stat(self, path: str) -> FileStat:
        """Stat ``path`` without following a final symlink."""
        return await self._model(FileStat, "GET", protocol.target("/v1/files/stat", path=path))

    async def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (a dangling symlink counts)."""
        try:
            await self.stat(path)
        except errors.PathNotFound:
            return False
        return True

    async def list_dir(self, path: str) -> list[FileStat]:
        """A directory's entries, sorted by name."""
        data = await self._json("GET", protocol.target("/v1/files/list", path=path))
        return [FileStat.model_validate(item) for item in data["entries"]]

    async def mkdir(self, path: str, *, parents: bool = True, mode: int | None = None) -> FileStat:
        """Make a directory (and its parents, unless ``parents=False``)."""
        payload: dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            payload["mode"] = format(mode, "o")
        return await self._model(FileStat, "POST", "/v1/files/mkdir", payload)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (``recursive`` for a non-empty one)."""
        await self._call(
            "DELETE", protocol.target("/v1/files", path=path, recursive=recursive or None)
        )

    async def move(self, src: str, dst: str, *, overwrite: bool = False) -> FileStat:
        """Rename ``src`` to ``dst`` (an existing ``dst`` only with ``overwrite``)."""
        payload = {"src": src, "dst": dst, "overwrite": overwrite}
        return await self._model(FileStat, "POST", "/v1/files/move", payload)

    # -- archives ---------------------------------------------------------------

    async def upload_archive(self, path: str, tar: bytes | AsyncIterable[bytes]) -> ArchiveResult:
        """Unpack a tar stream (gzip or not) under directory ``path``.

        Entries that would land outside ``path`` make the whole upload fail
        with UnsafeArchive, and nothing of it is kept.
        """
        target = protocol.target("/v1/archive", path=path)
        with _map_transport_errors(self._address):
            async with self._transport.stream(
                "PUT", target, body=tar, content_type="application/x-tar"
            ) as response:
                body = await response.read()
        if response.status >= 400:
            raise self._error(response.status, body)
        return ArchiveResult.model_validate_json(body)

    async def download_archive(
        self, path: str, *, gzip: bool = False, max_bytes: int = DEFAULT_MAX_READ
    ) -> bytes:
        """A tar of ``path`` in memory: a directory's contents, or one file under its base name.

        At most ``max_bytes`` of it (FileTooLarge past that, nothing more
        buffered); `download_tree` unpacks a tree of any size as it arrives.
        """
        _check_limit(max_bytes, "max_bytes")
        target = protocol.target("/v1/archive", path=path, gzip=gzip or None)
        with _map_transport_errors(self._address):
            async with self._transport.stream("GET", target) as response:
                if response.status >= 400:
                    raise self._error(response.status, await _read_capped(response, _MAX_ERROR))
                what = f"the archive of {path} is larger than"
                pieces = [piece async for piece in _capped(response.iter_bytes(), max_bytes, what)]
        return b"".join(pieces)

    async def download_tree(
        self,
        path: str,
        local: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_UNPACKED,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> ArchiveResult:
        """Unpack the tree at ``path`` under local directory ``local``, as it arrives.

        The stream is the sandbox's to shape, so it is unpacked by
        `sandman.daemon.untar` (never by `tarfile`): nothing lands outside
        ``local`` nor is written through a symlink, devices and hostile
        entries are refused with UnsafeArchive, and more than ``max_bytes``
        of files or ``max_entries`` entries with FileTooLarge. On any error
        what this call created is removed again.
        """
        target = protocol.target("/v1/archive", path=path)
        extractor = await asyncio.to_thread(
            TarExtractor,
            local,
            max_bytes=max_bytes,
            max_entries=max_entries,
            source=f"the archive of {path}",
        )
        try:
            with _map_transport_errors(self._address):
                async with self._transport.stream("GET", target) as response:
                    if response.status >= 400:
                        body = await _read_capped(response, _MAX_ERROR)
                        raise self._error(response.status, body)
                    batch: list[bytes] = []
                    size = 0
                    async for piece in response.iter_bytes():
                        batch.append(piece)
                        size += len(piece)
                        if size >= _BATCH:
                            await asyncio.to_thread(extractor.feed, b"".join(batch))
                            batch, size = [], 0
                            if extractor.done:
                                break  # what follows the end marker is not read
                    if batch:
                        await asyncio.to_thread(extractor.feed, b"".join(batch))
            result = await asyncio.to_thread(extractor.close)
        except BaseException:
            extractor.abort()
            raise
        return ArchiveResult(path=str(local), files=result.entries, bytes=result.bytes)

    async def upload(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a local file or directory tree into the sandbox at ``remote``."""
        source = Path(local)
        if await asyncio.to_thread(source.is_file):
            data, mode = await asyncio.to_thread(_read_local_file, source)
            await self.write_file(remote, data, mode=mode)
            return
        await self.upload_archive(remote, await asyncio.to_thread(_tar_directory, source))

    # -- ports ----------------------------------------------------------------

    async def expose(
        self,
        port: int,
        *,
        local_host: str = "127.0.0.1",
        local_port: int = 0,
        half_close_timeout: float | None = 30.0,
    ) -> ExposedPort:
        """Reach the TCP server on ``port`` inside the sandbox at a local address.

        Listens on ``local_host:local_port`` (a free port by default) and
        returns at once; ``.url`` is ``http://127.0.0.1:NNNN``, ``.host`` and
        ``.port`` its parts. Every connection made there is carried through
        the daemon to ``port`` on the sandbox's loopback (127.0.0.1, else ::1),
        bytes both ways: a web app, an environment server, any TCP service,
        whether the sandbox has a network or not, and through the service.
        Nothing need listen yet: a connection made while nothing does is
        closed at once (``last_failure`` says why), so poll the URL until it
        answers. Close it with ``aclose`` (``close`` from another thread), or
        use it as a context manager; it is closed with the sandbox. Whoever
        can connect to the local address reaches the port: keep the loopback
        default unless that is meant.

        The sandbox is not trusted with this side's resources: a connection
        whose local side has ended (closed, or half-closed to wait for the
        answer: TCP does not tell them apart) is closed once the port has sent
        nothing for ``half_close_timeout`` seconds (None: never), so a port
        that accepts and stalls cannot keep every connection ever made to it.
        """
        if isinstance(port, bool) or not 1 <= port <= 65535:
            raise errors.ConfigError(f"port must be in 1..65535, got {port!r}")
        if half_close_timeout is not None and not half_close_timeout > 0:
            raise errors.ConfigError(f"half_close_timeout must be > 0, got {half_close_timeout!r}")
        if self._closed:
            raise errors.DaemonUnavailable(f"the client of {self._address} is closed")
        if self._dialer is None:
            raise errors.ConfigError(
                "expose needs the daemon's address: a client made with transport= has none"
            )
        try:
            exposed = await ExposedPort.start(
                self._dialer,
                port,
                host=local_host,
                port=local_port,
                half_close_timeout=half_close_timeout,
            )
        except OSError as exc:
            raise errors.ConfigError(f"cannot listen on {local_host}:{local_port}: {exc}") from exc
        self._exposed = [p for p in self._exposed if not p.closed]
        self._exposed.append(exposed)
        return exposed

    async def download(
        self,
        remote: str,
        local: str | os.PathLike[str],
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
        if (await self.stat(remote)).type != "directory":
            await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
            await self.download_file(remote, target, max_bytes=max_bytes)
            return
        await self.download_tree(remote, target, max_bytes=max_bytes, max_entries=max_entries)


def _read_local_file(source: Path) -> tuple[bytes, int]:
    return source.read_bytes(), source.stat().st_mode & 0o7777


def _tar_directory(source: Path) -> bytes:
    if not source.is_dir():
        raise errors.ConfigError(f"nothing to upload at {source}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for child in sorted(source.iterdir()):
            tar.add(child, arcname=child.name)
    return buffer.getvalue()


def _check_limit(value: int | None, name: str) -> None:
    if value is not None and value < 0:
        raise errors.ConfigError(f"{name} must not be negative, got {value}")


async def _capped(
    pieces: AsyncIterator[bytes], limit: int | None, what: str
) -> AsyncIterator[bytes]:
    """Pass ``pieces`` on; FileTooLarge as soon as more than ``limit`` bytes came."""
    total = 0
    async for piece in pieces:
        total += len(piece)
        if limit is not None and total > limit:
            raise errors.FileTooLarge(
                f"{what} max_bytes={limit} (stopped reading at {total} bytes)"
            )
        yield piece


async def _read_capped(response: ResponseStream, limit: int) -> bytes:
    """An error body, of which no more than ``limit`` bytes are kept."""
    pieces: list[bytes] = []
    size = 0
    async for piece in response.iter_bytes():
        if size < limit:
            pieces.append(piece[: limit - size])
            size += len(pieces[-1])
    return b"".join(pieces)


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def _process(process_id: str, action: str | None = None) -> str:
    base = f"/v1/processes/{protocol.quote_segment(process_id)}"
    return f"{base}/{action}" if action else base


def _shell(shell_id: str, action: str | None = None) -> str:
    base = f"/v1/shells/{protocol.quote_segment(shell_id)}"
    return f"{base}/{action}" if action else base


def _check(
    command: str | Sequence[str], exit_code: int, timed_out: bool, stdout: str, stderr: str
) -> None:
    shown = command if isinstance(command, str) else " ".join(command)
    if timed_out:
        raise errors.ExecTimeout(f"command timed out: {shown!r}")
    if exit_code != 0:
        raise errors.CommandFailed(
            f"command exited {exit_code}: {shown!r}: {(stderr or stdout)[-500:]}",
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
        )
