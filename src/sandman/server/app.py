"""``create_app(pool, settings)``: the HTTP service, an adapter over one `Pool`.

JSON API under ``/v1/`` (its OpenAPI document at ``/v1/openapi.json``),
Prometheus metrics at ``/metrics``, a live dashboard page at ``/``
(`sandman.server.dashboard`). Every answer but health, metrics (unless
``ServerSettings.metrics_key`` is set), the OpenAPI document and the dashboard
page itself (not its data) needs
``Authorization: Bearer <API key>``; a key acts for
one tenant and sees only that tenant's sessions and sandboxes. Errors are
``{"error": {"code", "message"}}`` with a stable ``code``
(`sandman.server.errors.STATUS`).
"""

import contextlib
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandman._version import __version__
from sandman.pool import Pool
from sandman.pool.records import State
from sandman.server import proxy
from sandman.server.dashboard import Sampler, install_page
from sandman.server.errors import STATUS, ApiError
from sandman.server.metrics import CONTENT_TYPE, Metrics, check_scrape
from sandman.server.schemas import (
    AcquireRequest,
    DashboardOut,
    ErrorBody,
    HealthOut,
    SandboxList,
    SandboxOut,
    SessionOut,
    SessionRequest,
    sandbox_out,
)
from sandman.server.service import ClientGone, Service
from sandman.server.settings import ServerSettings

__all__ = ["create_app", "service_of"]

_PROXY_PATH = re.compile(r"^/v1/sandboxes/[^/]+/daemon(/|$)")
_BY_STATUS = {400: "malformed_json", 401: "unauthorized", 404: "not_found",
              405: "method_not_allowed", 413: "body_too_large"}  # fmt: skip
# Answered to a client that went away while its acquire waited (nginx's convention);
# nobody reads it.
CLIENT_CLOSED_REQUEST = 499


def _errors(*codes: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error codes (grouped by status)."""
    by_status: dict[int, list[str]] = {}
    for code in ("unauthorized", "invalid_request", "malformed_json", "body_too_large", *codes):
        by_status.setdefault(STATUS[code], []).append(code)
    return {
        status: {"model": ErrorBody, "description": "error codes: " + ", ".join(sorted(set(cs)))}
        for status, cs in sorted(by_status.items())
    }


def service_of(app: FastAPI) -> Service:
    """The `Service` behind an app made by `create_app` (e.g. to call ``shutdown``)."""
    service: Service = app.state.service
    return service


def create_app(pool: Pool, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP service over ``pool`` (the same object an embedded client would use).

    Run it with uvicorn. With ``settings.close_pool`` (the default) its
    lifespan starts the pool and, at shutdown, stops accepting, lets acquires
    in flight be answered and closes the pool (releasing every sandbox, or
    leaving them to the next instance: ``settings.release_on_shutdown``).
    """
    settings = settings or ServerSettings()
    service = Service(pool, settings)
    metrics = Metrics(pool, service.queue_depths, tenant_labels=settings.metrics_tenant_labels)
    pool.add_hook(metrics.hook)
    forwarder = proxy.Forwarder(
        max_body=settings.max_proxy_body_bytes, connect_timeout=settings.proxy_connect_timeout
    )
    sampler = Sampler(pool, queue_depths=service.queue_depths, admins=settings.admin_tenants)
    pool.add_hook(sampler.hook)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.close_pool:
            await pool.start()
        try:
            yield
        finally:
            if settings.close_pool:
                await service.shutdown()
            await sampler.aclose()
            await forwarder.aclose()

    app = FastAPI(
        title="Sandman",
        version=__version__,
        summary="Sandboxes for agentic RL: acquire, release, and reach their daemons.",
        openapi_url="/v1/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.metrics = metrics
    app.state.dashboard = sampler
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    bearer = HTTPBearer(auto_error=False, description="An API key; each is bound to one tenant.")

    # Async although it never awaits: FastAPI runs a plain-def dependency in its
    # thread pool, and that hop was most of the app's time per request
    # (heartbeat 260 -> 100 us in-process, more across a loaded machine).
    async def authenticate(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
    ) -> str:
        return service.authenticate(request.headers.get("authorization"))

    Tenant = Annotated[str, Depends(authenticate)]

    # -- sessions -------------------------------------------------------------------

    @app.post(
        "/v1/sessions", status_code=201, response_model=SessionOut, tags=["sessions"],
        responses=_errors("pool_closed", "shutting_down"),
    )  # fmt: skip
    async def open_session(tenant: Tenant, body: SessionRequest | None = None) -> SessionOut:
        """Open a client session; heartbeat it within its lease or lose its sandboxes."""
        session, lease = service.open_session(tenant, body.lease_seconds if body else None)
        return SessionOut(id=session, lease_seconds=lease)

    @app.post(
        "/v1/sessions/{session_id}/heartbeat", response_model=SessionOut, tags=["sessions"],
        responses=_errors("session_expired"),
    )  # fmt: skip
    async def heartbeat(tenant: Tenant, session_id: str) -> SessionOut:
        """Extend the session's lease."""
        lease = service.heartbeat(tenant, session_id)
        return SessionOut(id=session_id, lease_seconds=lease)

    @app.delete(
        "/v1/sessions/{session_id}", status_code=204, tags=["sessions"],
        responses=_errors("session_expired"),
    )  # fmt: skip
    async def close_session(tenant: Tenant, session_id: str) -> Response:
        """Close the session: its sandboxes are released, its waiting acquires end."""
        service.close_session(tenant, session_id)
        return Response(status_code=204)

    # -- sandboxes --------------------------------------------------------------------

    @app.post(
        "/v1/sandboxes", status_code=201, response_model=SandboxOut, tags=["sandboxes"],
        responses=_errors(
            "session_expired", "image_not_found", "image_error", "tenant_sandbox_limit",
            "tenant_pending_limit", "provider_error", "capacity", "throttled", "pool_closed",
            "shutting_down", "create_timeout",
        ),
    )  # fmt: skip
    async def acquire(tenant: Tenant, body: AcquireRequest, request: Request) -> Any:
        """Acquire a ready sandbox for a session: waits up to ``timeout`` seconds.

        The answer holds the daemon's endpoint and token. If the HTTP client
        goes away while waiting, the acquire is cancelled and the pool hands
        the sandbox to the next waiter, or deletes it.
        """
        started = time.monotonic()
        try:
            record = await service.acquire(tenant, body, lambda: _disconnected(request))
        except ApiError as exc:
            metrics.observe_acquire(started, exc.code)
            sampler.refused(tenant, exc.code, exc.message, image=body.spec.image)
            raise
        except ClientGone:
            metrics.observe_acquire(started, "client_gone")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        metrics.observe_acquire(started, "ok")
        return sandbox_out(record, endpoint=True)

    @app.get("/v1/sandboxes", response_model=SandboxList, tags=["sandboxes"], responses=_errors())
    async def list_sandboxes(
        tenant: Tenant,
        session: Annotated[str | None, Query(max_length=128)] = None,
        state: State | None = None,
        image: Annotated[str | None, Query(max_length=4096)] = None,
    ) -> SandboxList:
        """The tenant's sandboxes (those recently gone too), filtered."""
        records = service.list(tenant, session=session, state=state, image=image)
        return SandboxList(sandboxes=[sandbox_out(r) for r in records])

    @app.get(
        "/v1/sandboxes/{sandbox_id}", response_model=SandboxOut, tags=["sandboxes"],
        responses=_errors("sandbox_not_found", "provider_error"),
    )  # fmt: skip
    async def get_sandbox(tenant: Tenant, sandbox_id: str, probe: bool = False) -> SandboxOut:
        """One of the tenant's sandboxes: state, timeline, endpoint and token.

        With ``probe``, ``running`` says whether the backend has it running now.
        """
        record = service.sandbox(tenant, sandbox_id)
        running = await service.running(record) if probe else None
        return sandbox_out(record, endpoint=True, running=running)

    @app.delete(
        "/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"],
        responses=_errors("sandbox_not_found"),
    )  # fmt: skip
    async def release(tenant: Tenant, sandbox_id: str) -> Response:
        """Release the sandbox; it is deleted in the background. Idempotent."""
        service.release(tenant, sandbox_id)
        return Response(status_code=204)

    async def daemon(tenant: Tenant, sandbox_id: str, path: str, request: Request) -> Response:
        """The sandbox's daemon protocol (``/v1/exec``, ``/v1/files``...), proxied.

        Method, query, body and answer pass through as streams; the proxy adds
        the daemon's token. The daemon's own errors come back as it sent them. A
        sandbox that died by itself is ``sandbox_lost`` (410, with its ``reason``).
        """
        record = service.sandbox(tenant, sandbox_id)
        try:
            return await forwarder.forward(record, request, path)
        except ApiError as exc:
            if exc.code != "daemon_unavailable":
                raise
            # Its daemon does not answer: dead (asked now), or only unreachable?
            await service.running(record)
            if record.lost is not None:
                raise service.lost_error(record) from exc
            raise

    for method in ("GET", "POST", "PUT", "DELETE"):
        app.add_api_route(
            "/v1/sandboxes/{sandbox_id}/daemon/{path:path}", daemon, methods=[method],
            operation_id=f"daemon_{method.lower()}", tags=["daemon"],
            responses={
                200: {"description": "the daemon's answer, passed through",
                      "content": {"*/*": {}}},
                **_errors("sandbox_not_found", "sandbox_lost", "daemon_unavailable"),
            },
        )  # fmt: skip

    # -- operations ---------------------------------------------------------------------

    @app.get(
        "/v1/health", response_model=HealthOut, tags=["operations"],
        responses={503: {"model": HealthOut, "description": "shutting down"}},
    )  # fmt: skip
    async def health() -> Any:
        """Whether the service takes requests (no key needed)."""
        out = HealthOut(
            status="ok" if service.accepting else "shutting_down", version=__version__,
            pool=pool.config.name, provider=pool.provider.name,
        )  # fmt: skip
        if not service.accepting:
            return JSONResponse(out.model_dump(), status_code=503)
        return out

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(request: Request) -> Response:
        check_scrape(request.headers.get("authorization"), settings, service.authenticate)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/dashboard", response_model=DashboardOut, tags=["operations"], responses=_errors())
    async def dashboard(
        tenant: Tenant, seconds: Annotated[int, Query(ge=10, le=3600)] = 300
    ) -> DashboardOut:
        """What the page at ``/`` shows: the pool over the last ``seconds`` (pool-wide
        numbers), the caller's sandboxes per image and its recent errors."""
        return sampler.view(tenant, now=time.time(), seconds=seconds)

    install_page(app)

    return app


async def _disconnected(request: Request) -> None:
    """Return once the HTTP client has gone away (its body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _error(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"error": {"code": code, "message": message}}, status_code=status, headers=headers
    )


def _refused(request: Request, code: str, message: str) -> None:
    """Show a refused request on its tenant's dashboard; one without a valid key on none."""
    with contextlib.suppress(ApiError):
        tenant = service_of(request.app).authenticate(request.headers.get("authorization"))
        sampler: Sampler = request.app.state.dashboard
        sampler.refused(tenant, code, f"{request.method} {request.url.path}: {message}")


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        problems = list(exc.errors())
        if any(p.get("type") == "json_invalid" for p in problems):
            _refused(request, "malformed_json", "the body is not valid JSON")
            return _error("malformed_json", "the body is not valid JSON", 400)
        parts = []
        for p in problems[:5]:
            where = ".".join(str(x) for x in p.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {p.get('msg', 'invalid')}")
        message = "; ".join(parts) or "invalid request"
        _refused(request, "invalid_request", message)
        return _error("invalid_request", message, 422)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = _BY_STATUS.get(exc.status_code, "invalid_request")
        return _error(code, str(exc.detail), exc.status_code, dict(exc.headers or {}))

    async def internal(_: Request, exc: Exception) -> Response:
        return _error("internal", f"internal error: {type(exc).__name__}", 500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal)


class BodyLimit:
    """Refuse JSON API bodies larger than ``max_bytes`` with 413 before any handler runs.

    The body is read (at most ``max_bytes``) and replayed to the app; the
    daemon proxy route streams its bodies and checks its own limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _PROXY_PATH.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # disconnected: let the app see it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Built only when needed: not a JSON response rendered for every request.
        too_large = _error("body_too_large", f"the body is larger than {self.max_bytes} bytes", 413)
        await too_large(scope, receive, send)
