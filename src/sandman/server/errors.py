"""The service's errors on the wire: ``{"error": {"code", "message"}}`` with a stable code.

Every code the service sends is in `STATUS`; the SDK maps codes back to the
package's exceptions with a dict (`sandman.client.remote.SERVICE_ERRORS`), so
the two tables are tested against each other.
"""

from __future__ import annotations

from sandman import errors

__all__ = ["STATUS", "ApiError", "from_exception"]

STATUS: dict[str, int] = {
    "unauthorized": 401,
    "malformed_json": 400,
    "invalid_request": 422,
    "body_too_large": 413,
    "not_found": 404,
    "method_not_allowed": 405,
    "sandbox_not_found": 404,
    "session_expired": 404,
    "image_not_found": 422,
    "image_error": 422,
    "tenant_sandbox_limit": 429,
    "tenant_pending_limit": 429,
    "provider_error": 502,
    "daemon_unavailable": 502,
    "capacity": 503,
    "throttled": 503,
    "pool_closed": 503,
    "shutting_down": 503,
    "create_timeout": 504,
    "internal": 500,
}
"""Every error code the service sends, and its HTTP status."""


class ApiError(Exception):
    """An error answer: raised anywhere in a handler, rendered by the app's handler."""

    def __init__(self, code: str, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = STATUS[code]
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


def from_exception(exc: errors.SandboxError) -> ApiError:
    """The wire form of a package error raised by the pool or a provider."""
    message = str(exc) or type(exc).__name__
    # Most specific first: the tree has subclasses of subclasses.
    if isinstance(exc, errors.CreateTimeout):
        return ApiError("create_timeout", message)
    if isinstance(exc, errors.ImageNotFound):
        return ApiError("image_not_found", message)
    if isinstance(exc, errors.ImageError):
        return ApiError("image_error", message)
    if isinstance(exc, errors.ThrottledError):
        after = exc.retry_after
        headers = {"Retry-After": str(max(1, round(after)))} if after is not None else None
        return ApiError("throttled", message, headers=headers)
    if isinstance(exc, errors.CapacityError):
        return ApiError("capacity", message, headers={"Retry-After": "1"})
    if isinstance(exc, errors.ProviderError):
        return ApiError("provider_error", message)
    if isinstance(exc, errors.SandboxNotFound):
        return ApiError("sandbox_not_found", message)
    if isinstance(exc, errors.PoolClosed):
        return ApiError("pool_closed", message)
    if isinstance(exc, errors.ConfigError):
        return ApiError("invalid_request", message)
    if isinstance(exc, errors.DaemonUnavailable):
        return ApiError("daemon_unavailable", message)
    return ApiError("internal", message)
