"""``create_app(pool, settings)``: the HTTP service, an adapter over one `Pool`.

JSON API under ``/v1/`` (its OpenAPI document at ``/v1/openapi.json``),
Prometheus metrics at ``/metrics``, a live dashboard page at ``/``
(`sandman.server.dashboard`). Every answer but health, the probes (``/v1/ready``,
``/v1/live``), metrics (unless
``ServerSettings.metrics_key`` is set), the OpenAPI document and the dashboard
page itself (not its data) needs
``Authorization: Bearer <API key>``; a key acts for
one tenant and sees only that tenant's sessions and sandboxes. Errors are
``{"error": {"code", "message"}}`` with a stable ``code``
(`sandman.server.errors.STATUS`).
"""

import contextlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandman._version import __version__
from sandman.pool import Pool
from sandman.server import proxy
from sandman.server.dashboard import Sampler, install_page
from sandman.server.errors import ApiError
from sandman.server.metrics import Metrics
from sandman.server.routes import ROUTERS, run_code
from sandman.server.service import Service
from sandman.server.settings import ServerSettings

__all__ = ["create_app", "service_of"]

_PROXY_PATH = re.compile(r"^/v1/sandboxes/[^/]+/daemon(/|$)")
_BY_STATUS = {400: "malformed_json", 401: "unauthorized", 404: "not_found",
              405: "method_not_allowed", 413: "body_too_large"}  # fmt: skip


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
    The routes are in `sandman.server.routes`, one router per resource; they
    reach what is built here through ``app.state``.
    """
    settings = settings or ServerSettings()
    service = Service(pool, settings)
    metrics = Metrics(pool, service.queue_depths, tenant_labels=settings.metrics_tenant_labels)
    pool.add_hook(metrics.hook)
    forwarder = proxy.Forwarder(
        max_body=settings.max_proxy_body_bytes, connect_timeout=settings.proxy_connect_timeout
    )
    pool.add_hook(forwarder.hook)
    sampler = Sampler(pool, queue_depths=service.queue_depths, admins=settings.admin_tenants)
    pool.add_hook(sampler.hook)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.close_pool:
            await pool.start()
        for spares in settings.warm:
            service.warm(spares.tenant, spares.spec, spares.count)
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
    app.state.forwarder = forwarder
    app.state.settings = settings
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(run_code.router)  # SandboxFusion's API, at the root
    install_page(app)
    return app


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
