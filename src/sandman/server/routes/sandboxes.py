"""``/v1/sandboxes``: acquire, list, describe and release the tenant's sandboxes."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from sandman.egress import Egress
from sandman.models import Usage
from sandman.pool.records import State
from sandman.server.errors import ApiError
from sandman.server.routes._deps import Tenant, errors, metrics, sampler, service
from sandman.server.schemas import (
    AcquirePending,
    AcquireRequest,
    SandboxList,
    SandboxOut,
    sandbox_out,
)
from sandman.server.service import ClientGone

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])

CLIENT_CLOSED_REQUEST = 499
"""Answered to a client that went away while its acquire waited (nginx's
convention); nobody reads it."""


@router.post(
    "",
    status_code=201,
    response_model=SandboxOut,
    responses={
        202: {"model": AcquirePending, "description": "With ``wait``: not yet; ask again."},
        **errors(
            "not_found",
            "session_expired",
            "image_not_found",
            "image_error",
            "tenant_sandbox_limit",
            "tenant_pending_limit",
            "provider_error",
            "capacity",
            "throttled",
            "pool_closed",
            "shutting_down",
            "create_timeout",
        ),
    },
)
async def acquire(tenant: Tenant, body: AcquireRequest, request: Request) -> Any:
    """Acquire a ready sandbox for a session: waits up to ``timeout`` seconds.

    The answer holds the daemon's endpoint and token. If the HTTP client
    goes away while waiting, the acquire is cancelled and the pool hands
    the sandbox to the next waiter, or deletes it. With ``wait``, the
    request is answered ``202`` after that long with a ticket to ask again
    with; the acquire keeps its place meanwhile (one open request per
    waiting acquire costs the service memory: a long poll bounds it).
    """
    # Across a ticket's requests, from the first: what the caller waited.
    tickets = service(request).tickets
    started = tickets.opened(tenant, body.session, body.ticket) or time.monotonic()
    try:
        got = await service(request).poll(tenant, body, lambda: _disconnected(request))
    except ApiError as exc:
        metrics(request).observe_acquire(started, exc.code)
        sampler(request).refused(tenant, exc.code, exc.message, image=body.spec.image)
        raise
    except ClientGone:
        metrics(request).observe_acquire(started, "client_gone")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(got, AcquirePending):
        retry = {"Retry-After": str(max(1, round(got.retry_after)))}
        return Response(got.model_dump_json(), 202, retry, media_type="application/json")
    metrics(request).observe_acquire(started, "ok")
    return sandbox_out(got, endpoint=True)


@router.delete(
    "/acquires/{ticket}",
    status_code=204,
    responses=errors("session_expired"),
)
async def give_up_acquire(
    tenant: Tenant,
    ticket: str,
    request: Request,
    session: Annotated[str, Query(min_length=1, max_length=128)],
) -> Response:
    """Give up a waiting acquire by its ticket (``202`` of an acquire with ``wait``): the
    pool hands what it was making to the next waiter, or deletes it. Idempotent."""
    await service(request).forget_acquire(tenant, session, ticket)
    return Response(status_code=204)


@router.get("", response_model=SandboxList, responses=errors())
async def list_sandboxes(
    tenant: Tenant,
    request: Request,
    session: Annotated[str | None, Query(max_length=128)] = None,
    state: State | None = None,
    image: Annotated[str | None, Query(max_length=4096)] = None,
) -> SandboxList:
    """The tenant's sandboxes (those recently gone too), filtered."""
    records = service(request).list(tenant, session=session, state=state, image=image)
    return SandboxList(sandboxes=[sandbox_out(r) for r in records])


@router.get(
    "/{sandbox_id}",
    response_model=SandboxOut,
    responses=errors("sandbox_not_found", "provider_error"),
)
async def get_sandbox(
    tenant: Tenant, sandbox_id: str, request: Request, probe: bool = False
) -> SandboxOut:
    """One of the tenant's sandboxes: state, timeline, endpoint and token.

    With ``probe``, ``running`` says whether the backend has it running now.
    """
    record = service(request).sandbox(tenant, sandbox_id)
    running = await service(request).running(record) if probe else None
    return sandbox_out(record, endpoint=True, running=running)


@router.get(
    "/{sandbox_id}/usage",
    response_model=Usage | None,
    responses=errors("sandbox_not_found", "sandbox_lost", "provider_error"),
)
async def usage(tenant: Tenant, sandbox_id: str, request: Request) -> Usage | None:
    """What the sandbox has used (CPU seconds, peak and current memory, disk written,
    network bytes): read now while it is held, else as read just before its delete;
    null where the provider cannot tell."""
    return await service(request).usage(tenant, sandbox_id)


@router.put(
    "/{sandbox_id}/egress",
    status_code=204,
    responses=errors("sandbox_not_found", "sandbox_lost", "invalid_request", "provider_error"),
)
async def set_egress(tenant: Tenant, sandbox_id: str, body: Egress, request: Request) -> Response:
    """Replace where the leased egress sandbox may connect (``allow``: null for anywhere,
    a list for only there; ``deny`` wins), at once, for connections it has open too."""
    await service(request).set_egress(tenant, sandbox_id, body)
    return Response(status_code=204)


@router.delete(
    "/{sandbox_id}",
    status_code=204,
    response_model=None,
    responses={
        **errors("sandbox_not_found"),
        200: {"model": Usage | None, "description": "With ``usage=true``: what it used."},
    },
)
async def release(
    tenant: Tenant,
    sandbox_id: str,
    request: Request,
    usage: Annotated[
        bool, Query(description="Answer 200 with what it used (a rollout's cost).")
    ] = False,
) -> Response:
    """Release the sandbox; it is deleted in the background. Idempotent. With
    ``usage=true`` the answer is what it used, read just before (as ``/usage`` says),
    in the same round trip."""
    if not usage:
        service(request).release(tenant, sandbox_id)
        return Response(status_code=204)
    used = await service(request).release_with_usage(tenant, sandbox_id)
    body = "null" if used is None else used.model_dump_json()
    return Response(body, status_code=200, media_type="application/json")


async def _disconnected(request: Request) -> None:
    """Return once the HTTP client has gone away (its body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
