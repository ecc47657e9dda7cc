"""``/v1/dashboard``: what the live page at ``/`` shows (the page itself is
`sandman.server.dashboard.install_page`)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request

from sandman.server.routes._deps import Tenant, errors, sampler, service
from sandman.server.schemas import DashboardOut, SandboxPage

router = APIRouter(tags=["operations"])


@router.get("/v1/dashboard", response_model=DashboardOut, responses=errors())
async def dashboard(
    tenant: Tenant, request: Request, seconds: Annotated[int, Query(ge=10, le=3600)] = 300
) -> DashboardOut:
    """What the page at ``/`` shows: the pool over the last ``seconds`` (pool-wide
    numbers), the caller's sandboxes per image and its recent errors."""
    return sampler(request).view(tenant, now=time.time(), seconds=seconds)


@router.get("/v1/dashboard/sandboxes", response_model=SandboxPage, responses=errors())
async def sandboxes(
    tenant: Tenant,
    request: Request,
    page: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    size: Annotated[int, Query(ge=1, le=500)] = 50,
) -> SandboxPage:
    """A page of the caller's live sandboxes, oldest first: state, age, image, and the
    CPU seconds and memory each uses now."""
    return await service(request).page(tenant, page, size)
