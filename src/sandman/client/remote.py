"""``sandman.connect(url, api_key=...)``: a client whose sandboxes come from the HTTP service.

(About 720 lines, one protocol's client: each call maps the service's error
shapes to the same typed errors, and must agree with the service's routes.)

`RemoteBackend` implements the same `Backend` protocol as the in-process pool,
over the service's JSON API. Only sessions, acquire and release go to the
service; commands and files go straight to the daemon endpoint it returns.

The calls go through the transport seam (``sandman._transport``), over the
daemon client's lean keep-alive HTTP/1.1 transport, not httpx: an acquire or
release is a small JSON exchange, and httpx spent ~1 ms of client CPU on each
(several times the service's own work), which made most of the service's
per-request overhead against the embedded pool
(``benchmarks/service_overhead.py``). httpx is used only when the caller
passes an httpx transport (e.g. ``httpx.ASGITransport(app)`` in tests).

The service's stable error codes come back as the package's exceptions
through one dict, `SERVICE_ERRORS`; no class path is ever read from the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, urlencode

import anyio
from pydantic_core import to_json

from sandman import errors
from sandman._transport import AsyncTransport, ConnectionLost, HTTPTransport
from sandman.client._async import AsyncClient
from sandman.client._sync import Client
from sandman.client.backends import Lease
from sandman.daemon import DaemonClient
from sandman.egress import Egress
from sandman.models import SandboxSpec, Snapshot, Usage
from sandman.pool.events import EventHook
from sandman.providers.base import DaemonEndpoint

if TYPE_CHECKING:
    import httpx

__all__ = ["SERVICE_ERRORS", "ProxiedEndpoint", "RemoteBackend", "connect", "connect_sync"]

SERVICE_ERRORS: Mapping[str, type[errors.SandboxError]] = {
    "unauthorized": errors.ConfigError,
    "malformed_json": errors.ConfigError,
    "invalid_request": errors.ConfigError,
    "body_too_large": errors.ConfigError,
    "not_found": errors.ConfigError,
    "method_not_allowed": errors.ConfigError,
    "sandbox_not_found": errors.SandboxNotFound,
    "sandbox_lost": errors.SandboxLost,
    "snapshot_not_found": errors.SnapshotNotFound,
    "sandbox_paused": errors.SandboxPaused,
    "tenant_snapshot_limit": errors.CapacityError,
    "session_expired": errors.SessionExpired,
    "session_moving": errors.ThrottledError,  # to the next instance: retry after a moment
    "image_not_found": errors.ImageNotFound,
    "image_error": errors.ImageError,
    "tenant_sandbox_limit": errors.CapacityError,
    "tenant_pending_limit": errors.CapacityError,
    "provider_error": errors.ProviderError,
    "daemon_unavailable": errors.DaemonUnavailable,
    "untrusted_daemon": errors.UntrustedDaemon,
    "capacity": errors.CapacityError,
    "throttled": errors.ThrottledError,
    "pool_closed": errors.PoolClosed,
    "shutting_down": errors.PoolClosed,
    "create_timeout": errors.CreateTimeout,
    "internal": errors.ProviderError,
}
"""The service's error codes and the exception each one raises here."""

logger = logging.getLogger(__name__)

# Extra seconds the HTTP request of an acquire may take past the acquire's own deadline.
_ACQUIRE_SLACK = 30.0
# An acquire's request waits this long for its sandbox, then asks again with its ticket
# (`sandman.server.tickets`): thousands waiting are not thousands of open requests.
_ACQUIRE_POLL = 30.0
# How a service from before tickets refuses an acquire's ``wait`` (422, invalid_request).
_TICKETLESS = "wait: Extra inputs are not permitted"


@dataclass(frozen=True, slots=True)
class _Answer:
    """One answer of the service: status, headers (lower-case names), body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Wire:
    """Requests to the service through a transport; `errors.ProviderError` when they
    cannot reach it. ``timeout`` bounds the whole exchange."""

    def __init__(self, transport: AsyncTransport, where: str) -> None:
        self._http = transport
        self._where = where

    async def request(
        self, method: str, target: str, body: bytes | None, timeout: float | None
    ) -> _Answer:
        content_type = None if body is None else "application/json"
        try:
            async with asyncio.timeout(timeout):
                answer = await self._http.request(
                    method, target, body=body, content_type=content_type
                )
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise errors.ProviderError(
                f"the service at {self._where} did not answer within {timeout} s"
            ) from exc
        except (ConnectionLost, OSError) as exc:
            raise errors.ProviderError(
                f"cannot reach the service at {self._where}: {exc!r}"
            ) from exc
        return _Answer(answer.status, answer.headers, answer.body)

    async def aclose(self) -> None:
        await self._http.aclose()


def _lean(url: httpx.URL, headers: Mapping[str, str]) -> HTTPTransport:
    """The lean keep-alive HTTP/1.1 transport, to the service's address."""
    tls = url.scheme == "https"
    # The URL's own authority (brackets of an IPv6 literal included) as Host.
    fixed = {"Host": url.netloc.decode("ascii"), **headers}
    # httpx's TLS context: the same trust (certifi, SSL_CERT_FILE) as before.
    context = None
    if tls:
        import httpx  # only for https: `import sandman` loads no httpx

        context = httpx.create_ssl_context()
    return HTTPTransport(
        host=url.host,
        port=url.port or (443 if tls else 80),
        default_headers=fixed,
        prefix=url.path,
        ssl=context,
    )


def _segment(value: str) -> str:
    """An id as one path segment: nothing in it can end the request line or the path."""
    return quote(value, safe="")


def _retry_after(response: _Answer) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return float(value)
    except ValueError:
        return None


def _error(response: _Answer) -> errors.SandboxError:
    """The package's exception for an error answer of the service."""
    code, message, reason = "", "", None
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        detail = response.json()["error"]
        code, message = str(detail["code"]), str(detail["message"])
        reason = detail.get("reason")
    if not code:
        code = "internal" if response.status >= 500 else "invalid_request"
        text = response.body[:200].decode(errors="replace")
        message = f"the service answered {response.status}: {text}"
    cls = SERVICE_ERRORS.get(code, errors.SandboxError)
    text = f"{message} [{code}]"
    if cls is errors.ThrottledError:
        return errors.ThrottledError(text, retry_after=_retry_after(response))
    if cls is errors.SandboxLost:
        return errors.SandboxLost(text, reason=str(reason or "unknown"))
    if issubclass(cls, errors.DaemonError):
        return cls(message, code=code, status=response.status)
    return cls(text)


class ProxiedEndpoint(DaemonEndpoint):
    """A daemon reached through the service's proxy route (``/v1/sandboxes/{id}/daemon/``).

    ``host``/``port`` are the service's, ``token`` is the caller's API key (the
    service adds the daemon's own token), ``base_path`` the route.
    """

    base_path: str
    tls: bool = False

    def client(self, *, request_timeout: float = 60.0) -> DaemonClient:
        """A new client of the daemon, through the service; close it with ``aclose``."""
        return DaemonClient(
            host=self.host,
            port=self.port,
            token=self.token or None,
            request_timeout=request_timeout,
            base_path=self.base_path,
            ssl=ssl.create_default_context() if self.tls else None,
        )


_PROBE_TIMEOUT = 1.0
"""Seconds a first TCP connect to a sandbox may take before the proxy route is used."""


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _connects(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class RemoteBackend:
    """A `Backend` over the Sandman service at ``url`` (``sandman.connect``).

    ``transport`` is an httpx transport to use instead of the network (e.g.
    ``httpx.ASGITransport(app)`` in tests). ``via_proxy``: reach daemons through
    the service's proxy route always (True), never (False), or when their
    endpoint is not reachable from here (None): a unix socket of another
    machine, or pod IPs this process cannot connect to (tried once, within a
    second, and the answer kept for every sandbox after).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        via_proxy: bool | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        import httpx  # a URL parser; not loaded by `import sandman` (tests/test_layers.py)

        parsed = httpx.URL(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise errors.ConfigError(f"not a service URL: {url!r} (use http://HOST:PORT)")
        self._api_key = api_key or ""
        if not self._api_key.isascii() or not self._api_key.isprintable():
            # It goes into a header as is: nothing that could end the header line.
            raise errors.ConfigError("the API key must be printable ASCII")
        self._via_proxy = via_proxy
        self._tcp_direct: bool | None = None  # whether sandboxes' TCP endpoints connect
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._transport = transport
        self._parsed = parsed
        self._http = self._wire()
        # Per session, the sandboxes its caller got and has not released; the sessions an
        # acquire's answer may have been lost in (see `_settle`); acquires in flight per
        # session, and ever.
        self._held: dict[str, set[str]] = {}
        # Releases the service did not get (it was down): sent again with the next
        # heartbeat, else the sandbox stays leased to a live session with no holder.
        self._unreleased: set[str] = set()
        self._unsure: set[str] = set()
        self._acquiring: Counter[str] = Counter()
        self._acquires = 0
        # Whether the service waits acquires by ticket (None: not known yet; False: one
        # from before them, which refuses ``wait``, so each acquire's request is held open).
        self._tickets: bool | None = None

    def _wire(self) -> _Wire:
        if self._transport is not None:
            from sandman._transport.bridge import HttpxTransport

            over = HttpxTransport(self._transport, base_url=self._parsed, headers=self._headers)
            return _Wire(over, str(self._parsed))
        return _Wire(_lean(self._parsed, self._headers), str(self._parsed))

    def __repr__(self) -> str:
        return f"RemoteBackend({self.url!r})"

    @property
    def name(self) -> str:
        """The service's URL."""
        return self.url

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None | Literal["default"] = "default",
    ) -> _Answer:
        """One call; `errors.ProviderError` if the service cannot be reached, the
        package's exception for its error answers. ``timeout`` bounds the whole call."""
        if params:
            path = f"{path}?{urlencode(params)}"
        body = None if json is None else to_json(json)
        seconds = self._timeout if timeout == "default" else timeout
        response = await self._http.request(method, path, body, seconds)
        if response.status >= 400:
            raise _error(response)
        return response

    async def open_session(self) -> str:
        try:
            data = (await self._call("POST", "/v1/sessions", json={})).json()
        except errors.SandboxError:
            # ``async with connect(...)`` that fails here is never closed: leave no
            # connection open (a later call gets a fresh client).
            await self._http.aclose()
            self._http = self._wire()
            raise
        return str(data["id"])

    async def heartbeat(self, session: str) -> None:
        try:
            await self._call("POST", f"/v1/sessions/{_segment(session)}/heartbeat")
        except errors.SessionExpired:
            self._forget(session)
            raise
        for sandbox_id in list(self._unreleased):
            try:
                await self._release(sandbox_id)
            except errors.SandboxError as exc:
                logger.debug("deferred release of %s failed again: %s", sandbox_id, exc)
        if session in self._unsure and not self._acquiring[session]:
            try:
                await self._settle(session)
            except errors.SandboxError as exc:
                logger.debug("session %s: could not settle lost answers yet: %s", session, exc)

    def _forget(self, session: str) -> None:
        self._held.pop(session, None)
        self._unsure.discard(session)

    async def _settle(self, session: str) -> None:
        """Release what the service holds for ``session`` that never reached the caller.

        The service records a hand-over before it answers, so an answer lost on
        the way (the service killed just after, the connection cut) leaves a
        sandbox leased to this session that no one here holds, for as long as
        the session lives, a successor instance's adoption included. After such
        an acquire, once the service answers again and no acquire is in flight,
        this lists the session's sandboxes and gives back the strays.
        """
        started = self._acquires
        listed = await self._call(
            "GET", "/v1/sandboxes", params={"session": session, "state": "leased"}
        )
        if self._acquires != started or self._acquiring[session]:
            return  # one began meanwhile: its sandbox may be listed, and not ours yet
        leased = {str(s["id"]) for s in listed.json()["sandboxes"]}
        held = self._held.setdefault(session, set())
        held &= leased  # the rest is gone already
        strays = sorted(leased - held)
        for sandbox_id in strays:
            await self.release(sandbox_id)
        self._unsure.discard(session)
        if strays:
            logger.warning(
                "session %s: released %d sandboxes whose hand-over never reached this client: %s",
                session,
                len(strays),
                ", ".join(strays),
            )

    async def close_session(self, session: str) -> None:
        self._forget(session)
        try:
            await self._call("DELETE", f"/v1/sessions/{_segment(session)}")
        except errors.SandboxNotFound:
            pass  # already over: nothing to end
        except errors.ProviderError as exc:
            if exc.__cause__ is None:
                raise  # the service answered with an error of its own
            # The service cannot be reached: it ends the session itself once its
            # lease passes, so closing here must not fail the caller's cleanup, nor
            # alarm anyone (a run's end often stops the service and its clients).
            logger.info(
                "session %s not closed, the service is not reached (it ends the session "
                "itself when its lease passes): %s",
                session,
                exc,
            )

    async def acquire(self, spec: SandboxSpec, *, session: str, timeout: float | None) -> Lease:
        self._acquiring[session] += 1
        self._acquires += 1
        try:
            lease = await self._acquire(spec, session=session, timeout=timeout)
        except errors.ProviderError as exc:
            if exc.__cause__ is not None:
                self._unsure.add(session)  # no answer: it may have been handed over all the same
            raise
        except asyncio.CancelledError:
            self._unsure.add(session)
            raise
        except errors.SessionExpired:
            self._forget(session)
            raise
        finally:
            self._acquiring[session] -= 1
            if not self._acquiring[session]:
                del self._acquiring[session]
        self._held.setdefault(session, set()).add(lease.id)
        return lease

    async def _acquire(self, spec: SandboxSpec, *, session: str, timeout: float | None) -> Lease:
        # Cancelling this call closes the connection, or gives up the acquire's ticket;
        # the service then cancels the acquire and the pool hands the sandbox to the
        # next waiter or deletes it.
        body: dict[str, Any] = {"spec": spec.model_dump(mode="json"), "session": session,
                                "timeout": timeout}  # fmt: skip
        if self._tickets is not False:
            body["wait"] = _ACQUIRE_POLL
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        ticket = None
        try:
            while True:
                try:
                    response = await self._call(
                        "POST", "/v1/sandboxes", json=body, timeout=self._acquire_read(body)
                    )
                except errors.ConfigError as exc:
                    if "wait" not in body or _TICKETLESS not in str(exc):
                        raise
                    # A service from before tickets: the request is held open instead.
                    self._tickets = False
                    del body["wait"]
                    continue
                if "wait" in body:
                    self._tickets = True
                data = response.json()
                if response.status != 202:
                    break
                ticket = body["ticket"] = str(data["ticket"])
                pause = float(data["retry_after"])
                if deadline is not None:  # then its answer: a sandbox, or the timeout's error
                    pause = min(pause, max(1.0, deadline - loop.time()))
                await asyncio.sleep(pause)
        except BaseException:
            if ticket is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                    path = f"/v1/sandboxes/acquires/{_segment(ticket)}"
                    await self._call("DELETE", path, params={"session": session}, timeout=5.0)
            raise
        where = data.get("endpoint") or {}
        endpoint = DaemonEndpoint(
            uds=where.get("uds"),
            host=where.get("host"),
            port=where.get("port"),
            token=where.get("token", ""),
            pid=where.get("pid"),
        )
        sandbox_id = str(data["id"])
        if endpoint.uds is None and endpoint.host is None:
            with contextlib.suppress(errors.SandboxError):
                await self.release(sandbox_id)  # the caller never gets it
            raise errors.ProviderError(f"sandbox {sandbox_id} has no daemon endpoint")
        try:
            if self._via_proxy or (self._via_proxy is None and not await self._reachable(endpoint)):
                endpoint = self.proxied(sandbox_id)
        except BaseException:
            # Cancelled after the service handed it over: give it back, or it
            # stays leased to this session with no holder.
            with anyio.CancelScope(shield=True), contextlib.suppress(errors.SandboxError):
                await self.release(sandbox_id)
            raise
        return Lease(sandbox_id, endpoint, float(data["expires_at"]), _timeline(data))

    @staticmethod
    def _acquire_read(body: Mapping[str, Any]) -> float | None:
        """How long an acquire's request may take: a long poll's ``wait``, or (a service
        without tickets) the acquire's own ``timeout``, and a slack."""
        wait = body.get("wait", body["timeout"])
        return None if wait is None else float(wait) + _ACQUIRE_SLACK

    async def _reachable(self, endpoint: DaemonEndpoint) -> bool:
        """Whether this process can reach ``endpoint`` itself: a unix socket must exist
        here; TCP is tried on the first sandbox and the answer kept (they share a network)."""
        if endpoint.uds is not None:
            return _exists(endpoint.uds)
        if self._tcp_direct is None and endpoint.host is not None and endpoint.port is not None:
            self._tcp_direct = await _connects(endpoint.host, endpoint.port)
            if not self._tcp_direct:
                logger.info(
                    "sandbox endpoints such as %s:%s do not connect from here: using the "
                    "service's proxy route",
                    endpoint.host,
                    endpoint.port,
                )
        return self._tcp_direct is not False

    def proxied(self, sandbox_id: str) -> ProxiedEndpoint:
        """The endpoint of a sandbox's daemon through the service's proxy route."""
        url = self._parsed
        tls = url.scheme == "https"
        return ProxiedEndpoint(
            host=url.host,
            port=url.port or (443 if tls else 80),
            token=self._api_key,
            base_path=f"{url.path.rstrip('/')}/v1/sandboxes/{sandbox_id}/daemon",
            tls=tls,
        )

    async def sandboxes(self, *, state: str | None = None) -> list[dict[str, Any]]:
        """The tenant's sandboxes as the service lists them (JSON objects)."""
        params = {"state": state} if state else None
        response = await self._call("GET", "/v1/sandboxes", params=params)
        return list(response.json()["sandboxes"])

    async def describe(self, sandbox_id: str) -> dict[str, Any]:
        """One of the tenant's sandboxes as the service describes it; SandboxNotFound if none."""
        answer = await self._call("GET", f"/v1/sandboxes/{_segment(sandbox_id)}")
        data: dict[str, Any] = answer.json()
        return data

    async def endpoint(self, sandbox_id: str) -> DaemonEndpoint:
        """How to reach one of the tenant's sandboxes (directly, or through the proxy)."""
        data = await self.describe(sandbox_id)
        if data.get("state") != "leased":
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is {data.get('state')}")
        where = data.get("endpoint") or {}
        direct = DaemonEndpoint(
            uds=where.get("uds"),
            host=where.get("host"),
            port=where.get("port"),
            token=where.get("token", ""),
            pid=where.get("pid"),
        )
        if self._via_proxy or (self._via_proxy is None and not await self._reachable(direct)):
            return self.proxied(sandbox_id)
        return direct

    async def warm(self, spec: SandboxSpec, count: int) -> None:
        await self._call(
            "PUT", "/v1/warm", json={"spec": spec.model_dump(mode="json"), "count": count}
        )

    async def build_image(
        self, dockerfile: Path, context: Path, *, name: str, network: bool, cache: bool, reuse: bool
    ) -> None:
        raise errors.ConfigError(
            f"the service at {self.url} does not build images: build on its host "
            f"(`sandman images build -f {dockerfile} {context} -t {name}`) and name the image"
        )

    async def usage(self, sandbox_id: str, *, timeout: float | None = None) -> Usage | None:
        path = f"/v1/sandboxes/{_segment(sandbox_id)}/usage"
        answer = await self._call("GET", path, timeout=timeout or self._timeout)
        data = answer.json()
        return None if data is None else Usage.model_validate(data)

    async def release(self, sandbox_id: str) -> Usage | None:
        for held in self._held.values():
            held.discard(sandbox_id)
        used = None
        try:
            # The rollout's cost comes back with the release, in one round trip.
            used = await self._release(sandbox_id, usage=True)
        except errors.ProviderError as exc:
            if exc.__cause__ is None and not isinstance(exc, errors.ThrottledError):
                raise  # the service answered with an error of its own
            # Not reached: given back with the next heartbeat that is.
            logger.info(
                "release of %s deferred, the service is not reached (given back with the "
                "next heartbeat that is, or with the session's lease): %s",
                sandbox_id,
                exc,
            )
            self._unreleased.add(sandbox_id)
        return used

    async def _release(self, sandbox_id: str, *, usage: bool = False) -> Usage | None:
        used = None
        with contextlib.suppress(errors.SandboxNotFound):  # idempotent
            params = {"usage": "true"} if usage else None
            answer = await self._call(
                "DELETE", f"/v1/sandboxes/{_segment(sandbox_id)}", params=params
            )
            data = answer.json() if usage and answer.status == 200 else None
            used = None if data is None else Usage.model_validate(data)
        self._unreleased.discard(sandbox_id)
        return used

    # -- snapshots --------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, *, memory: bool, ttl: float | None) -> Snapshot:
        body = {"memory": memory, "ttl": ttl}
        path = f"/v1/sandboxes/{_segment(sandbox_id)}/snapshot"
        response = await self._call("POST", path, json=body, timeout=None)
        return Snapshot.model_validate(response.json())

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        response = await self._call("GET", f"/v1/snapshots/{_segment(snapshot_id)}")
        return Snapshot.model_validate(response.json())

    async def snapshots(self) -> list[Snapshot]:
        response = await self._call("GET", "/v1/snapshots")
        return [Snapshot.model_validate(item) for item in response.json()["snapshots"]]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        with contextlib.suppress(errors.SnapshotNotFound):  # idempotent
            await self._call("DELETE", f"/v1/snapshots/{_segment(snapshot_id)}")

    async def restore(self, sandbox_id: str, snapshot_id: str) -> DaemonEndpoint:
        path = f"/v1/sandboxes/{_segment(sandbox_id)}/restore"
        await self._call("POST", path, json={"snapshot": snapshot_id}, timeout=None)
        return await self.endpoint(sandbox_id)

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        path = f"/v1/sandboxes/{_segment(sandbox_id)}/pause"
        await self._call("POST", path, json={"memory": memory}, timeout=None)

    async def resume(self, sandbox_id: str) -> None:
        await self._call("POST", f"/v1/sandboxes/{_segment(sandbox_id)}/resume", timeout=None)

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        path = f"/v1/sandboxes/{_segment(sandbox_id)}/egress"
        await self._call("PUT", path, json=egress.model_dump(mode="json"), timeout=None)

    async def check(self, sandbox_id: str) -> None:
        response = await self._call(
            "GET", f"/v1/sandboxes/{_segment(sandbox_id)}", params={"probe": "true"}
        )
        data = response.json()
        state = data.get("state")
        if state == "lost":
            reason = str(data.get("lost_reason") or "unknown")
            raise errors.SandboxLost.of(sandbox_id, reason, str(data.get("lost_detail") or ""))
        if state != "leased" or data.get("running") is not True:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id} is gone ({state})")

    async def timeline(self, lease: Lease) -> dict[str, float]:
        try:
            response = await self._call("GET", f"/v1/sandboxes/{_segment(lease.id)}")
        except errors.SandboxNotFound:
            # The service forgot it (long gone): what was seen last.
            return dict(lease.timeline)
        lease.timeline.update(_timeline(response.json()))
        return dict(lease.timeline)

    async def aclose(self) -> None:
        await self._http.aclose()


def connect(
    url: str,
    *,
    api_key: str | None = None,
    heartbeat_interval: float = 5.0,
    timeout: float = 30.0,
    transport: httpx.AsyncBaseTransport | None = None,
    via_proxy: bool | None = None,
    hook: EventHook | None = None,
) -> AsyncClient:
    """An `AsyncClient` whose sandboxes come from the Sandman service at ``url``.

    ``async with sandman.connect(url, api_key=key) as client: async with
    client.sandbox("img") as sb: ...`` works as with `sandman.local`; the
    session is kept alive by heartbeats, and if this process dies its
    sandboxes are released when the session's lease ends. ``timeout`` bounds
    each call to the service (an acquire waits as long as its own timeout).

    Commands and files go straight to each sandbox's daemon when this process
    can reach it, else through the service's proxy route; ``via_proxy=True``
    always takes the route (no route to pod IPs), ``False`` never does.

    If the service says the session is over (this process was stopped past the
    lease, the service lost its state), the client opens a new one and carries
    on; ``hook`` gets a ``session.replaced`` event naming what was lost.
    """
    backend = RemoteBackend(
        url, api_key=api_key, timeout=timeout, transport=transport, via_proxy=via_proxy
    )
    return AsyncClient(backend, heartbeat_interval=heartbeat_interval, hook=hook)


def connect_sync(
    url: str,
    *,
    api_key: str | None = None,
    heartbeat_interval: float = 5.0,
    timeout: float = 30.0,
    via_proxy: bool | None = None,
    hook: EventHook | None = None,
) -> Client:
    """The blocking twin of `connect`: ``with sandman.connect_sync(url, api_key=k) as client: ...``."""
    return Client(
        connect(
            url,
            api_key=api_key,
            heartbeat_interval=heartbeat_interval,
            timeout=timeout,
            via_proxy=via_proxy,
            hook=hook,
        )
    )


def _timeline(data: Mapping[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in (data.get("timeline") or {}).items()}
