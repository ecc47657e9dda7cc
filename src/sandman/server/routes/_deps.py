"""What every router shares: the objects on the app's state, authentication, error docs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from sandman.server.dashboard import Sampler
from sandman.server.errors import STATUS
from sandman.server.metrics import Metrics
from sandman.server.proxy import Forwarder
from sandman.server.schemas import ErrorBody
from sandman.server.service import Service
from sandman.server.settings import ServerSettings

__all__ = ["Tenant", "errors", "forwarder", "metrics", "sampler", "service", "settings"]


def service(request: Request) -> Service:
    """The `Service` of the app serving ``request``."""
    found: Service = request.app.state.service
    return found


def metrics(request: Request) -> Metrics:
    found: Metrics = request.app.state.metrics
    return found


def sampler(request: Request) -> Sampler:
    found: Sampler = request.app.state.dashboard
    return found


def forwarder(request: Request) -> Forwarder:
    found: Forwarder = request.app.state.forwarder
    return found


def settings(request: Request) -> ServerSettings:
    found: ServerSettings = request.app.state.settings
    return found


_bearer = HTTPBearer(auto_error=False, description="An API key; each is bound to one tenant.")


# Async although it never awaits: FastAPI runs a plain-def dependency in its
# thread pool, and that hop was most of the app's time per request
# (heartbeat 260 -> 100 us in-process, more across a loaded machine).
async def _authenticate(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> str:
    return service(request).authenticate(request.headers.get("authorization"))


Tenant = Annotated[str, Depends(_authenticate)]
"""The caller's tenant, from its API key (``unauthorized`` without a valid one)."""


def errors(*codes: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error codes (grouped by status)."""
    by_status: dict[int, list[str]] = {}
    for code in ("unauthorized", "invalid_request", "malformed_json", "body_too_large", *codes):
        by_status.setdefault(STATUS[code], []).append(code)
    return {
        status: {"model": ErrorBody, "description": "error codes: " + ", ".join(sorted(set(cs)))}
        for status, cs in sorted(by_status.items())
    }
