"""The Python side against the OpenAPI document: every request the client sends
and every answer it reads must match ``daemon/spec/openapi.json``."""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args
from urllib.parse import parse_qs, urlsplit

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

import sandman
from sandman import models
from sandman._transport import AsyncTransport, HTTPTransport, Response, ResponseStream
from sandman.daemon import DaemonClient
from sandman.daemon.pausing import pause_processes, resume_processes
from sandman.daemon.protocol import ERROR_CLASSES, ExecOptions
from tests.daemon.conftest import TOKEN
from tests.daemon.running import RunningDaemon

SPEC_PATH = Path(__file__).resolve().parents[2] / "daemon" / "spec" / "openapi.json"
SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text())
REGISTRY: Registry[Any] = Registry().with_resource(
    "urn:spec", Resource.from_contents(SPEC, default_specification=DRAFT202012)
)


HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head"}


def _validator(ref: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"urn:spec{ref}"}, registry=REGISTRY)


def _schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = SPEC["components"]["schemas"][name]
    return schema


@dataclass
class Exchange:
    method: str
    target: str
    request_body: bytes | None
    content_type: str | None
    status: int = 0
    response_type: str = ""
    response_body: bytearray = field(default_factory=bytearray)


class RecordingTransport:
    """Keeps a copy of every request and response that passes through ``inner``."""

    def __init__(self, inner: AsyncTransport) -> None:
        self._inner = inner
        self.exchanges: list[Exchange] = []

    async def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None = None,
        content_type: str | None = None,
    ) -> Response:
        async with self.stream(method, target, body=body, content_type=content_type) as response:
            return Response(response.status, response.headers, await response.read())

    @asynccontextmanager
    async def stream(
        self, method: str, target: str, *, body: Any = None, content_type: str | None = None
    ) -> AsyncIterator[ResponseStream]:
        exchange = Exchange(method, target, body if isinstance(body, bytes) else None, content_type)
        self.exchanges.append(exchange)
        async with self._inner.stream(
            method, target, body=body, content_type=content_type
        ) as response:
            exchange.status = response.status
            exchange.response_type = response.headers.get("content-type", "")
            plain = response.iter_bytes

            async def tapped() -> AsyncIterator[bytes]:
                async for piece in plain():
                    exchange.response_body += piece
                    yield piece

            response.iter_bytes = tapped  # type: ignore[method-assign]
            yield response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _operation(method: str, path: str) -> tuple[str, dict[str, Any]]:
    for template, item in SPEC["paths"].items():
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in item:
            return template, item[method.lower()]
    raise AssertionError(f"{method} {path} is not in the spec")


def _response(operation: dict[str, Any], status: int) -> dict[str, Any]:
    response: dict[str, Any] = operation["responses"][str(status)]
    if "$ref" in response:
        response = SPEC["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return response


def check_exchange(exchange: Exchange) -> str:
    """Assert the exchange matches the spec; returns 'METHOD template'."""
    url = urlsplit(exchange.target)
    template, operation = _operation(exchange.method, url.path)
    documented = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
    assert set(parse_qs(url.query)) <= documented, (exchange.target, documented)
    if exchange.content_type == "application/json":
        assert exchange.request_body is not None
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        _validator(schema["$ref"]).validate(json.loads(exchange.request_body))
    assert str(exchange.status) in operation["responses"], (exchange.target, exchange.status)
    content = _response(operation, exchange.status).get("content", {})
    body = bytes(exchange.response_body)
    if exchange.response_type.startswith("application/json"):
        _validator(content["application/json"]["schema"]["$ref"]).validate(json.loads(body))
    elif exchange.response_type.startswith("application/x-ndjson"):
        validator = _validator(content["application/x-ndjson"]["schema"]["$ref"])
        for line in body.splitlines():
            validator.validate(json.loads(line))
    return f"{exchange.method} {template}"


async def _exercise(client: DaemonClient, work: Path) -> None:
    """Every client method, with a few failures among them."""
    await client.health()
    await client.exec(["echo", "hi"], cwd=str(work), env={"A": "1"}, stdin="x", timeout=5,
                      kill_grace=1, max_output=100, encoding="base64")  # fmt: skip
    await client.exec("echo hi", shell="/bin/sh")
    await client.exec(["cat"], stdin=b"\x00\xff", user="root", merge_stderr=True)
    async with client.exec_stream("echo a; echo b >&2", timeout=5) as events:
        _ = [event async for event in events]
    async with client.exec_stream("echo a", stdin=b"x", user="0", merge_stderr=True) as events:
        _ = [event async for event in events]
    proc = await client.spawn(["cat"], stdin=True, max_buffer=1024, cwd=str(work), user=0,
                              merge_stderr=True)  # fmt: skip
    await client.write_stdin(proc.id, "data", close=True)
    await client.wait(proc.id, timeout=5)
    await client.read_output(proc.id, stdout_offset=0, stderr_offset=0, wait=0.1)
    await client.list_processes()
    await client.poll(proc.id)
    await client.signal(proc.id, "TERM")
    await client.kill(proc.id)
    term = await client.spawn(["cat"], tty=True, rows=10, cols=20)
    await client.resize(term.id, rows=11, cols=21)
    await client.kill(term.id)
    sh = await client.create_shell(shell="/bin/sh", cwd=str(work), env={"B": "2"}, user="root")
    await client.run_in_shell(sh.id, "cd /", timeout=5, max_output=100)
    await client.run_in_shell(sh.id, "cd /", timeout=5, merge_stderr=True,
                              on_timeout="interrupt", kill_grace=1)  # fmt: skip
    await client.list_shells()
    await client.get_shell(sh.id)
    await client.close_shell(sh.id)
    await client.write_file(str(work / "f"), "x", mode=0o600)
    await client.write_file(str(work / "d" / "g"), "y", parents=True)
    await client.read_file(str(work / "f"))
    await client.stat(str(work / "f"))
    await client.list_dir(str(work))
    await client.mkdir(str(work / "m"), mode=0o700)
    await client.move(str(work / "f"), str(work / "m" / "f"), overwrite=True)
    await client.remove(str(work / "m"), recursive=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("t.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"t"))
    await client.upload_archive(str(work / "a"), buf.getvalue())
    await client.download_archive(str(work / "a"), gzip=True)
    for failing in (
        client.read_file(str(work / "missing")),
        client.list_dir(str(work / "a" / "t.txt")),
        client.poll("p-missing"),
        client.run_in_shell("s-missing", "true"),
        client.exec(["true"], user="no-such-user-here"),
    ):
        with pytest.raises(sandman.DaemonError):
            await failing
    # The host's pause (Kubernetes): what would start a process is refused meanwhile.
    await pause_processes(client)
    with pytest.raises(sandman.SandboxPaused):
        await client.exec(["true"])
    await resume_processes(client)


@pytest.mark.anyio
async def test_client_requests_and_daemon_answers_match_the_spec(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    assert daemon.uds is not None
    recorder = RecordingTransport(
        HTTPTransport(uds=daemon.uds, default_headers={"Authorization": f"Bearer {TOKEN}"})
    )
    client = DaemonClient(transport=recorder)  # the seam: same client, recording transport
    try:
        await _exercise(client, tmp_path)
    finally:
        await client.aclose()
    covered = {check_exchange(exchange) for exchange in recorder.exchanges}
    every = {
        f"{method.upper()} {path}"
        for path, item in SPEC["paths"].items()
        for method in item
        if method in HTTP_METHODS and path != "/v1/openapi.json"
    }
    # Ports connect on connections of their own, not through the transport:
    # tests/daemon/test_ports.py::test_the_daemons_answers_match_the_spec.
    every.discard("GET /v1/ports/{id}/connect")
    # The host's own calls around a checkpoint, on connections of their own as well:
    # tests/daemon/test_checkpoint.py.
    every -= {"POST /v1/token", "POST /v1/checkpoint/prepare"}
    # The host's calls for snapshots of the files walk the daemon's whole root: against
    # a daemon that is PID 1 of a rootfs, with their exchanges checked against the spec
    # too, in tests/daemon/test_changes.py.
    every -= {"GET /v1/changes", "PUT /v1/changes"}
    assert every - covered == set(), "operations the client never used"


@pytest.mark.parametrize(
    ("model", "schema"),
    [
        (models.Health, "Health"),
        (models.ExecResult, "ExecResult"),
        (models.ProcessInfo, "ProcessInfo"),
        (models.ProcessOutput, "ProcessOutput"),
        (models.ShellInfo, "ShellInfo"),
        (models.ShellRunResult, "ShellRunResult"),
        (models.FileStat, "FileStat"),
        (models.ArchiveResult, "ArchiveResult"),
    ],
)
def test_models_have_the_spec_fields(model: type[BaseModel], schema: str) -> None:
    assert set(model.model_fields) == set(_schema(schema)["properties"])


def test_exec_event_model_covers_both_event_schemas() -> None:
    fields = set(_schema("ExecOutputEvent")["properties"]) | set(
        _schema("ExecExitEvent")["properties"]
    )
    assert set(models.ExecEvent.model_fields) == fields


def test_enums_match() -> None:
    assert set(get_args(models.FileType)) == set(_schema("FileStat")["properties"]["type"]["enum"])
    assert set(get_args(models.Encoding)) == set(
        _schema("ExecResult")["properties"]["encoding"]["enum"]
    )


def test_every_wire_error_code_is_mapped() -> None:
    codes = set(_schema("Error")["properties"]["error"]["properties"]["code"]["enum"])
    unmapped = codes - set(ERROR_CLASSES)
    # These two are the daemon's own failures: a plain DaemonError is right for them.
    assert unmapped == {"internal", "process_running"}


def test_exec_options_are_the_exec_request_fields() -> None:
    # Written once on each side: an option the SDK has is a field of the wire's
    # ExecRequest under the same name, and a field of it is an option (but the command
    # itself and stdin's encoding, which the SDK picks from stdin's type).
    wire = set(_schema("ExecRequest")["properties"]) - {"argv", "cmd", "stdin_encoding"}
    assert set(ExecOptions.__optional_keys__) == wire
