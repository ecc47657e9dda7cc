"""One watch on the namespace's Sandman pods, shared by every create that waits for its pod.

A burst of thousands of creates must not become thousands of poll loops.
The watch starts with a list (its resourceVersion is where the watch
begins), resumes from the last resourceVersion seen (bookmarks keep it
fresh) when the server ends the stream, and lists again on 410 Gone, handing
each listed pod to its waiter so that no transition is missed. Waiters are
callbacks keyed by pod name; one is registered before the pod is created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sandman import errors
from sandman.providers.kubernetes.api import KubeAPI, WatchExpired

__all__ = ["PodWatch", "Waiter"]

logger = logging.getLogger(__name__)

Waiter = Callable[[str, dict[str, Any]], None]
"""Called with the event type (``ADDED``, ``MODIFIED``, ``DELETED``, ``LISTED``) and the pod."""

_BACKOFF_MAX = 10.0


class PodWatch:
    """Watches pods matching ``selector`` and hands every event to the waiter for that pod."""

    def __init__(self, api: KubeAPI, selector: str, *, timeout_seconds: int = 300) -> None:
        self._api = api
        self._selector = selector
        self._timeout = timeout_seconds  # the server ends each stream after this; we resume
        self._waiters: dict[str, Waiter] = {}
        self.others: Waiter | None = None
        """Given the events of every pod no waiter waits on (the provider's loss watch)."""
        self._task: asyncio.Task[None] | None = None
        self._synced: asyncio.Future[None] | None = None
        self.relists = 0
        """How many times the watch listed (1 at start, +1 per 410 Gone)."""
        self.restarts = 0
        """How many times a watch stream was opened again (server timeout, broken connection)."""

    async def ensure_started(self) -> None:
        """Start the watch on first use; returns once it has listed, so no event is missed."""
        if self._task is None or self._task.done():
            self._synced = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._synced), name="sandman-pod-watch")
        assert self._synced is not None
        await asyncio.shield(self._synced)

    def add(self, name: str, waiter: Waiter) -> None:
        """Hand every event of pod ``name`` to ``waiter`` (one waiter per pod)."""
        self._waiters[name] = waiter

    def remove(self, name: str) -> None:
        """Stop handing events of pod ``name`` on."""
        self._waiters.pop(name, None)

    async def aclose(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        waiter = self._waiters.get((pod.get("metadata") or {}).get("name", ""), self.others)
        if waiter is not None:
            try:
                waiter(kind, pod)
            except Exception:
                logger.exception("pod waiter failed")

    async def _list(self) -> str:
        version = ""
        async for chunk, at in self._api.pod_pages(self._selector):
            for pod in chunk:
                self._dispatch("LISTED", pod)
            version = at
        self.relists += 1
        return version

    async def _run(self, synced: asyncio.Future[None]) -> None:
        version: str | None = None
        backoff = 0.1
        while True:
            try:
                if version is None:
                    version = await self._list()
                    if not synced.done():
                        synced.set_result(None)
                events = self._api.watch_pods(
                    self._selector, version, timeout_seconds=self._timeout
                )
                async for event in events:
                    backoff = 0.1
                    pod = event.get("object") or {}
                    version = (pod.get("metadata") or {}).get("resourceVersion") or version
                    if event.get("type") != "BOOKMARK":
                        self._dispatch(str(event.get("type")), pod)
                self.restarts += 1
            except WatchExpired:
                logger.info("pod watch expired (410 Gone): listing again")
                version = None
            except (errors.SandboxError, ValueError) as exc:
                # Throttled or unreachable, or an answer that is not JSON (a proxy's
                # error page, a garbled line): the watch waits like any client, then
                # resumes — it must never die and leave its waiters without events.
                delay = getattr(exc, "retry_after", None) or backoff
                logger.warning("pod watch failed, again in %.1f s: %s", delay, exc)
                if not synced.done() and isinstance(exc, errors.ConfigError):
                    synced.set_exception(exc)
                    return
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                self.restarts += 1
