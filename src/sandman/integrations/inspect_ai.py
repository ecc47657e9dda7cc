"""Sandman as an inspect_ai sandbox environment: ``sandman``.

```python
from sandman.integrations.inspect_ai import SandmanSandboxEnvironmentConfig

Task(..., sandbox=("sandman", SandmanSandboxEnvironmentConfig(image="python:3.12")))
```

Each sample gets a sandbox of ``image`` from one pool per process (paced
creation, readiness, cleanup: no `max_sandboxes` to tune), from the service
at ``url`` or ``$SANDMAN_URL`` (key: ``$SANDMAN_API_KEY``, never in the
config, which inspect writes into its logs), else the embedded local pool.
The provider is registered through the ``inspect_ai`` entry-point group
(``sandman = "sandman.integrations.inspect_ai"``), so `inspect view` and
`read_eval_log` find it without an import.

inspect's contract, as kept here: ``exec`` runs argv as given (no shell),
relative paths are the sandbox's working directory's, a timeout raises
`TimeoutError` (the daemon enforces it and kills the command's process
group, so there is nothing to retry), a file that cannot be executed
`PermissionError`, an unknown ``user`` a failed result that names it (as
docker does), a dead sandbox `SandboxUnavailableError`, output past
`SandboxEnvironmentLimits` `OutputLimitExceededError`. Sandman runs images,
it does not build them: a Dockerfile or compose file is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sandman import errors
from sandman.client import AsyncSandbox, RemoteBackend
from sandman.integrations._client import (
    ENV_API_KEY,
    close_loop_clients,
    loop_client,
    resolve_url,
)
from sandman.models import NetworkMode, SandboxSpec

__all__ = ["SandmanSandboxEnvironment", "SandmanSandboxEnvironmentConfig"]

logger = logging.getLogger(__name__)

# stdin up to this size travels in the exec request itself (one round trip);
# larger input goes through a background process's stdin pipe, whose body is
# raw bytes (the daemon bounds a JSON request at 64 MiB).
_INLINE_STDIN = 8 * 2**20


class SandmanSandboxEnvironmentConfig(BaseModel):
    """A sample's sandbox: the image and its limits, and which Sandman to ask.

    Written into eval logs as is, so it holds no secret: the service's API
    key is read from ``$SANDMAN_API_KEY``. Unset fields keep Sandman's
    defaults (1 CPU, 1 GiB, no network, the image's workdir, env and user).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(min_length=1)
    """The task image, as the pool knows it (imported or pulled)."""
    cpu: float | None = None
    """Cores (a hard quota; fractions work)."""
    memory: int | str | None = None
    """Bytes, or ``"2Gi"``."""
    disk: int | str | None = None
    """What the sandbox may write, bytes or ``"10Gi"``."""
    network: NetworkMode | None = None
    """``none`` (loopback only), ``isolated`` or ``egress``."""
    workdir: str | None = None
    """Where commands run and relative paths point; default: the image's."""
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the image's environment for every command."""
    user: str | None = None
    """The user the sandbox runs as (default: the image's). Not root: ``exec(user=...)``
    for another user then raises `SandboxUserUnsupportedError`."""
    url: str | None = None
    """The Sandman service; default ``$SANDMAN_URL``, else an embedded local pool (on
    ``$SANDMAN_STATE_DIR``, default the local provider's)."""
    acquire_timeout: float | None = Field(default=None, gt=0)
    """Seconds to wait for a sandbox before failing the sample (`CreateTimeout`)."""

    def __hash__(self) -> int:  # inspect keys its caches by config; ``env`` is a dict
        return hash(self.model_dump_json())

    @model_validator(mode="after")
    def _valid_spec(self) -> SandmanSandboxEnvironmentConfig:
        self.spec()  # a bad limit fails here, when the task is defined
        return self

    def spec(self) -> SandboxSpec:
        """The `SandboxSpec` this config asks for."""
        fields: dict[str, Any] = {
            name: value
            for name in ("cpu", "memory", "disk", "network", "workdir", "user")
            if (value := getattr(self, name)) is not None
        }
        try:
            return SandboxSpec(image=self.image, env=dict(self.env), **fields)
        except ValidationError as exc:
            raise ValueError(f"invalid sandman sandbox config: {exc}") from None


def _config(config: SandboxEnvironmentConfigType | None) -> SandmanSandboxEnvironmentConfig:
    if config is None:
        raise ValueError(
            'the sandman sandbox needs an image: sandbox=("sandman", '
            'SandmanSandboxEnvironmentConfig(image="..."))'
        )
    if isinstance(config, str):  # a Dockerfile or compose file: a config, refused for what it is
        raise ValueError(  # noqa: TRY004
            f"the sandman sandbox runs prebuilt images, it does not build them: "
            f"{config!r} is not usable (a Dockerfile or compose file needs `docker build` "
            "and a push first); give SandmanSandboxEnvironmentConfig(image=...)"
        )
    if isinstance(config, SandmanSandboxEnvironmentConfig):
        return config
    # another model of the same fields (as read back by a tool that did not know ours)
    return SandmanSandboxEnvironmentConfig.model_validate(config.model_dump())


# Tasks of one eval share this loop's client; the last task to end closes it.
_tasks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


@sandboxenv(name="sandman")
class SandmanSandboxEnvironment(SandboxEnvironment):
    """One sample's Sandman sandbox (``sandbox=("sandman", SandmanSandboxEnvironmentConfig(...))``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        super().__init__()
        self.sandbox = sandbox
        """The Sandman sandbox underneath (shells, spawn, uploads, ...)."""

    # -- lifecycle ----------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SandmanSandboxEnvironmentConfig.model_validate(config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        return None  # the pool paces creation itself: no burst to cap here

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        _config(config)  # fail before any sample starts
        loop = asyncio.get_running_loop()
        _tasks[loop] = _tasks.get(loop, 0) + 1

    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        settings = _config(config)
        client = await loop_client(settings.url)
        sandbox = await client.acquire(settings.spec(), timeout=settings.acquire_timeout)
        logger.debug("sandman: sandbox %s for a sample of %s", sandbox.id, task_name)
        return {"default": cls(sandbox)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for environment in environments.values():
            if not isinstance(environment, SandmanSandboxEnvironment):
                continue
            try:
                await environment.sandbox.release()
            except Exception as exc:  # noqa: BLE001 - cleanup never fails a sample; the pool reaps it
                logger.warning("sandman: releasing sandbox %s: %s", environment.sandbox.id, exc)

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        left = _tasks.get(loop, 1) - 1
        _tasks[loop] = max(left, 0)
        if left > 0:
            return
        if not cleanup:
            logger.info(
                "sandman: sandboxes kept by --no-sandbox-cleanup live until this process "
                "ends (then its pool's watchdog, or the service's session lease, deletes them)"
            )
            return
        await close_loop_clients()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup sandman [ID]``: release a sandbox of the service by id.

        An embedded pool's sandboxes die with their process (its watchdog);
        ``sandman gc`` reaps what a dead one left.
        """
        url = resolve_url()
        if id is None or url is None:
            logger.warning(
                "sandman: nothing to clean up here: sandboxes are released with their "
                "sample, and those of a dead process by its pool's watchdog or the "
                "service's session lease (`sandman gc` for a local state directory)"
            )
            return
        backend = RemoteBackend(url, api_key=os.environ.get(ENV_API_KEY) or None)
        try:
            await backend.release(id)
        finally:
            await backend.aclose()

    # -- commands and files -------------------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        # timeout_retry: the daemon enforces the timeout in the sandbox (no
        # transport to hang, nothing to retry); concurrency: the pool paces.
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        try:
            with _mapped(self.sandbox, user=user):
                if input is not None and len(input) > _INLINE_STDIN:
                    exit_code, stdout, stderr, timed_out = await self._exec_piped(
                        cmd, input, cwd=cwd, env=env, user=user, timeout=timeout, limit=limit
                    )
                    truncated = False  # a pipe keeps the tail, which inspect allows
                else:
                    result = await self.sandbox.exec(
                        list(cmd), cwd=cwd, env=env, stdin=input, timeout=timeout,
                        max_output=limit, user=user,
                    )  # fmt: skip
                    exit_code, stdout, stderr = result.exit_code, result.stdout, result.stderr
                    timed_out, truncated = result.timed_out, result.truncated
        except errors.UnknownUser as exc:
            # docker's answer: a failed command whose output names the user
            return ExecResult(False, 126, "", f"{exc.message}\n")
        if timed_out:
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            if stdout or stderr:
                error.truncated_output = stdout + stderr  # type: ignore[attr-defined]
            raise error
        if truncated:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, truncated_output=stdout
            )
        if exit_code == 126 and not stdout and cmd and stderr == _denied(cmd[0]):
            raise PermissionError(f"Permission denied executing command: {cmd[0]}")
        return ExecResult(exit_code == 0, exit_code, stdout, stderr)

    async def _exec_piped(
        self,
        cmd: list[str],
        data: str | bytes,
        *,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | None,
        timeout: int | None,
        limit: int,
    ) -> tuple[int, str, str, bool]:
        """`exec` with stdin too large for one request: a background process fed
        through its stdin pipe (raw bytes); the last ``limit`` bytes of output kept."""
        sb = self.sandbox
        process = await sb.spawn(
            list(cmd), cwd=cwd, env=env, user=user, stdin=True, max_buffer=limit
        )
        try:
            timed_out = False
            try:
                async with asyncio.timeout(timeout):
                    with contextlib.suppress(errors.StdinClosed):  # it stopped reading
                        await sb.write_stdin(process.id, data, close=True)
                    info = await sb.wait(process.id)
            except TimeoutError:
                timed_out = True
                with contextlib.suppress(errors.SandboxError):  # it may have just ended
                    await sb.signal(process.id, "KILL")
                info = await sb.wait(process.id, timeout=5)
            stdout, stderr = await _output(sb, process.id)
        finally:
            with contextlib.suppress(errors.SandboxError):
                await sb.kill(process.id)
        exit_code = info.exit_code if info.exit_code is not None else 137
        return exit_code, stdout, stderr, timed_out

    async def write_file(self, file: str, contents: str | bytes) -> None:
        with _mapped(self.sandbox):
            await self.sandbox.write_file(file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        with _mapped(self.sandbox):
            try:
                data = await self.sandbox.read_file(file, max_bytes=limit)
            except errors.FileTooLarge:
                raise OutputLimitExceededError(
                    SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
                ) from None
        return data.decode("utf-8") if text else data

    def default_polling_interval(self) -> float:
        return 0.2  # exec_remote's polls are one cheap request to the daemon each


def _denied(name: str) -> str:
    """What the daemon says when it cannot execute ``name`` (exit 126, nothing on stdout)."""
    return f"sandmand: {name}: permission denied\n"


async def _output(sb: AsyncSandbox, process_id: str) -> tuple[str, str]:
    """Everything a finished background process's buffers still hold."""
    stdout: list[str] = []
    stderr: list[str] = []
    out_offset = err_offset = 0
    while True:
        chunk = await sb.read_output(process_id, stdout_offset=out_offset, stderr_offset=err_offset)
        stdout.append(chunk.stdout)
        stderr.append(chunk.stderr)
        if (chunk.stdout_next_offset, chunk.stderr_next_offset) == (out_offset, err_offset):
            return "".join(stdout), "".join(stderr)
        out_offset, err_offset = chunk.stdout_next_offset, chunk.stderr_next_offset


@contextlib.contextmanager
def _mapped(sb: AsyncSandbox, *, user: str | None = None) -> Iterator[None]:
    """Sandman's errors as inspect's contract names them (file errors already are
    the built-ins inspect expects: FileNotFoundError, PermissionError, ...)."""
    try:
        yield
    except (errors.SandboxNotFound, errors.DaemonUnavailable) as exc:
        raise SandboxUnavailableError(f"sandbox {sb.id} is not available: {exc}") from exc
    except errors.PermissionDenied as exc:
        if user is None:
            raise
        raise SandboxUserUnsupportedError(
            f"sandbox {sb.id} cannot run commands as {user!r}: it runs as a user "
            f"other than root (the image's or the config's `user`): {exc.message}"
        ) from exc
