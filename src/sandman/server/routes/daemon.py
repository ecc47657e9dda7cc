"""``/v1/sandboxes/{id}/daemon/...``: a sandbox's daemon protocol, proxied
(for clients that cannot reach the sandbox itself)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from sandman.pool import Record
from sandman.server.errors import ApiError
from sandman.server.routes._deps import Tenant, errors, forwarder, service
from sandman.server.service import Service

router = APIRouter(tags=["daemon"])


async def _through(svc: Service, record: Record, reaching: Awaitable[Response]) -> Response:
    """The answer of ``reaching`` the daemon of ``record``; one that cannot be reached
    is asked about: a sandbox that died by itself is ``sandbox_lost``."""
    try:
        return await reaching
    except ApiError as exc:
        if exc.code != "daemon_unavailable":
            raise
        # Its daemon does not answer: dead (asked now), or only unreachable?
        await svc.running(record)
        if record.lost is not None:
            raise svc.lost_error(record) from exc
        raise


@router.post(
    "/v1/sandboxes/{sandbox_id}/daemon/v1/ports/{port}/connect",
    operation_id="daemon_port_connect",
    responses={
        200: {
            "description": "the port's bytes, as they come (chunked, full duplex)",
            "content": {"application/octet-stream": {}},
        },
        502: {
            "description": "the daemon's own refusal (connection_refused), passed through; "
            "or the service's: daemon_unavailable, untrusted_daemon"
        },
        **errors("sandbox_not_found", "sandbox_lost", "daemon_unavailable"),
    },
)
async def port_connect(
    tenant: Tenant, sandbox_id: str, port: Annotated[int, Path(ge=1, le=65535)], request: Request
) -> Response:
    """A TCP port inside the sandbox, carried both ways over this one exchange.

    The daemon's ``GET /v1/ports/{port}/connect`` upgrade cannot pass an ASGI
    server, so here it is a full-duplex ``POST``: send the bytes for the port
    as the chunked request body and read the port's bytes from the chunked
    answer, both at once; ending the request body is the half-close. Errors
    (nothing listens: the daemon's ``connection_refused``) come before the
    ``200``. Needs a path that does not buffer request bodies (nginx:
    ``proxy_request_buffering off``).
    """
    svc = service(request)
    record = svc.sandbox(tenant, sandbox_id)
    return await _through(svc, record, forwarder(request).connect_port(record, port))


async def daemon(tenant: Tenant, sandbox_id: str, path: str, request: Request) -> Response:
    """The sandbox's daemon protocol (``/v1/exec``, ``/v1/files``...), proxied.

    Method, query, body and answer pass through as streams; the proxy adds
    the daemon's token. The daemon's own errors come back as it sent them. A
    sandbox that died by itself is ``sandbox_lost`` (410, with its ``reason``).
    """
    svc = service(request)
    record = svc.sandbox(tenant, sandbox_id)
    return await _through(svc, record, forwarder(request).forward(record, request, path))


for _method in ("GET", "POST", "PUT", "DELETE"):
    router.add_api_route(
        "/v1/sandboxes/{sandbox_id}/daemon/{path:path}",
        daemon,
        methods=[_method],
        operation_id=f"daemon_{_method.lower()}",
        responses={
            200: {"description": "the daemon's answer, passed through", "content": {"*/*": {}}},
            **errors("sandbox_not_found", "sandbox_lost", "daemon_unavailable"),
        },
    )
