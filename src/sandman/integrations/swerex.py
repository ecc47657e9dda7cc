"""SWE-ReX (and so SWE-agent) on Sandman: a deployment whose runtime is a Sandman sandbox.

SWE-ReX's ``DeploymentConfig`` is a closed union, so the route is programmatic::

    from sandman.integrations.swerex import SandmanDeployment
    from sweagent.environment.swe_env import SWEEnv

    env = SWEEnv(deployment=SandmanDeployment(image="python:3.11"), repo=None,
                 post_startup_commands=[])

No process runs inside the sandbox but Sandman's daemon: the runtime's calls go to
it directly. Bash sessions keep SWE-ReX's semantics on the daemon's shells
(``AsyncSandbox.create_shell``): each command is syntax-checked first
(``BashIncorrectSyntaxError``), stdout and stderr come back merged, a command that
times out is interrupted (SIGINT, as Ctrl-C) and raises ``CommandTimeoutError``
while the session lives on with its state, and ``BashInterruptAction`` then finds
the shell at its prompt.

SWE-agent runs every runtime call in its own ``asyncio.run``: the sandbox lives
on the process-wide client's own loop (``_client.shared_client``), so it
outlives each of them. `SandmanDeployment.stop` releases it; if the process
dies first, the embedded pool's watchdog (or the service's lease) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import shlex
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, ParamSpec, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    CloseBashSessionResponse,
    CloseResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from sandman.client import AsyncSandbox
from sandman.errors import ExecTimeout, SandboxError
from sandman.integrations._client import BackgroundClient, shared_client

__all__ = [
    "SandmanDeployment",
    "SandmanDeploymentConfig",
    "SandmanRuntime",
    "SandmanRuntimeError",
]

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_MAX_OUTPUT = 16 * 2**20
"""Bytes of a command's output kept by default (SWE-agent elides long observations itself)."""


class SandmanRuntimeError(SwerexException, RuntimeError):
    """Sandman failed under a runtime call (the sandbox is gone, its daemon unreachable...);
    the Sandman error is its ``__cause__``. A ``SwerexException``, so that SWE-agent ends the
    run as an environment error."""


class SandmanDeploymentConfig(BaseModel):
    """A `SandmanDeployment`'s settings: the sandbox (`sandman.SandboxSpec`'s fields) and
    where it comes from. No secret goes here: the service's key comes from
    ``SANDMAN_API_KEY`` only."""

    model_config = ConfigDict(extra="forbid")

    image: str
    """The task image (a Sandman image reference)."""
    cpu: float = 1.0
    memory: str | int = "2Gi"
    network: Literal["none", "isolated", "egress"] = "none"
    spec: dict[str, Any] = {}
    """Other `sandman.SandboxSpec` fields (``pids``, ``disk``, ``user``, ``workdir``, ``env``...).
    SWE-agent keeps its tools in ``/root``: the sandbox's user must be able to write there."""
    shell: str | None = None
    """The sessions' shell; None: ``/bin/bash`` if the image has it, else ``/bin/sh``."""
    max_output: int = Field(default=DEFAULT_MAX_OUTPUT, ge=1)
    """Bytes of each command's output kept; past it the rest is dropped, and said so."""
    url: str | None = None
    """A Sandman service; None: ``SANDMAN_URL`` if set, else the embedded local pool."""
    acquire_timeout: float | None = None
    """Seconds to wait for a sandbox (then ``DeploymentStartupError``); None: as long as it takes."""

    type: Literal["sandman"] = "sandman"
    """Discriminator, as SWE-ReX's own deployment configs have one. Do not change."""

    def get_deployment(self) -> SandmanDeployment:
        return SandmanDeployment.from_config(self)


class SandmanDeployment(AbstractDeployment):
    """A SWE-ReX deployment: `start` acquires a sandbox, `stop` releases it."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = SandmanDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger(__name__)
        self._hooks = CombinedDeploymentHook()
        self._runtime: SandmanRuntime | None = None

    @classmethod
    def from_config(cls, config: SandmanDeploymentConfig) -> Self:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> SandmanRuntime:
        """The sandbox's runtime. Raises ``DeploymentNotStartedError`` before `start`."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Acquire the sandbox; ``DeploymentStartupError`` if none comes (the Sandman error
        as its cause: ``CreateTimeout``, ``ImageNotFound``, ``CapacityError``...)."""
        if self._runtime is not None:
            return
        config = self._config
        self._hooks.on_custom_step("Acquiring sandbox")
        client = shared_client(config.url)
        spec = {
            "cpu": config.cpu, "memory": config.memory, "network": config.network, **config.spec,
        }  # fmt: skip
        try:
            sandbox = await client.run(
                client.client.acquire, config.image, timeout=config.acquire_timeout, **spec
            )
        except SandboxError as exc:
            raise DeploymentStartupError(f"no sandbox for {config.image}: {exc}") from exc
        self.logger.info("acquired sandbox %s (%s)", sandbox.id, config.image)
        self._runtime = SandmanRuntime(
            sandbox=sandbox, client=client, shell=config.shell, max_output=config.max_output,
            logger=self.logger,
        )  # fmt: skip

    async def stop(self) -> None:
        """Close the runtime's sessions and release the sandbox. Idempotent."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await runtime.release()

    def __del__(self) -> None:
        # SWE-ReX's base stops through the current event loop; ours lives elsewhere.
        # A backstop only: `stop` is the way, the client's close and the watchdog the net.
        runtime = getattr(self, "_runtime", None)
        if runtime is not None:
            self._runtime = None
            runtime.release_soon()


@dataclass
class _Program:
    """An interactive program of a session: a process on a terminal of its own."""

    id: str
    offset: int = 0  # of its output read so far
    pending: str = ""  # read, not yet consumed by an expect
    dropped: bool = False  # pending lost its head (a bounded buffer)
    ended: bool = False


@dataclass
class _Session:
    id: str  # of the daemon's shell that holds it
    shell: str
    request: CreateBashSessionRequest
    alive: bool = True
    program: _Program | None = None


# What SWE-ReX strips from a terminal's output (its _strip_control_chars).
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")


class SandmanRuntime(AbstractRuntime):
    """SWE-ReX's runtime API on one Sandman sandbox. Made by `SandmanDeployment.start`."""

    def __init__(
        self,
        *,
        sandbox: AsyncSandbox,
        client: BackgroundClient,
        shell: str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        logger: logging.Logger | None = None,
    ) -> None:
        self._sandbox = sandbox
        self._client = client
        self._shell = shell
        self._max_output = max_output
        self._sessions: dict[str, _Session] = {}
        self.logger = logger or logging.getLogger(__name__)

    @property
    def sandbox_id(self) -> str:
        return self._sandbox.id

    async def _call(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        with _translated():
            return await self._client.run(fn, *args, **kwargs)

    # -- liveness --------------------------------------------------------------------------

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            await self._client.run(_health, self._sandbox, timeout)
        except (SandboxError, TimeoutError) as exc:
            return IsAliveResponse(is_alive=False, message=f"{type(exc).__name__}: {exc}")
        return IsAliveResponse(is_alive=True)

    # -- bash sessions ---------------------------------------------------------------------

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        """Start a shell and source ``startup_source`` in it (a missing file is reported, not fatal)."""
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        output = await self._start_session(request)
        return CreateBashSessionResponse(output=output)

    async def _start_session(self, request: CreateBashSessionRequest) -> str:
        """Start the session's shell, register it (also if sourcing then times out, as
        SWE-ReX does), source the startup files; their output."""
        info = await self._call(self._sandbox.create_shell, shell=self._shell)
        session = self._sessions[request.session] = _Session(info.id, info.shell, request)
        if not request.startup_source:
            return ""
        sources = "\n".join(
            f"if [ -r {shlex.quote(p)} ]; then . {shlex.quote(p)}; "
            f"else echo {shlex.quote(f'{p}: No such file or directory')} >&2; fi"
            for p in request.startup_source
        )
        result = await self._call(
            self._sandbox.run_in_shell, session.id, sources, timeout=request.startup_timeout,
            merge_stderr=True, on_timeout="interrupt", max_output=self._max_output,
        )  # fmt: skip
        session.alive = result.alive
        if result.timed_out:
            raise CommandTimeoutError(
                f"timeout after {request.startup_timeout} seconds while sourcing "
                f"{request.startup_source}"
            )
        return result.stdout

    def _session(self, name: str) -> _Session:
        session = self._sessions.get(name)
        if session is None:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return session

    async def _revive(self, name: str) -> _Session:
        """The session, started again (its state lost) if its shell has exited."""
        session = self._session(name)
        if session.alive:
            return session
        self.logger.warning("session %r had ended; starting it again", name)
        with contextlib.suppress(SandmanRuntimeError):
            await self._call(self._sandbox.close_shell, session.id)
        await self._start_session(session.request)
        return self._sessions[name]

    async def run_in_session(self, action: BashAction | BashInterruptAction) -> BashObservation:
        """Run a command in a session, or interrupt it.

        A command is syntax-checked first (``BashIncorrectSyntaxError``, nothing
        run), then run with stderr merged; on timeout it is interrupted and
        ``CommandTimeoutError`` raised, the session keeping its state. The exit
        code is None with ``check="ignore"``, and ``NonZeroExitCodeError`` is
        raised for a non-zero one with ``check="raise"``.

        An interactive program (``is_interactive_command``: gdb, a REPL) runs
        on a terminal of its own, started in the session's directory with its
        exported variables; its output is read up to the first of ``expect``
        (regular expressions, as pexpect takes them) or its end, and the next
        interactive commands are typed into it, ``is_interactive_quit`` the
        last. Unlike SWE-ReX's own runtime, plain commands meanwhile still go
        to the session's shell.
        """
        if isinstance(action, BashInterruptAction):
            session = self._session(action.session)
            program = session.program
            if program is not None:  # Ctrl-C goes to the program; ended, the shell has it
                await self._call(self._sandbox.write_stdin, program.id, "\x03")
                info = await self._call(self._sandbox.wait, program.id, timeout=action.timeout)
                if not info.running:
                    session.program = None
                    with contextlib.suppress(SandmanRuntimeError):
                        await self._call(self._sandbox.kill, program.id)
                return BashObservation(output="", exit_code=0)
            # A run returns only once its command is done or interrupted: the shell is
            # at its prompt, or it has ended and is started again.
            await self._revive(action.session)
            return BashObservation(output="", exit_code=0)
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._interactive(await self._revive(action.session), action)
        session = await self._revive(action.session)
        await self._check_syntax(session, action.command)
        result = await self._call(
            self._sandbox.run_in_shell, session.id, action.command, timeout=action.timeout,
            merge_stderr=True, on_timeout="interrupt", max_output=self._max_output,
        )  # fmt: skip
        session.alive = result.alive
        if result.timed_out:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            )
        output = result.stdout
        if result.truncated:
            output += f"\n[... output past {self._max_output} bytes dropped ...]\n"
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None)
        if action.check == "raise" and result.exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {result.exit_code}. "
                f"Here is the output:\n{output!r}"
            )
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=output, exit_code=result.exit_code)

    async def _interactive(self, session: _Session, action: BashAction) -> BashObservation:
        program = session.program
        if program is None:
            # Started as the session's shell would start it: its directory, its exports.
            where = await self._call(
                self._sandbox.run_in_shell, session.id, "pwd; export -p", timeout=30
            )
            cwd, _, exports = where.stdout.partition("\n")
            script = f"cd -- {shlex.quote(cwd)}\n{exports}\n{action.command}"
            info = await self._call(
                self._sandbox.spawn, [session.shell, "-c", script], tty=True, rows=24, cols=200
            )
            program = session.program = _Program(info.id)
        else:
            await self._call(self._sandbox.write_stdin, program.id, action.command + "\n")
        output, matched = await self._expect(program, action)
        if program.ended:  # back to the shell
            session.program = None
            with contextlib.suppress(SandmanRuntimeError):
                await self._call(self._sandbox.kill, program.id)
        if not action.is_interactive_quit:
            output = output.lstrip().removeprefix(action.command).strip()  # the echo, as SWE-ReX
        return BashObservation(output=output, exit_code=0, expect_string=matched)

    async def _expect(self, program: _Program, action: BashAction) -> tuple[str, str]:
        """The program's output up to the first match of ``action.expect`` (and that
        pattern), or up to its end (and ""); CommandTimeoutError after ``action.timeout``."""
        patterns = [re.compile(p) for p in action.expect]
        deadline = None if action.timeout is None else time.monotonic() + action.timeout
        while True:
            found = [
                (m.start(), m.end(), p.pattern)
                for p in patterns
                if (m := p.search(program.pending))
            ]
            if found:
                start, end, pattern = min(found)
                before, program.pending = program.pending[:start], program.pending[end:]
                return self._seen(program, before), pattern
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CommandTimeoutError(
                    f"timeout after {action.timeout} seconds while running command "
                    f"{action.command!r}"
                )
            wait = min(5.0, left) if left is not None else 5.0
            out = await self._call(
                self._sandbox.read_output, program.id, stdout_offset=program.offset, wait=wait
            )
            program.offset = out.stdout_next_offset
            program.pending += out.stdout
            if len(program.pending) > self._max_output:
                # The sandbox decides how much it prints: keep the tail, where a prompt is.
                program.pending = program.pending[-self._max_output :]
                program.dropped = True
            if not out.running and not out.stdout:
                before, program.pending, program.ended = program.pending, "", True
                return self._seen(program, before), ""

    def _seen(self, program: _Program, before: str) -> str:
        """Output as SWE-ReX gives it (escape sequences gone, CRLF as LF), with a note
        of what the bounded buffer dropped."""
        text = _ANSI.sub("", before).replace("\r\n", "\n")
        if program.dropped:
            program.dropped = False
            text = f"[... output before the last {self._max_output} characters dropped ...]\n{text}"
        return text

    async def _check_syntax(self, session: _Session, command: str) -> None:
        check = await self._call(
            self._sandbox.exec, [session.shell, "-n"], stdin=command + "\n", timeout=30
        )
        if check.exit_code == 0:
            return
        raise BashIncorrectSyntaxError(
            f"Error (exit code {check.exit_code}) while checking bash command \n{command!r}\n"
            f"---- Stderr ----\n{check.stderr}\n---- Stdout ----\n{check.stdout}",
            extra_info={"bash_stdout": check.stdout, "bash_stderr": check.stderr},
        )

    async def close_session(self, request: CloseBashSessionRequest) -> CloseBashSessionResponse:
        """End a session's shell and everything it started."""
        session = self._session(request.session)
        del self._sessions[request.session]
        with contextlib.suppress(SandmanRuntimeError):  # already ended
            if session.program is not None:
                await self._call(self._sandbox.kill, session.program.id)
            await self._call(self._sandbox.close_shell, session.id)
        return CloseBashSessionResponse()

    # -- one-off commands and files -----------------------------------------------------------

    async def execute(self, command: Command) -> CommandResponse:
        """Run a command as ``subprocess.run`` would (``shell=True``: ``/bin/sh -c``), in a
        fresh process. ``env``, as in SWE-ReX's own runtime, replaces the environment (run
        through the image's ``env -i``); None inherits the sandbox's."""
        argv: list[str]
        if command.shell:
            first, *rest = (
                [command.command] if isinstance(command.command, str) else command.command
            )
            argv = ["/bin/sh", "-c", first, *rest]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        if command.env is not None:
            if any("=" in key or not key for key in command.env):
                raise ValueError("illegal environment variable name")  # as subprocess says
            # The daemon adds a request's env to the sandbox's; subprocess.run(env=) replaces it.
            argv = ["env", "-i", *(f"{key}={value}" for key, value in command.env.items()), *argv]
        result = await self._call(
            self._sandbox.exec, argv, cwd=command.cwd, timeout=command.timeout,
            merge_stderr=command.merge_output_streams, max_output=self._max_output,
        )  # fmt: skip
        if result.timed_out:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command"
            )
        response = CommandResponse(
            stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code
        )
        if command.check and result.exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {result.exit_code}. "
                f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """A file's text, as ``Path.read_text(encoding, errors)`` reads it (newlines translated)."""
        data = await self._call(self._sandbox.read_file, request.path)
        text = data.decode(request.encoding or "utf-8", request.errors or "strict")
        return ReadFileResponse(content=io.StringIO(text, newline=None).read())

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Write a file (UTF-8), creating its parent directories."""
        await self._call(self._sandbox.write_file, request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copy a local file to ``target_path``, or a directory's contents into it."""
        if not await asyncio.to_thread(Path(request.source_path).exists):
            raise ValueError(f"Source path {request.source_path} is not a file or directory")
        await self._call(self._sandbox.upload, request.source_path, request.target_path)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Close every session (the sandbox stays; `SandmanDeployment.stop` releases it)."""
        for name in list(self._sessions):
            await self.close_session(CloseBashSessionRequest(session=name))
        return CloseResponse()

    # -- the deployment's ---------------------------------------------------------------------

    async def release(self) -> None:
        """Close the sessions and give the sandbox back."""
        self._sessions.clear()
        with _translated():
            await self._client.run(self._sandbox.release)

    def release_soon(self) -> None:
        """`release` without waiting for it (from a finalizer, any thread)."""
        self._sessions.clear()
        self._client.submit(self._sandbox.release)


async def _health(sandbox: AsyncSandbox, timeout: float | None) -> None:
    async with asyncio.timeout(timeout):
        await sandbox.health()


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Sandman's errors as SWE-ReX's callers expect them: file errors stay what they are
    (``FileNotFoundError``...), a timeout is ``CommandTimeoutError``, the rest
    ``SandmanRuntimeError``."""
    try:
        yield
    except SwerexException:
        raise
    except ExecTimeout as exc:  # the client gave up on the daemon
        raise CommandTimeoutError(str(exc)) from exc
    except OSError:  # FileNotFoundError, PermissionError... (TimeoutError is one too: above)
        raise
    except SandboxError as exc:
        raise SandmanRuntimeError(f"{type(exc).__name__}: {exc}") from exc
