"""``/v1/warm``: ready spares for the caller's tenant."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from sandman.server.routes._deps import Tenant, errors, service
from sandman.server.schemas import WarmRequest

router = APIRouter(tags=["sandboxes"])


@router.put(
    "/v1/warm",
    status_code=204,
    responses=errors("invalid_request", "tenant_sandbox_limit", "pool_closed", "shutting_down"),
)
async def warm(tenant: Tenant, body: WarmRequest, request: Request) -> Response:
    """Keep ``count`` ready spares of ``spec`` for the tenant (0: none). An acquire of
    the same spec takes one at once; they count against the tenant's sandbox limit."""
    service(request).warm(tenant, body.spec, body.count)
    return Response(status_code=204)
