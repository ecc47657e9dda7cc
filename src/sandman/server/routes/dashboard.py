"""``/v1/dashboard``: what the live page at ``/`` shows (the page itself is
`sandman.server.dashboard.install_page`)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request

from sandman.server.routes._deps import Tenant, errors, sampler
from sandman.server.schemas import DashboardOut

router = APIRouter(tags=["operations"])


@router.get("/v1/dashboard", response_model=DashboardOut, responses=errors())
async def dashboard(
    tenant: Tenant, request: Request, seconds: Annotated[int, Query(ge=10, le=3600)] = 300
) -> DashboardOut:
    """What the page at ``/`` shows: the pool over the last ``seconds`` (pool-wide
    numbers), the caller's sandboxes per image and its recent errors."""
    return sampler(request).view(tenant, now=time.time(), seconds=seconds)
