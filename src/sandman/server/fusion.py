"""SandboxFusion's ``POST /run_code`` and ``POST /run_jupyter`` over the pool: their
requests and answers, field for field, and one request run in a sandbox of its own.

The models follow bytedance/SandboxFusion (``sandbox/server/sandbox_api.py`` and
``sandbox/runners/types.py``), so that the clients verl and ROLL ship read our answers
as theirs: ``status`` is ``Success``, ``Failed`` (a command timed out or exited
non-zero) or ``SandboxError`` (the request could not be run); each command's
``status`` is ``Finished``, ``TimeLimitExceeded`` or ``Error``. A compile step that
fails leaves ``run_result`` null. ``files`` and ``fetch_files`` carry base64.

What differs is where the code runs: in a fresh sandbox acquired for the caller's
tenant in a session of its own (`Service.acquire`: tenant limits, labels, pacing,
warm spares), with the request's memory limit as the sandbox's, no network unless
the operator allows it, and the session closed at the end whatever happened, so
nothing outlives the request. Input past the operator's limits (`RunCodeSettings`)
is refused the way SandboxFusion's FastAPI refuses invalid input: 422 with
``{"detail": [{"type", "loc", "msg", "input", ...}]}``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import posixpath
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sandman import errors
from sandman.daemon import DaemonClient
from sandman.models import ExecResult, SandboxSpec
from sandman.server.errors import ApiError
from sandman.server.fusion_kernel import KERNEL
from sandman.server.schemas import AcquireRequest
from sandman.server.service import LABEL_TENANT, Service
from sandman.server.settings import CodeLanguage, RunCodeSettings

__all__ = [
    "FUSION_LANGUAGES",
    "CellRunResult",
    "CommandRunResult",
    "Fusion",
    "Invalid",
    "Refused",
    "RunCodeRequest",
    "RunCodeResponse",
    "RunJupyterRequest",
    "RunJupyterResponse",
    "jupyter_problems",
    "problems",
]

logger = logging.getLogger(__name__)

FUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript",
    "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest",
    "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
)  # fmt: skip
"""SandboxFusion's ``Language``: a name outside it (and outside ours) is a 422, one inside
it that this service does not run is a ``SandboxError``, as an unusable runtime is there."""

_MIN_MEMORY_MB = 32
_KERNEL_DIR = ".sandman-kernel"
_LEASE_MARGIN = 30.0  # seconds of a session's lease beyond the request's own time limits


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest``; unknown fields are ignored, as there (ROLL
    sends ``expected_stdout``)."""

    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: str
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    """SandboxFusion's pod; here the sandbox's id."""
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(BaseModel):
    """SandboxFusion's ``RunJupyterRequest``: cells run in order in one Python process."""

    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = 0
    """Seconds per cell; 0: none (the cell is interrupted with ``TimeoutError``)."""
    total_timeout: float = 45
    memory_limit_MB: int = -1
    kernel: Literal["python3"] = "python3"
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class Invalid(BaseModel):
    """422: what FastAPI answers for invalid input (SandboxFusion's own refusal)."""

    detail: list[dict[str, Any]]


class Refused(BaseModel):
    """401: no valid API key."""

    detail: str


def _problem(kind: str, where: str, message: str, value: object, **ctx: object) -> dict[str, Any]:
    found: dict[str, Any] = {"type": kind, "loc": ["body", where], "msg": message, "input": value}
    if ctx:
        found["ctx"] = ctx
    return found


def _too_much_memory(asked: int, settings: RunCodeSettings) -> dict[str, Any]:
    limit = settings.max_memory_mb
    message = f"Input should be less than or equal to {limit}"
    return _problem("less_than_equal", "memory_limit_MB", message, asked, le=limit)


def _too_long(
    kind: str, where: str, what: str, size: int, settings: RunCodeSettings
) -> dict[str, Any]:
    limit = settings.max_code_bytes
    together = " together" if where == "cells" else ""
    message = f"{what} at most {limit} bytes{together}, not {size}"
    return _problem(kind, where, message, f"<{size} bytes>", max_length=limit)


def problems(request: RunCodeRequest, settings: RunCodeSettings) -> list[dict[str, Any]]:
    """What in ``request`` is past this service's limits, as FastAPI's validation errors
    (``detail`` items); empty when it may run. A language SandboxFusion knows but this
    service does not run is not a problem here (`Fusion.run` answers ``SandboxError``)."""
    found = []
    if request.language not in settings.languages and request.language not in FUSION_LANGUAGES:
        names = [*FUSION_LANGUAGES, *(n for n in settings.languages if n not in FUSION_LANGUAGES)]
        expected = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
        found.append(
            _problem(
                "literal_error",
                "language",
                f"Input should be {expected}",
                request.language,
                expected=expected,
            )
        )
    for name, value, limit in (
        ("run_timeout", request.run_timeout, settings.max_run_timeout),
        ("compile_timeout", request.compile_timeout, settings.max_compile_timeout),
    ):
        if value > limit:
            found.append(
                _problem(
                    "less_than_equal",
                    name,
                    f"Input should be less than or equal to {limit:g}",
                    value,
                    le=limit,
                )
            )
        elif value <= 0:
            found.append(
                _problem("greater_than", name, "Input should be greater than 0", value, gt=0)
            )
    if request.memory_limit_MB > settings.max_memory_mb:
        found.append(_too_much_memory(request.memory_limit_MB, settings))
    size = len(request.code.encode("utf-8", "surrogatepass"))
    if size > settings.max_code_bytes:
        found.append(_too_long("string_too_long", "code", "String should have", size, settings))
    # Base64 is 4 characters for 3 bytes: a bound on the decoded size before decoding.
    encoded = sum(len(v) for v in request.files.values() if v is not None)
    if encoded * 3 // 4 > settings.max_files_bytes + 3 * len(request.files):
        found.append(
            _problem(
                "too_long",
                "files",
                f"files should hold at most {settings.max_files_bytes} bytes together",
                f"<{encoded} base64 characters>",
                max_length=settings.max_files_bytes,
            )
        )
    return found


def jupyter_problems(request: RunJupyterRequest, settings: RunCodeSettings) -> list[dict[str, Any]]:
    """`problems` for ``/run_jupyter``: ``total_timeout`` is bounded by ``max_run_timeout``,
    the cells together by ``max_code_bytes``."""
    found = []
    limit = settings.max_run_timeout
    if not 0 < request.total_timeout <= limit:
        found.append(
            _problem(
                "less_than_equal",
                "total_timeout",
                f"Input should be greater than 0 and less than or equal to {limit:g}",
                request.total_timeout,
                le=limit,
            )
        )
    if request.cell_timeout < 0:
        found.append(
            _problem("greater_than_equal", "cell_timeout", "Input should be >= 0", 0, ge=0)
        )
    if request.memory_limit_MB > settings.max_memory_mb:
        found.append(_too_much_memory(request.memory_limit_MB, settings))
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in request.cells)
    if size > settings.max_code_bytes:
        found.append(_too_long("too_long", "cells", "cells should hold", size, settings))
    return found


def _decode_files(files: Mapping[str, str | None]) -> dict[str, bytes]:
    """The files to write; ValueError (with the file's name) for invalid base64. As in
    SandboxFusion, a null content or a name containing ``IGNORE_THIS_FILE`` is skipped."""
    decoded = {}
    for name, content in files.items():
        if content is None or "IGNORE_THIS_FILE" in name:
            continue
        if not name:
            raise ValueError("a file has an empty name")
        try:
            decoded[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"file {name!r} is not valid base64: {exc}") from None
    return decoded


def _result(result: ExecResult) -> CommandRunResult:
    if result.timed_out:
        return CommandRunResult(
            status="TimeLimitExceeded",
            execution_time=result.duration_seconds,
            stdout=result.stdout,
            stderr=result.stderr,
        )
    return CommandRunResult(
        status="Finished",
        execution_time=result.duration_seconds,
        return_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
    )


def _verdict(compiled: CommandRunResult | None, ran: CommandRunResult | None) -> str:
    """SandboxFusion's ``parse_run_status``, less its ``Error`` case (ours raise instead)."""
    outcomes = [r for r in (compiled, ran) if r is not None]
    if any(r.status == "TimeLimitExceeded" for r in outcomes):
        return "Failed"
    if any(r.return_code not in (None, 0) for r in outcomes):
        return "Failed"
    return "Success"


def _sandbox_error(message: str, **fields: Any) -> RunCodeResponse:
    return RunCodeResponse(status="SandboxError", message=message, **fields)


class _NoSandbox(Exception):
    """The request cannot be run: it is answered ``SandboxError`` with this message."""

    def __init__(self, message: str, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id


@dataclass
class Fusion:
    """The ``run_code`` side of one service: its settings and the warm spares it asked for."""

    service: Service
    settings: RunCodeSettings
    _warmed: set[tuple[str, str]] = field(default_factory=set)

    def spec(self, language: CodeLanguage, memory_mb: int) -> SandboxSpec:
        """The sandbox a request of ``language`` gets (before its tenant's label)."""
        return SandboxSpec(
            image=language.image,
            cpu=self.settings.cpu,
            memory=memory_mb * 2**20,
            pids=self.settings.pids,
            network=self.settings.network,  # checked by its pattern
            labels={"run-code": "1"},
        )

    def _warm(self, tenant: str, name: str, language: CodeLanguage, spec: SandboxSpec) -> None:
        count = self.settings.warm if language.warm is None else language.warm
        if count <= 0 or (tenant, name) in self._warmed:
            return
        self._warmed.add((tenant, name))
        labelled = spec.model_copy(update={"labels": {**spec.labels, LABEL_TENANT: tenant}})
        try:
            self.service.pool.warm(labelled, count)
        except errors.SandboxError as exc:  # closed: this request fails on its own
            logger.debug("run_code: no warm spares for %s/%s: %s", tenant, name, exc)

    @contextlib.asynccontextmanager
    async def sandbox(
        self,
        tenant: str,
        name: str,
        memory_limit_mb: int,
        seconds: float,
        disconnected: Callable[[], Coroutine[Any, Any, None]],
    ) -> AsyncIterator[tuple[str, DaemonClient]]:
        """A sandbox of language ``name`` for the tenant, and a client of its daemon.

        Acquired in a session opened for this request alone and closed at the end,
        whatever happens (an error, a cancelled handler): the sandbox is released
        then. `_NoSandbox` if none can be had; `ClientGone` (from `Service.acquire`)
        when the client went away while it was being made. ``seconds`` is how long
        the request may take in it.
        """
        language = self.settings.languages[name]
        memory = (
            self.settings.default_memory_mb
            if memory_limit_mb <= 0
            else max(memory_limit_mb, _MIN_MEMORY_MB)
        )
        spec = self.spec(language, memory)
        if memory == self.settings.default_memory_mb:
            self._warm(tenant, name, language, spec)
        limit = self.settings.acquire_timeout
        try:
            session, _ = self.service.open_session(tenant, limit + seconds + _LEASE_MARGIN)
        except ApiError as exc:
            raise _NoSandbox(f"no sandbox: {exc.message}") from exc
        try:
            try:
                record = await self.service.acquire(
                    tenant, AcquireRequest(spec=spec, session=session, timeout=limit), disconnected
                )
            except ApiError as exc:
                raise _NoSandbox(f"no sandbox: {exc.message}") from exc
            endpoint = record.info.endpoint if record.info is not None else None
            if endpoint is None:
                raise _NoSandbox(f"sandbox {record.id} has no daemon endpoint")
            async with endpoint.client(request_timeout=seconds + _LEASE_MARGIN) as daemon:
                try:
                    yield record.id, daemon
                except (errors.SandboxError, OSError) as exc:
                    raise _NoSandbox(
                        f"sandbox {record.id}: {type(exc).__name__}: {exc}", record.id
                    ) from exc
        finally:
            with contextlib.suppress(ApiError):
                self.service.close_session(tenant, session)

    async def run(
        self,
        tenant: str,
        request: RunCodeRequest,
        disconnected: Callable[[], Coroutine[Any, Any, None]],
    ) -> RunCodeResponse:
        """Run ``request`` (already checked by `problems`) in a sandbox of the tenant's own."""
        language = self.settings.languages.get(request.language)
        if language is None:
            return _sandbox_error(f"language {request.language!r} is not served here")
        try:
            files = _decode_files(request.files)
        except ValueError as exc:
            return _sandbox_error(f"exception on running code: {exc}")
        seconds = request.compile_timeout + request.run_timeout
        try:
            async with self.sandbox(
                tenant, request.language, request.memory_limit_MB, seconds, disconnected
            ) as (sandbox_id, daemon):
                answer = await self._in_sandbox(daemon, language, request, files)
        except _NoSandbox as exc:
            return _sandbox_error(exc.message, executor_pod_name=exc.sandbox_id)
        return answer.model_copy(update={"executor_pod_name": sandbox_id})

    async def run_jupyter(
        self,
        tenant: str,
        request: RunJupyterRequest,
        disconnected: Callable[[], Coroutine[Any, Any, None]],
    ) -> RunJupyterResponse:
        """Run the cells (already checked by `jupyter_problems`) in order in one Python
        process of a sandbox of the tenant's own (the ``python`` language's image)."""
        if "python" not in self.settings.languages:
            return RunJupyterResponse(status="SandboxError", message="python is not served here")
        try:
            files = _decode_files(request.files)
        except ValueError as exc:
            return RunJupyterResponse(
                status="SandboxError", message=f"exception on running jupyter: {exc}"
            )
        try:
            async with self.sandbox(
                tenant, "python", request.memory_limit_MB, request.total_timeout, disconnected
            ) as (sandbox_id, daemon):
                answer = await self._jupyter(daemon, request, files)
        except _NoSandbox as exc:
            return RunJupyterResponse(
                status="SandboxError", message=exc.message, executor_pod_name=exc.sandbox_id
            )
        return answer.model_copy(update={"executor_pod_name": sandbox_id})

    async def _jupyter(
        self, daemon: DaemonClient, request: RunJupyterRequest, files: dict[str, bytes]
    ) -> RunJupyterResponse:
        workdir = self.settings.workdir
        kernel = posixpath.join(workdir, _KERNEL_DIR)
        config = {"cells": request.cells, "cell_timeout": request.cell_timeout}
        writes = [
            daemon.write_file(f"{kernel}/kernel.py", KERNEL),
            daemon.write_file(f"{kernel}/input.json", json.dumps(config)),
        ]
        writes += [daemon.write_file(posixpath.join(workdir, n), b) for n, b in files.items()]
        await asyncio.gather(*writes)
        cap = self.settings.max_output_bytes
        result = await daemon.exec(
            ["python3", f"{kernel}/kernel.py", f"{kernel}/input.json", f"{kernel}/output.json"],
            cwd=workdir,
            env=self.settings.languages["python"].env,
            timeout=request.total_timeout,
            max_output=cap,
        )
        driver = _result(result)
        if driver.status != "Finished":
            return RunJupyterResponse(status="Failed", message="", driver=driver)
        try:
            output = json.loads(await daemon.read_file(f"{kernel}/output.json", max_bytes=cap))
            cells = [CellRunResult.model_validate(c) for c in output["cells"]]
        except (errors.PathNotFound, errors.FileTooLarge, ValueError, KeyError, TypeError):
            return RunJupyterResponse(status="Failed", message="", driver=driver)
        fetched = await self._fetch(daemon, request.fetch_files)
        if fetched is None:
            return RunJupyterResponse(
                status="SandboxError",
                message=f"fetch_files hold more than {self.settings.max_fetch_bytes} bytes",
                driver=driver,
                cells=cells,
            )
        return RunJupyterResponse(
            status="Success", message="", driver=driver, cells=cells, files=fetched
        )

    async def _in_sandbox(
        self,
        daemon: DaemonClient,
        language: CodeLanguage,
        request: RunCodeRequest,
        files: dict[str, bytes],
    ) -> RunCodeResponse:
        workdir = self.settings.workdir
        writes = [daemon.write_file(posixpath.join(workdir, language.source), request.code)]
        writes += [daemon.write_file(posixpath.join(workdir, n), b) for n, b in files.items()]
        await asyncio.gather(*writes)
        cap = self.settings.max_output_bytes
        compiled = ran = None
        truncated = False
        if language.compile is not None:
            result = await daemon.exec(
                language.compile,
                cwd=workdir,
                env=language.env,
                timeout=request.compile_timeout,
                max_output=cap,
            )
            compiled, truncated = _result(result), result.truncated
        if compiled is None or (compiled.status == "Finished" and compiled.return_code == 0):
            result = await daemon.exec(
                language.run,
                cwd=workdir,
                env=language.env,
                stdin=request.stdin,
                timeout=request.run_timeout,
                max_output=cap,
            )
            ran, truncated = _result(result), truncated or result.truncated
        fetched = await self._fetch(daemon, request.fetch_files)
        if truncated:
            return _sandbox_error(
                f"output past the limit of {cap} bytes per stream",
                compile_result=compiled,
                run_result=ran,
                files=fetched,
            )
        if fetched is None:
            return _sandbox_error(
                f"fetch_files hold more than {self.settings.max_fetch_bytes} bytes",
                compile_result=compiled,
                run_result=ran,
            )
        return RunCodeResponse(
            status=_verdict(compiled, ran),
            message="",
            compile_result=compiled,
            run_result=ran,
            files=fetched,
        )

    async def _fetch(self, daemon: DaemonClient, names: list[str]) -> dict[str, str] | None:
        """The files asked for that exist (regular files only, as SandboxFusion's
        ``isfile``), base64; None once they hold more than ``max_fetch_bytes``."""
        left = self.settings.max_fetch_bytes
        fetched: dict[str, str] = {}
        for name in names:
            path = posixpath.join(self.settings.workdir, name)
            try:
                data = await daemon.read_file(path, max_bytes=left)
            except errors.FileTooLarge:
                return None
            except (errors.PathNotFound, errors.NotARegularFile, errors.IsADirectory):
                continue
            except errors.DaemonError as exc:
                if exc.code in ("not_found", "not_a_regular_file", "is_a_directory"):
                    continue
                raise
            left -= len(data)
            fetched[name] = base64.b64encode(data).decode()
        return fetched
