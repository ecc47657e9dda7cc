"""A small async client for the few pod calls the provider makes, on httpx.

Why not a generated client: on a burst the provider's own CPU per create
matters, and a raw httpx request with a dict body costs about half of what
``kubernetes_asyncio`` spends (see benchmarks/k8s_burst.py ``--client-cpu``).

Every failure leaves this module as a Sandman error (`raise_for`):

- 429 (API Priority and Fairness, max-inflight) and 5xx -> ThrottledError with
  the server's Retry-After: the pool's pacer backs off and retries;
- 403 for an exceeded ResourceQuota -> CapacityError (retryable); other 403s
  and 401 -> ConfigError (our identity lacks a permission);
- 404 -> SandboxNotFound; 409 and 422 -> ConfigError (a bad name or spec);
- no answer at all (connect, read timeouts) -> ThrottledError: the API server
  is overloaded or away, and waiting is the right response.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import httpx

from sandman import errors
from sandman.providers.kubernetes.credentials import Credentials

__all__ = ["KubeAPI", "WatchExpired", "raise_for"]

logger = logging.getLogger(__name__)

_PAGE = 500


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _Bearer(httpx.Auth):
    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._credentials.bearer()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    return str(body.get("message", body)) if isinstance(body, dict) else str(body)[:300]


def raise_for(response: httpx.Response, what: str) -> None:
    """Raise the Sandman error for a failed API response; return for a 2xx."""
    status = response.status_code
    if status < 300:
        return
    message = f"{what}: {status} {_message(response)}"
    if status == 429 or status >= 500:
        raise errors.ThrottledError(message, retry_after=_retry_after(response))
    if status == 403 and "exceeded quota" in message:
        raise errors.CapacityError(message)
    if status in (401, 403):
        raise errors.ConfigError(f"{message} (check the identity's Role: pods create/get/list/"
                                 "watch/delete in the namespace)")  # fmt: skip
    if status == 404:
        raise errors.SandboxNotFound(message)
    if status in (409, 422, 400):
        raise errors.ConfigError(message)
    raise errors.ProviderError(message)


@contextlib.contextmanager
def _transport_errors(what: str) -> Iterator[None]:
    try:
        yield
    except httpx.TransportError as exc:
        raise errors.ThrottledError(f"{what}: API server unreachable: {exc!r}") from exc


class KubeAPI:
    """Pods in one namespace: create, get, list (paged), delete, watch."""

    def __init__(
        self, credentials: Credentials, *, timeout: float = 30.0, max_connections: int = 64
    ) -> None:
        self.namespace = credentials.namespace
        self._pods = f"/api/v1/namespaces/{credentials.namespace}/pods"
        self._http = httpx.AsyncClient(
            base_url=credentials.server,
            verify=credentials.ssl_context,
            auth=_Bearer(credentials),
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            headers={"Accept": "application/json", "User-Agent": "sandman"},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def create_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST the pod; returns the object the API server stored."""
        what = f"create pod {body['metadata']['name']}"
        with _transport_errors(what):
            response = await self._http.post(self._pods, json=body)
        raise_for(response, what)
        result: dict[str, Any] = response.json()
        return result

    async def get_pod(self, name: str) -> dict[str, Any]:
        """The pod; SandboxNotFound when there is none."""
        what = f"get pod {name}"
        with _transport_errors(what):
            response = await self._http.get(f"{self._pods}/{name}")
        raise_for(response, what)
        result: dict[str, Any] = response.json()
        return result

    async def delete_pod(self, name: str) -> None:
        """Delete at once (grace 0); a missing pod is fine."""
        what = f"delete pod {name}"
        with _transport_errors(what):
            response = await self._http.request(
                "DELETE", f"{self._pods}/{name}",
                json={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )  # fmt: skip
        if response.status_code != 404:
            raise_for(response, what)

    async def list_pods(
        self, selector: str, *, page: int = _PAGE
    ) -> tuple[list[dict[str, Any]], str]:
        """Every pod matching the label selector, ``page`` at a time; and the list's
        resourceVersion (where a watch continues)."""
        items: list[dict[str, Any]] = []
        params: dict[str, str | int] = {"labelSelector": selector, "limit": page}
        while True:
            with _transport_errors("list pods"):
                response = await self._http.get(self._pods, params=params)
            raise_for(response, "list pods")
            body = response.json()
            items.extend(body.get("items") or [])
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items, str(body["metadata"].get("resourceVersion", ""))
            params["continue"] = token

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
        timeout = httpx.Timeout(10.0, read=timeout_seconds + 30.0)
        with _transport_errors("watch pods"):
            async with self._http.stream(
                "GET", self._pods, params=params, timeout=timeout
            ) as response:
                if response.status_code == 410:
                    raise WatchExpired(resource_version)
                if response.status_code >= 300:
                    await response.aread()
                    raise_for(response, "watch pods")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        if status.get("code") == 410:
                            raise WatchExpired(resource_version)
                        raise errors.ProviderError(f"watch pods: {status.get('message', status)}")
                    yield event
