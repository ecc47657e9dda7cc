"""The daemon proxy: ``/v1/sandboxes/{id}/daemon/{path}`` forwarded to the sandbox's daemon.

For clients that cannot reach sandboxes themselves (no route to pod IPs, not on
the machine of the unix socket). The caller authenticates with its API key;
the proxy adds the sandbox's own daemon token. Method, query, body and the
response (status, headers, body) pass through as streams, so streamed exec
output arrives as it happens and large archives are not buffered.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandman import errors
from sandman._transport import ConnectionLost, UntrustedPeer, check_peer
from sandman.daemon.tunnel import Dialer, Refused
from sandman.pool import PoolEvent, Record
from sandman.providers.base import DaemonEndpoint
from sandman.server.duplex import DuplexResponse
from sandman.server.errors import ApiError, from_exception

__all__ = ["Forwarder"]

# Hop-by-hop headers (RFC 9110 7.6.1), and those the proxy sets itself.
_DROP_REQUEST = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "authorization",
        "cookie",
    }
)
_DROP_RESPONSE = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


@dataclass(eq=False)
class _Upstream:
    """A kept-alive client of one daemon socket (or of every TCP daemon), shared by requests."""

    client: httpx.AsyncClient
    sandbox: str | None = None  # whose daemon socket; None: every TCP daemon's
    users: int = 0
    evicted: bool = False


# Events after which nobody will reach a sandbox's daemon again.
_GONE = frozenset({"sandbox.released", "sandbox.lost", "delete.complete"})


class Forwarder:
    """Forwards requests to daemons over kept-alive connections.

    A fresh httpx client per request would build an SSL context and open a
    connection each time (tens of ms); these are reused. Unix-socket clients
    are kept for the ``max_sockets`` most recently used sandboxes; one that
    falls out, or whose sandbox is released or lost (`hook`), is closed once
    its last request is done.
    """

    def __init__(self, *, max_body: int, connect_timeout: float, max_sockets: int = 256) -> None:
        self.max_body = max_body
        self._connect_timeout = connect_timeout
        self._timeout = httpx.Timeout(None, connect=connect_timeout)
        self._max_sockets = max_sockets
        self._sockets: OrderedDict[tuple[str, int | None], _Upstream] = OrderedDict()
        self._keys: dict[str, tuple[str, int | None]] = {}  # sandbox id -> its key in _sockets
        self._tcp: _Upstream | None = None

    def _new(self, uds: str | None, peer_pid: int | None = None) -> _Upstream:
        # No TLS to daemons: verify=False skips loading a CA bundle.
        transport = httpx.AsyncHTTPTransport(uds=uds, verify=False)
        if uds is not None and peer_pid is not None:
            # httpx takes no network backend; its pool is rebuilt with ours,
            # with httpx's own defaults (tests/server prove the check holds).
            transport._pool = httpcore.AsyncConnectionPool(
                uds=uds,
                max_connections=100,
                max_keepalive_connections=20,
                keepalive_expiry=5.0,
                network_backend=_PeerChecked(peer_pid),
            )
        return _Upstream(httpx.AsyncClient(transport=transport, timeout=self._timeout))

    def _acquire(self, sandbox_id: str, endpoint: DaemonEndpoint) -> _Upstream:
        if endpoint.uds is None:
            if self._tcp is None:
                self._tcp = self._new(None)
            upstream = self._tcp
        else:
            key = (endpoint.uds, endpoint.pid)
            found = self._sockets.get(key)
            if found is None:
                found = self._sockets[key] = self._new(endpoint.uds, endpoint.pid)
                found.sandbox = sandbox_id
                self._keys[sandbox_id] = key
                while len(self._sockets) > self._max_sockets:
                    _, old = self._sockets.popitem(last=False)
                    self._evict(old)
            self._sockets.move_to_end(key)
            upstream = found
        upstream.users += 1
        return upstream

    def _evict(self, upstream: _Upstream) -> None:
        upstream.evicted = True
        if upstream.sandbox is not None:
            self._keys.pop(upstream.sandbox, None)
        if upstream.users == 0:
            self._close_later(upstream)

    def forget(self, sandbox_id: str) -> None:
        """Close the connections kept to a sandbox's daemon (after its requests in flight).

        Nobody reuses them once it is released, and httpcore expires an idle
        connection only when its pool is used again: without this each
        released sandbox would keep a descriptor here (up to ``max_sockets``).
        """
        key = self._keys.get(sandbox_id)
        upstream = self._sockets.pop(key, None) if key is not None else None
        if upstream is not None:
            self._evict(upstream)

    def hook(self, event: PoolEvent) -> None:
        """A pool event hook: `forget` a sandbox released, lost or deleted."""
        if event.name in _GONE and event.sandbox_id is not None:
            self.forget(event.sandbox_id)

    async def _release(self, upstream: _Upstream) -> None:
        upstream.users -= 1
        if upstream.evicted and upstream.users == 0:
            await upstream.client.aclose()

    def _close_later(self, upstream: _Upstream) -> None:
        task = asyncio.ensure_future(upstream.client.aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def aclose(self) -> None:
        """Close every kept connection (at the service's shutdown)."""
        upstreams = [*self._sockets.values(), *([self._tcp] if self._tcp else [])]
        self._sockets.clear()
        self._keys.clear()
        self._tcp = None
        for upstream in upstreams:
            await upstream.client.aclose()

    async def forward(self, record: Record, request: Request, path: str) -> Response:
        """Send ``request`` on to the daemon of ``record`` at ``/path``; stream its answer back."""
        endpoint = _running(record)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError("body_too_large", f"the body is larger than {self.max_body} bytes")
        if endpoint.uds is not None:
            base = "http://sandmand"
        else:
            host = f"[{endpoint.host}]" if endpoint.host and ":" in endpoint.host else endpoint.host
            base = f"http://{host}:{endpoint.port}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers["authorization"] = f"Bearer {endpoint.token}"
        has_body = request.method not in _BODILESS or (length is not None and length != "0")
        url = f"{base}/{path.lstrip('/')}"
        if request.url.query:
            url = f"{url}?{request.url.query}"
        upstream = self._acquire(record.id, endpoint)
        client = upstream.client
        body_read = asyncio.Event()
        if not has_body:
            body_read.set()
        outgoing = client.build_request(
            request.method,
            url,
            headers=headers,
            content=_limited(request, self.max_body, body_read) if has_body else None,
        )
        try:
            answer = await _unless_caller_left(
                client.send(outgoing, stream=True), request, body_read
            )
            if answer is None:
                await self._release(upstream)
                return Response(status_code=_CLIENT_CLOSED)
        except UntrustedPeer as exc:
            await self._release(upstream)
            raise ApiError("untrusted_daemon", str(exc)) from exc
        except httpx.TransportError as exc:
            await self._release(upstream)
            raise ApiError(
                "daemon_unavailable", f"cannot reach the daemon of {record.id}: {exc}"
            ) from exc
        except BaseException:
            await self._release(upstream)
            raise
        done = False

        async def close() -> None:
            nonlocal done
            if not done:
                done = True
                await answer.aclose()
                await self._release(upstream)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            except httpx.TransportError:
                # The daemon went away mid-answer: end the body (the client sees it short).
                return
            finally:
                await close()

        out = {k: v for k, v in answer.headers.items() if k.lower() not in _DROP_RESPONSE}
        return StreamingResponse(
            body(), status_code=answer.status_code, headers=out, background=BackgroundTask(close)
        )

    async def connect_port(self, record: Record, port: int) -> Response:
        """``port`` of ``record``'s sandbox, carried both ways over the caller's exchange.

        The daemon is asked with its own upgrade on a connection of its own
        (never pooled); its refusal (``connection_refused``...) is passed back
        as it sent it, before any byte of the port's.
        """
        endpoint = _running(record)
        dialer = Dialer(
            uds=endpoint.uds,
            host=endpoint.host,
            port=endpoint.port,
            headers={"Authorization": f"Bearer {endpoint.token}"},
            peer_pid=endpoint.pid,
            connect_timeout=self._connect_timeout,
        )
        response = DuplexResponse()
        try:
            await response.open(dialer, port)
        except Refused as exc:
            return Response(exc.body, status_code=exc.status, media_type="application/json")
        except UntrustedPeer as exc:
            raise ApiError("untrusted_daemon", str(exc)) from exc
        except (ConnectionLost, OSError) as exc:  # TimeoutError among them
            raise ApiError(
                "daemon_unavailable", f"cannot reach the daemon of {record.id}: {exc}"
            ) from exc
        return response


def _running(record: Record) -> DaemonEndpoint:
    """The daemon of a sandbox that runs for its holder; the error to answer otherwise."""
    endpoint = record.info.endpoint if record.info is not None else None
    if record.lost is not None:
        lost = errors.SandboxLost.of(record.id, record.lost.reason, record.lost.detail)
        raise from_exception(lost)
    if endpoint is None or record.state != "leased":
        raise ApiError("sandbox_not_found", f"sandbox {record.id} is not running")
    return endpoint


class _PeerChecked(httpcore.AsyncNetworkBackend):
    """httpcore's backend, refusing a unix-socket peer other than the daemon's process."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_unix_socket(path, timeout, socket_options)
        try:
            check_peer(stream.get_extra_info("socket"), self._pid, path)
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# Closes of evicted clients in flight (a reference, so they are not collected early).
_closing: set[asyncio.Future[None]] = set()


async def _limited(request: Request, max_body: int, read: asyncio.Event) -> AsyncIterator[bytes]:
    """The request's body, refused past ``max_body``; sets ``read`` once it is all read."""
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_body:
            raise ApiError("body_too_large", f"the body is larger than {max_body} bytes")
        if chunk:
            yield chunk
    read.set()


# What the log shows for a request whose caller left before the daemon answered
# (nginx's "client closed request"); nobody receives it.
_CLIENT_CLOSED = 499


async def _caller_left(request: Request, body_read: asyncio.Event) -> None:
    """Return once the caller has disconnected (asked only once its body is read)."""
    await body_read.wait()
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # a bodiless request's one empty body message
    except Exception:  # noqa: BLE001 - no way to tell: wait for the daemon's answer
        await asyncio.Event().wait()


async def _unless_caller_left(
    sending: Coroutine[Any, Any, httpx.Response], request: Request, body_read: asyncio.Event
) -> httpx.Response | None:
    """The daemon's answer (its head), or None when the caller left first.

    A plain exec answers only once its command has ended: if the caller gives
    up before, the request to the daemon is cancelled, which closes that
    connection, and the daemon kills the command as it would for a caller of
    its own. (Once the answer streams, the response notices the caller leave.)
    """
    send = asyncio.ensure_future(sending)
    left = asyncio.ensure_future(_caller_left(request, body_read))
    try:
        await asyncio.wait({send, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not send.done():
            send.cancel()
        await asyncio.wait({send, left})
    if left.cancelled():
        return send.result()  # the caller is still there
    if not send.cancelled() and send.exception() is None:
        await send.result().aclose()  # it came too late for anyone
    return None
