"""The daemon proxy: ``/v1/sandboxes/{id}/daemon/{path}`` forwarded to the sandbox's daemon.

For clients that cannot reach sandboxes themselves (no route to pod IPs, not on
the machine of the unix socket). The caller authenticates with its API key;
the proxy adds the sandbox's own daemon token. Method, query, body and the
response (status, headers, body) pass through as streams, so streamed exec
output arrives as it happens and large archives are not buffered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandman.pool import Record
from sandman.server.errors import ApiError

__all__ = ["forward"]

# Hop-by-hop headers (RFC 9110 7.6.1), and those the proxy sets itself.
_DROP_REQUEST = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "authorization", "cookie",
})  # fmt: skip
_DROP_RESPONSE = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
})  # fmt: skip
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


async def forward(
    record: Record,
    request: Request,
    path: str,
    *,
    max_body: int,
    connect_timeout: float,
) -> Response:
    """Send ``request`` on to the daemon of ``record`` at ``/path``; stream its answer back."""
    endpoint = record.info.endpoint if record.info is not None else None
    if endpoint is None or record.state != "leased":
        raise ApiError("sandbox_not_found", f"sandbox {record.id} is not running")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_body:
        raise ApiError("body_too_large", f"the body is larger than {max_body} bytes")
    if endpoint.uds is not None:
        transport = httpx.AsyncHTTPTransport(uds=endpoint.uds)
        base = "http://sandmand"
    else:
        transport = httpx.AsyncHTTPTransport()
        host = f"[{endpoint.host}]" if endpoint.host and ":" in endpoint.host else endpoint.host
        base = f"http://{host}:{endpoint.port}"
    client = httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(None, connect=connect_timeout)
    )
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
    headers["authorization"] = f"Bearer {endpoint.token}"
    has_body = request.method not in _BODILESS or (length is not None and length != "0")
    url = f"{base}/{path.lstrip('/')}"
    if request.url.query:
        url = f"{url}?{request.url.query}"
    outgoing = client.build_request(
        request.method, url, headers=headers,
        content=_limited(request, max_body) if has_body else None,
    )  # fmt: skip
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.TransportError as exc:
        await client.aclose()
        raise ApiError(
            "daemon_unavailable", f"cannot reach the daemon of {record.id}: {exc}"
        ) from exc
    except BaseException:
        await client.aclose()
        raise

    async def close() -> None:
        await upstream.aclose()
        await client.aclose()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError:
            # The daemon went away mid-answer: end the body (the client sees it short).
            return
        finally:
            await close()

    out = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    return StreamingResponse(
        body(), status_code=upstream.status_code, headers=out, background=BackgroundTask(close)
    )


async def _limited(request: Request, max_body: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_body:
            raise ApiError("body_too_large", f"the body is larger than {max_body} bytes")
        if chunk:
            yield chunk
