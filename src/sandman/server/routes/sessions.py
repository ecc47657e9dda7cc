"""``/v1/sessions``: a client's session, kept alive by heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from sandman.server.routes._deps import Tenant, errors, service
from sandman.server.schemas import SessionOut, SessionRequest

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.post(
    "", status_code=201, response_model=SessionOut, responses=errors("pool_closed", "shutting_down")
)
async def open_session(
    tenant: Tenant, request: Request, body: SessionRequest | None = None
) -> SessionOut:
    """Open a client session; heartbeat it within its lease or lose its sandboxes."""
    session, lease = service(request).open_session(tenant, body.lease_seconds if body else None)
    return SessionOut(id=session, lease_seconds=lease)


@router.post(
    "/{session_id}/heartbeat", response_model=SessionOut, responses=errors("session_expired")
)
async def heartbeat(tenant: Tenant, session_id: str, request: Request) -> SessionOut:
    """Extend the session's lease."""
    lease = service(request).heartbeat(tenant, session_id)
    return SessionOut(id=session_id, lease_seconds=lease)


@router.delete("/{session_id}", status_code=204, responses=errors("session_expired"))
async def close_session(tenant: Tenant, session_id: str, request: Request) -> Response:
    """Close the session: its sandboxes are released, its waiting acquires end."""
    service(request).close_session(tenant, session_id)
    return Response(status_code=204)
