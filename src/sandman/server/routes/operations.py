"""``/v1/health`` and ``/metrics``: for load balancers and Prometheus."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from sandman._version import __version__
from sandman.server.metrics import CONTENT_TYPE, check_scrape
from sandman.server.routes._deps import metrics, service, settings
from sandman.server.schemas import HealthOut

router = APIRouter(tags=["operations"])


@router.get(
    "/v1/health", response_model=HealthOut,
    responses={503: {"model": HealthOut, "description": "shutting down"}},
)  # fmt: skip
async def health(request: Request) -> Any:
    """Whether the service takes requests (no key needed)."""
    svc = service(request)
    out = HealthOut(
        status="ok" if svc.accepting else "shutting_down", version=__version__,
        pool=svc.pool.config.name, provider=svc.pool.provider.name,
    )  # fmt: skip
    if not svc.accepting:
        return JSONResponse(out.model_dump(), status_code=503)
    return out


@router.get("/metrics", include_in_schema=False)
async def prometheus(request: Request) -> Response:
    check_scrape(
        request.headers.get("authorization"), settings(request), service(request).authenticate
    )
    return Response(metrics(request).render(), media_type=CONTENT_TYPE)
