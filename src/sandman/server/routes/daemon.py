"""``/v1/sandboxes/{id}/daemon/...``: a sandbox's daemon protocol, proxied
(for clients that cannot reach the sandbox itself)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from sandman.server.errors import ApiError
from sandman.server.routes._deps import Tenant, errors, forwarder, service

router = APIRouter(tags=["daemon"])


async def daemon(tenant: Tenant, sandbox_id: str, path: str, request: Request) -> Response:
    """The sandbox's daemon protocol (``/v1/exec``, ``/v1/files``...), proxied.

    Method, query, body and answer pass through as streams; the proxy adds
    the daemon's token. The daemon's own errors come back as it sent them. A
    sandbox that died by itself is ``sandbox_lost`` (410, with its ``reason``).
    """
    svc = service(request)
    record = svc.sandbox(tenant, sandbox_id)
    try:
        return await forwarder(request).forward(record, request, path)
    except ApiError as exc:
        if exc.code != "daemon_unavailable":
            raise
        # Its daemon does not answer: dead (asked now), or only unreachable?
        await svc.running(record)
        if record.lost is not None:
            raise svc.lost_error(record) from exc
        raise


for _method in ("GET", "POST", "PUT", "DELETE"):
    router.add_api_route(
        "/v1/sandboxes/{sandbox_id}/daemon/{path:path}", daemon, methods=[_method],
        operation_id=f"daemon_{_method.lower()}",
        responses={
            200: {"description": "the daemon's answer, passed through", "content": {"*/*": {}}},
            **errors("sandbox_not_found", "sandbox_lost", "daemon_unavailable"),
        },
    )  # fmt: skip
