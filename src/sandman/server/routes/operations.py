"""``/v1/health``, ``/v1/ready``, ``/v1/live`` and ``/metrics``: for load balancers,
Kubernetes' probes and Prometheus.

``/v1/ready`` is the readiness probe: 200 while acquires can be served (the pool
started, the provider answered within two reconcile passes, not shutting down: it
turns 503 at SIGTERM). ``/v1/live`` is the liveness probe: 200 whenever the event
loop answers it, unless one of the pool's background loops ended by itself; it never
depends on the provider, whose slowness must not restart every replica at once.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from sandman._version import __version__
from sandman.server.metrics import CONTENT_TYPE, check_scrape
from sandman.server.routes._deps import metrics, service, settings
from sandman.server.schemas import HealthOut, LiveOut, ReadyOut

router = APIRouter(tags=["operations"])


@router.get(
    "/v1/health",
    response_model=HealthOut,
    responses={503: {"model": HealthOut, "description": "shutting down"}},
)
async def health(request: Request) -> Any:
    """Whether the service takes requests (no key needed)."""
    svc = service(request)
    out = HealthOut(
        status="ok" if svc.accepting else "shutting_down",
        version=__version__,
        pool=svc.pool.config.name,
        provider=svc.pool.provider.name,
    )
    if not svc.accepting:
        return JSONResponse(out.model_dump(), status_code=503)
    return out


@router.get(
    "/v1/ready",
    response_model=ReadyOut,
    responses={503: {"model": ReadyOut, "description": "not ready, with the reasons"}},
)
async def ready(request: Request) -> Any:
    """Whether acquires can be served now (no key needed): the readiness probe."""
    reasons = service(request).unready()
    return _probe(ReadyOut(status="not_ready" if reasons else "ready", reasons=reasons))


@router.get(
    "/v1/live",
    response_model=LiveOut,
    responses={503: {"model": LiveOut, "description": "a background loop stopped"}},
)
async def live(request: Request) -> Any:
    """Whether the process is worth keeping (no key needed): the liveness probe."""
    reasons = service(request).unlive()
    return _probe(LiveOut(status="stopped" if reasons else "alive", reasons=reasons))


def _probe(out: ReadyOut | LiveOut) -> Any:
    """``out`` as a probe reads it: 200 without reasons, else 503 with them."""
    return JSONResponse(out.model_dump(), 503) if out.reasons else out


@router.get("/metrics", include_in_schema=False)
async def prometheus(request: Request) -> Response:
    check_scrape(
        request.headers.get("authorization"), settings(request), service(request).authenticate
    )
    return Response(metrics(request).render(), media_type=CONTENT_TYPE)
