"""``POST /run_code`` and ``POST /run_jupyter``: SandboxFusion's API (`sandman.server.fusion`), so that verl's and
ROLL's ``sandbox_fusion`` clients work unchanged against ``sandman serve``.

At the root, not under ``/v1/``: clients are given a URL ending in ``/run_code``.
Authentication is the service's (an API key acts for its tenant), read from
``Authorization: Bearer <key>`` or, since those clients cannot add a header, from the
URL's user information: ``http://<tenant>:<key>@host:port/run_code`` (HTTP Basic,
which ``requests`` and ``aiohttp`` send for such a URL; the user part is not checked).
Answers and refusals have SandboxFusion's shapes, not the ``/v1/`` API's: 200 with
``status`` ``Success``, ``Failed`` or ``SandboxError``; 422 with ``{"detail": [...]}``
for invalid input; 401 with ``{"detail": "..."}`` without a valid key.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response

from sandman.server.errors import ApiError
from sandman.server.fusion import (
    Fusion,
    Invalid,
    Refused,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    jupyter_problems,
    problems,
)
from sandman.server.routes._deps import service, settings
from sandman.server.schemas import ErrorBody
from sandman.server.service import ClientGone
from sandman.server.settings import RunCodeSettings

router = APIRouter(tags=["sandboxfusion"])

CLIENT_CLOSED_REQUEST = 499

In = TypeVar("In", RunCodeRequest, RunJupyterRequest)


def _fusion(request: Request) -> Fusion:
    """The app's `Fusion`, made at its first request."""
    state = request.app.state
    found: Fusion | None = getattr(state, "fusion", None)
    if found is None:
        found = Fusion(service(request), settings(request).run_code)
        state.fusion = found
    return found


def _authorization(header: str | None) -> str | None:
    """``Basic base64(user:key)`` as ``Bearer key``; anything else as it came."""
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return header
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return "Basic invalid"
    return f"Bearer {decoded.partition(':')[2]}"


def _detail(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors as FastAPI shows them for a body (``loc`` from ``"body"``)."""
    return [{**p, "loc": ["body", *p["loc"]]} for p in exc.errors(include_url=False)]


def _invalid(detail: list[dict[str, Any]]) -> Response:
    return JSONResponse({"detail": jsonable_encoder(detail)}, status_code=422)


_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": Refused, "description": "no valid API key"},
    413: {"model": ErrorBody, "description": "the body is past max_body_bytes"},
    422: {"model": Invalid, "description": "invalid input, or past the operator's limits"},
}


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


@router.post(
    "/run_code",
    response_model=RunCodeResponse,
    responses=_RESPONSES,
    openapi_extra=_body(RunCodeRequest),
)
async def run_code(request: Request) -> Response:
    """Run code in a fresh sandbox, as SandboxFusion's ``/run_code`` does."""
    return await _serve(request, RunCodeRequest, problems, _fusion(request).run)


@router.post(
    "/run_jupyter",
    response_model=RunJupyterResponse,
    responses=_RESPONSES,
    openapi_extra=_body(RunJupyterRequest),
)
async def run_jupyter(request: Request) -> Response:
    """Run cells in order in one Python process of a fresh sandbox, as SandboxFusion's
    ``/run_jupyter`` runs them in one kernel."""
    return await _serve(request, RunJupyterRequest, jupyter_problems, _fusion(request).run_jupyter)


async def _serve(
    request: Request,
    model: type[In],
    check: Callable[[In, RunCodeSettings], list[dict[str, Any]]],
    run: Callable[[str, In, Callable[[], Coroutine[Any, Any, None]]], Awaitable[BaseModel]],
) -> Response:
    """Authenticate, parse and check the body (SandboxFusion's refusals), then ``run`` it
    while watching for the client to go away (then cancelled: its sandbox released)."""
    try:
        tenant = service(request).authenticate(_authorization(request.headers.get("authorization")))
    except ApiError as exc:
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as exc:
        return _invalid(
            [
                {
                    "type": "json_invalid",
                    "loc": ["body", 0],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": str(exc)},
                }
            ]
        )
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        return _invalid(_detail(exc))
    refused = check(parsed, _fusion(request).settings)
    if refused:
        return _invalid(refused)
    gone = asyncio.Event()
    watcher = asyncio.ensure_future(_disconnected(request, gone))

    async def disconnected() -> None:
        await gone.wait()

    work = asyncio.ensure_future(run(tenant, parsed, disconnected))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            # The client went away mid-run: cancelling kills the commands, and the
            # request's session is closed on the way out (the sandbox released).
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        answer = work.result()
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(answer.model_dump(mode="json"))


async def _disconnected(request: Request, gone: asyncio.Event) -> None:
    """Set ``gone`` once the HTTP client has gone away (its body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return
