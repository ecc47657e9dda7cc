"""A small async client for the few pod calls the provider makes, on aiohttp.

Why not a generated client, and why aiohttp: on a burst the provider's own
CPU per create matters. Measured per pod create (benchmarks/k8s_burst.py
``--client-cpu``, 600 creates, 16 at a time, hack/kube): this raw aiohttp
client 0.5 ms, ``kubernetes_asyncio`` 1.8 ms (it builds typed models of every
answer), httpx 2.8 ms.

It is the provider's one HTTP client (``sandman prepare`` uses it too).
Every failure leaves this module as a Sandman error (`raise_for_status`):

- 429 (API Priority and Fairness, max-inflight) and 5xx -> ThrottledError with
  the server's Retry-After: the pool's pacer backs off and retries. Every call
  but a pod's create first waits out a few 429s itself, as client-go does: a
  pool starting, listing or renewing its Lease on a busy shared cluster must
  not fail for being asked to wait a second (a create's 429 is the pacer's
  signal, so it goes straight up);
- 403 for an exceeded (or not yet counted) ResourceQuota -> CapacityError
  (retryable); other 403s -> ConfigError (our identity lacks a permission); 401 ->
  ConfigError once a fresh token was refused too (`Credentials.refresh`: an exec
  plugin run again, a token file re-read; one retry);
- 404 -> SandboxNotFound; 400 (BadRequest), 409 and 422 -> ConfigError (a bad
  name, spec or selector);
- no answer at all (connect, read timeouts) -> ThrottledError: the API server
  is overloaded or away, and waiting is the right response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp

from sandman import errors
from sandman.providers.kubernetes.credentials import Credentials

__all__ = [
    "BadRequest",
    "Conflict",
    "Forbidden",
    "KubeAPI",
    "WatchExpired",
    "raise_for_status",
    "retry_after",
]

logger = logging.getLogger(__name__)

_PAGE = 500
_STREAMS = 2  # connections kept outside the calls' slots: the watch, a Lease's renewal
# Waiting out 429s inside a call (not a create): how often, and at most how long each.
_THROTTLED_RETRIES = 5
_THROTTLED_WAIT_MAX = 10.0
_LINE_LIMIT = 2**22  # one watch event is one line; a pod is a few KB, allow far more
_RETIRED_FOR = 900.0  # a session left for a new client certificate closes after (> a watch)

# A list as a table of names (`KubeAPI.pod_names`); a server or proxy that cannot
# answers the whole objects, which read as well.
_TABLE = "application/json;as=Table;g=meta.k8s.io;v=v1, application/json"


class Forbidden(errors.ConfigError):
    """403: the identity lacks the permission (not a quota refusal)."""


class BadRequest(errors.ConfigError):
    """400: the request is wrong (e.g. a label selector that does not parse).

    ``reason`` is the API server's own message.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Conflict(errors.ConfigError):
    """409: the object exists already, or changed since the version a request named."""


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds a 429's ``Retry-After`` asks for; None when absent or not a number."""
    try:
        return max(0.0, float(headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


def _message(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace")
    return str(parsed.get("message", parsed)) if isinstance(parsed, dict) else str(parsed)[:300]


def raise_for_status(status: int, headers: Mapping[str, str], body: bytes, what: str) -> None:
    """Raise the Sandman error for a failed API response; return for a 2xx."""
    if status < 300:
        return
    reason = _message(body)
    message = f"{what}: {status} {reason}"
    if status == 429 or status >= 500:
        raise errors.ThrottledError(message, retry_after=retry_after(headers))
    # "status unknown": a quota the controller has not counted yet (just made, or lagging).
    if status == 403 and ("exceeded quota" in message or "status unknown for quota" in message):
        raise errors.CapacityError(message)
    if status == 401:
        raise errors.ConfigError(
            f"{message} (the API server does not accept our credentials: an expired "
            "or revoked token, or a client certificate it does not trust)"
        )
    if status == 403:
        raise Forbidden(
            f"{message} (check the identity's Role: pods create/get/list/patch/"
            "watch/delete and leases create/get/list/patch/delete in the namespace)"
        )
    if status == 404:
        raise errors.SandboxNotFound(message)
    if status == 400:
        raise BadRequest(message, reason)
    if status == 409:
        raise Conflict(message)
    if status == 422:
        raise errors.ConfigError(message)
    raise errors.ProviderError(message)


@contextlib.contextmanager
def _transport_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (aiohttp.ClientSSLError, aiohttp.InvalidURL) as exc:
        # A wrong CA or server address is configuration, not strain: retrying
        # would only slow the pacer down for everyone.
        raise errors.ConfigError(f"{what}: {exc!r}") from exc
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise errors.ThrottledError(f"{what}: API server unreachable: {exc!r}") from exc


class KubeAPI:
    """Pods in one namespace: create, get, list (paged), delete, watch."""

    def __init__(
        self, credentials: Credentials, *, timeout: float = 30.0, max_connections: int = 64
    ) -> None:
        self.namespace = credentials.namespace
        self._credentials = credentials
        self._pods = f"{credentials.server}/api/v1/namespaces/{credentials.namespace}/pods"
        self._leases = (
            f"{credentials.server}/apis/coordination.k8s.io/v1/namespaces/"
            f"{credentials.namespace}/leases"
        )
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 10.0))
        self._max_connections = max_connections
        # Calls wait here, not in aiohttp's pool, whose wait counts against the call's
        # timeout: 50,000 deletes at once timed out by the thousand and retried, 4/s.
        # The rest of the connections are the watch's, and a Lease renewal's.
        self._slots = asyncio.Semaphore(max(1, max_connections - _STREAMS))
        self._session: aiohttp.ClientSession | None = None
        self._tls_generation = credentials.tls_generation
        # Sessions whose connections present an exec plugin's old client certificate,
        # and since when: closed once their requests (a watch: minutes) are surely done.
        self._retired: list[tuple[float, aiohttp.ClientSession]] = []

    def _http(self) -> aiohttp.ClientSession:
        if self._tls_generation != self._credentials.tls_generation:
            # A new client certificate: new connections (the TLS handshake presents it).
            self._tls_generation = self._credentials.tls_generation
            if self._session is not None:
                self._retired.append((time.monotonic(), self._session))
                self._session = None
        # Made on first use: an aiohttp session belongs to the loop it was made in.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                ssl=self._credentials.ssl_context, limit=self._max_connections
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                read_bufsize=2**16,
                headers={"Accept": "application/json", "User-Agent": "sandman"},
            )
        return self._session

    @contextlib.asynccontextmanager
    async def _respond(
        self, method: str, url: str, *, headers: Mapping[str, str] | None = None, **kwargs: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response to one request; after a 401, to the same request once more
        with a fresh token (an exec plugin's expired early, a token file rotated)."""
        credentials = self._credentials
        for attempt in (0, 1):
            token = await credentials.authorization()
            generation = credentials.generation
            if self._retired and time.monotonic() - self._retired[0][0] > _RETIRED_FOR:
                await self._retired.pop(0)[1].close()
            auth = {"Authorization": f"Bearer {token}"} if token else {}
            async with self._http().request(
                method, url, headers={**auth, **(headers or {})}, proxy=credentials.proxy,
                server_hostname=credentials.tls_server_name, **kwargs,
            ) as response:  # fmt: skip
                if response.status == 401 and attempt == 0:
                    await response.read()
                    if await credentials.refresh(token, generation):
                        logger.info("%s %s: 401: once more with a new token", method, url)
                        continue
                yield response
                return

    async def aclose(self) -> None:
        """Close the connections."""
        for _, old in self._retired:
            await old.close()
        self._retired.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url: str,
        what: str,
        *,
        params: Mapping[str, str | int] | None = None,
        body: dict[str, Any] | None = None,
        merge_patch: bool = False,
        missing_ok: bool = False,
        wait_throttled: bool = True,
        urgent: bool = False,
        accept: str | None = None,
    ) -> dict[str, Any]:
        """One API call; its JSON answer, or the Sandman error for its failure. With
        ``wait_throttled``, a 429 is waited out (its Retry-After) a few times first.
        ``merge_patch`` sends ``body`` as a JSON merge patch. An ``urgent`` call (a
        Lease's renewal) does not queue for a slot behind a pool's worth of deletes: it
        takes one of the connections kept outside them. ``accept`` replaces the
        ``Accept`` header (the answer's form)."""
        send: dict[str, Any] = {"json": body}
        if merge_patch:
            send = {"data": json.dumps(body).encode(),
                    "headers": {"Content-Type": "application/merge-patch+json"}}  # fmt: skip
        if accept is not None:
            send["headers"] = {**send.get("headers", {}), "Accept": accept}
        for attempt in range(_THROTTLED_RETRIES + 1):
            async with contextlib.nullcontext() if urgent else self._slots:
                with _transport_errors(what):
                    async with self._respond(method, url, params=params, **send) as response:
                        data = await response.read()
                        status, headers = response.status, response.headers
            if status != 429 or not wait_throttled or attempt == _THROTTLED_RETRIES:
                break
            await asyncio.sleep(min(retry_after(headers) or 1.0, _THROTTLED_WAIT_MAX))
        if missing_ok and status == 404:
            return {}
        raise_for_status(status, headers, data, what)
        result: dict[str, Any] = json.loads(data)
        return result

    def url(self, group_version: str, resource: str) -> str:
        """The URL of a namespaced ``resource`` of an API group (``networking.k8s.io/v1``)."""
        return (
            f"{self._credentials.server}/apis/{group_version}/namespaces/"
            f"{self.namespace}/{resource}"
        )

    async def create_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST the pod; returns the object the API server stored."""
        what = f"create pod {body['metadata']['name']}"
        return await self.request("POST", self._pods, what, body=body, wait_throttled=False)

    async def get_pod(self, name: str) -> dict[str, Any]:
        """The pod; SandboxNotFound when there is none."""
        return await self.request("GET", f"{self._pods}/{name}", f"get pod {name}")

    async def create_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a Lease (`owners.LeaseKeeper`); Conflict if it exists."""
        what = f"create lease {body['metadata']['name']}"
        return await self.request("POST", self._leases, what, body=body)

    async def patch_lease(self, name: str, patch: dict[str, Any]) -> None:
        """Merge ``patch`` into the Lease (one PATCH: its renewal); SandboxNotFound if gone."""
        # A 429 is not waited out here: the keeper tries again within a second.
        await self.request(
            "PATCH", f"{self._leases}/{name}", f"renew lease {name}", body=patch,
            merge_patch=True, wait_throttled=False, urgent=True,
        )  # fmt: skip

    async def list_leases(self, selector: str) -> list[dict[str, Any]]:
        """Every Lease of the namespace matching the selector (consistent, paged: see
        `_pages`; a stale copy would look older than it is)."""
        items: list[dict[str, Any]] = []
        async for body in self._pages(self._leases, "list leases", {"labelSelector": selector}):
            items.extend(body.get("items") or [])
        return items

    async def delete_lease(self, name: str, *, resource_version: str | None = None) -> None:
        """Delete the Lease (a missing one is fine); with ``resource_version``, only if it
        is still at that version (else Conflict: its holder renewed it meanwhile)."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if resource_version:
            options["preconditions"] = {"resourceVersion": resource_version}
        await self.request(
            "DELETE", f"{self._leases}/{name}", f"delete lease {name}", body=options,
            missing_ok=True,
        )  # fmt: skip

    async def patch_pod_labels(self, name: str, labels: Mapping[str, str | None]) -> dict[str, Any]:
        """Merge ``labels`` into the pod's (JSON merge patch: None removes a label); the
        pod as patched."""
        patch = {"metadata": {"labels": dict(labels)}}
        url, what = f"{self._pods}/{name}", f"relabel pod {name}"
        return await self.request("PATCH", url, what, body=patch, merge_patch=True)

    async def delete_pod(self, name: str) -> None:
        """Delete at once (grace 0); a missing pod is fine."""
        options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        await self.request(
            "DELETE", f"{self._pods}/{name}", f"delete pod {name}", body=options, missing_ok=True
        )

    async def list_pods(
        self, selector: str, *, page: int = _PAGE
    ) -> tuple[list[dict[str, Any]], str]:
        """Every pod matching the label selector; and the list's resourceVersion (where a
        watch continues). See `pod_pages`, which callers holding thousands prefer."""
        items: list[dict[str, Any]] = []
        version = ""
        async for chunk, at in self.pod_pages(selector, page=page):
            items.extend(chunk)
            version = at
        return items, version

    async def pod_pages(
        self, selector: str, *, page: int = _PAGE
    ) -> AsyncGenerator[tuple[list[dict[str, Any]], str], None]:
        """The pods matching the label selector, ``page`` at a time, each page with the
        list's resourceVersion: a caller that keeps less than the pod (a reconcile
        of 50,000) never holds every pod object at once (see `_pages`)."""
        params = {"labelSelector": selector}
        async for body in self._pages(self._pods, "list pods", params, page=page):
            metadata = body.get("metadata") or {}
            yield body.get("items") or [], str(metadata.get("resourceVersion", ""))

    async def pod_names(
        self, selector: str, *, page: int = _PAGE
    ) -> AsyncGenerator[list[str], None]:
        """The names of the pods matching the label selector, ``page`` at a time (a
        consistent, paged list: see `_pages`), for a caller that knows the rest of each
        pod (`PodWatch.facts`).

        Asked for as a table without objects (``as=Table``, ``includeObject=None``):
        about 150 bytes a pod. A ``PartialObjectMetadataList`` is no answer here: a
        pod's metadata is most of the pod (a KWOK pod's 4.6 of 7.9 KB, 3.6 of them
        ``managedFields``): parsing it took 7.6 s per 50,000 here, the table 0.1 s.
        """
        params = {"labelSelector": selector, "includeObject": "None"}
        async for body in self._pages(self._pods, "list pods", params, page=page, accept=_TABLE):
            yield _names(body)

    async def _pages(
        self,
        url: str,
        what: str,
        params: Mapping[str, str],
        *,
        page: int = _PAGE,
        accept: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Each page of a list, ``page`` items at a time, following continue tokens.

        Consistent (no ``resourceVersion``): the API server ignores ``limit`` for a
        list at ``resourceVersion=0`` and answers every object at once, from its watch
        cache (28,000 pods: one 30 s, 200 MB answer, and over 1 GB in this process
        to parse it). A consistent list honours ``limit``; since Kubernetes 1.31 it is
        served from the watch cache once that has caught up, and before, page by page
        from etcd, as kubectl reads.
        """
        query: dict[str, str | int] = {**params, "limit": page}
        while True:
            body = await self.request("GET", url, what, params=query, accept=accept)
            yield body
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return
            query["continue"] = token

    async def list_nodes(self, selector: str = "", *, page: int = _PAGE) -> list[dict[str, Any]]:
        """Every Node of the cluster matching the label selector (a cluster-scoped read:
        ``nodes`` ``list``; consistent, paged: see `_pages`). Forbidden when the identity
        may not; BadRequest for a selector the API server cannot parse.
        """
        url = f"{self._credentials.server}/api/v1/nodes"
        what = f"list nodes {selector!r}" if selector else "list nodes"
        params = {"labelSelector": selector} if selector else {}
        items: list[dict[str, Any]] = []
        async for body in self._pages(url, what, params, page=page):
            items.extend(body.get("items") or [])
        return items

    async def watch_pods(
        self, selector: str, resource_version: str, *, timeout_seconds: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``type``, ``object``) from ``resource_version`` on, bookmarks included.

        Ends when the server closes the stream; raises WatchExpired on 410 Gone.
        """
        params: dict[str, str | int] = {
            "watch": 1, "labelSelector": selector, "resourceVersion": resource_version,
            "allowWatchBookmarks": "true", "timeoutSeconds": timeout_seconds,
        }  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_seconds + 30)
        with _transport_errors("watch pods"):
            async with self._respond("GET", self._pods, params=params, timeout=timeout) as response:
                if response.status == 410:
                    raise WatchExpired(resource_version)
                if response.status >= 300:
                    data = await response.read()
                    raise_for_status(response.status, response.headers, data, "watch pods")
                try:
                    buffer = b""
                    async for chunk in response.content.iter_any():
                        buffer += chunk
                        if len(buffer) > _LINE_LIMIT:
                            raise errors.ProviderError("watch pods: an event larger than 4 MiB")
                        *lines, buffer = buffer.split(b"\n")
                        for line in lines:
                            if line.strip():
                                yield _event(line, resource_version)
                finally:
                    # A watch left mid-stream (cancelled, closed): drop its connection
                    # at once. A graceful TLS close would outlive the session's close.
                    transport = response.connection and response.connection.transport
                    if transport is not None and not response.content.at_eof():
                        transport.abort()


def _names(body: Mapping[str, Any]) -> list[str]:
    """The names in a list's page: a Table's name column, or a list's items' names."""
    if body.get("kind") != "Table":
        items = body.get("items") or []
        return [str((item.get("metadata") or {}).get("name", "")) for item in items]
    columns = body.get("columnDefinitions") or []
    at = next((i for i, c in enumerate(columns) if c.get("format") == "name"), 0)
    return [str(row["cells"][at]) for row in body.get("rows") or []]


def _event(line: bytes, resource_version: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(line)
    if event.get("type") == "ERROR":
        status = event.get("object") or {}
        if status.get("code") == 410:
            raise WatchExpired(resource_version)
        raise errors.ProviderError(f"watch pods: {status.get('message', status)}")
    return event
