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
    "sandbox_lost": 410,
    "snapshot_not_found": 404,
    "sandbox_paused": 409,
    "tenant_snapshot_limit": 429,
    "session_expired": 404,
    "session_moving": 503,
    "image_not_found": 422,
    "image_error": 422,
    "tenant_sandbox_limit": 429,
    "tenant_pending_limit": 429,
    "provider_error": 502,
    "daemon_unavailable": 502,
    "untrusted_daemon": 502,
    "capacity": 503,
    "throttled": 503,
    "pool_closed": 503,
    "shutting_down": 503,
    "create_timeout": 504,
    "internal": 500,
}
"""Every error code the service sends, and its HTTP status."""


class ApiError(Exception):
    """An error answer: raised anywhere in a handler, rendered by the app's handler.

    ``reason`` goes with ``sandbox_lost``: why the sandbox died (`SandboxLost.reason`).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = STATUS[code]
        self.headers = headers or {}
        self.reason = reason

    def body(self) -> dict[str, dict[str, str]]:
        detail = {"code": self.code, "message": self.message}
        if self.reason is not None:
            detail["reason"] = self.reason
        return {"error": detail}


# Most specific first: the tree has subclasses of subclasses.
_CODES: tuple[tuple[type[errors.SandboxError], str], ...] = (
    (errors.CreateTimeout, "create_timeout"),
    (errors.ImageNotFound, "image_not_found"),
    (errors.ImageError, "image_error"),
    (errors.ThrottledError, "throttled"),
    (errors.CapacityError, "capacity"),
    (errors.ProviderError, "provider_error"),
    (errors.SessionExpired, "session_expired"),
    (errors.SandboxLost, "sandbox_lost"),
    (errors.SandboxNotFound, "sandbox_not_found"),
    (errors.SnapshotNotFound, "snapshot_not_found"),
    (errors.SandboxPaused, "sandbox_paused"),
    (errors.PoolClosed, "pool_closed"),
    (errors.ConfigError, "invalid_request"),
    (errors.DaemonUnavailable, "daemon_unavailable"),
)


def from_exception(exc: errors.SandboxError) -> ApiError:
    """The wire form of a package error raised by the pool or a provider."""
    message = str(exc) or type(exc).__name__
    code = next((code for kind, code in _CODES if isinstance(exc, kind)), "internal")
    headers = None
    if isinstance(exc, errors.ThrottledError) and exc.retry_after is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
    elif code == "capacity":
        headers = {"Retry-After": "1"}
    reason = exc.reason if isinstance(exc, errors.SandboxLost) else None
    return ApiError(code, message, headers=headers, reason=reason)
