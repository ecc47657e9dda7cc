"""One watch on the namespace's Sandman pods, shared by every create that waits for its pod.

A burst of thousands of creates must not become thousands of poll loops.
The watch starts with a list (its resourceVersion is where the watch
begins), resumes from the last resourceVersion seen (bookmarks keep it
fresh) when the server ends the stream, and lists again on 410 Gone, handing
each listed pod to its waiter so that no transition is missed. Waiters are
callbacks keyed by pod name; one is registered before the pod is created.

With ``keep_facts`` it also keeps what a listing needs of each pod it has seen
(`PodFacts`: labels, state, why it stopped...), from the pod's latest event: a
provider's list then asks the API server for names only (`KubeAPI.pod_names`)
instead of reading and parsing 50,000 whole pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandman import errors
from sandman.providers.base import Lost, SandboxState
from sandman.providers.kubernetes import pods
from sandman.providers.kubernetes.api import KubeAPI, WatchExpired

__all__ = ["PodFacts", "PodWatch", "Waiter"]

logger = logging.getLogger(__name__)

Waiter = Callable[[str, dict[str, Any]], None]
"""Called with the event type (``ADDED``, ``MODIFIED``, ``DELETED``, ``LISTED``) and the pod."""

_BACKOFF_MAX = 10.0
# The API server sends a watch a bookmark every minute: a stream silent for longer is
# not known to be current (a connection that stopped delivering, not yet timed out).
_QUIET_MAX = 150.0


@dataclass(frozen=True, slots=True)
class PodFacts:
    """What a listing needs of one pod beyond its name, from its latest watch event
    (`sandman.providers.kubernetes.pods.pod_info` reads the same). About 700 bytes a
    pod: label keys and repeated values are shared, and no pod object is kept."""

    version: int
    """The pod's resourceVersion these were read at (0 if it is not a number)."""
    labels: dict[str, str]
    created_at: float
    state: SandboxState
    image: str
    ip: str | None
    """The pod's IP once it runs with its daemon's token (else None)."""
    token: str | None
    lost: Lost | None


def facts_of(pod: dict[str, Any]) -> PodFacts:
    """The `PodFacts` of a pod object."""
    info = pods.pod_info(pod, provider="", port=0)
    endpoint = info.endpoint
    intern = sys.intern
    return PodFacts(
        version=_version(pod),
        labels={intern(k): intern(v) for k, v in info.labels.items()},
        created_at=info.created_at,
        state=info.state,
        image=intern(info.image),
        ip=endpoint.host if endpoint is not None else None,
        token=endpoint.token if endpoint is not None else None,
        lost=info.lost,
    )


def _version(pod: dict[str, Any]) -> int:
    # Opaque to clients by the API's word, but etcd's revision, a number, in every API
    # server: compared only to keep a pod's facts from going back (`PodWatch.saw`).
    try:
        return int((pod.get("metadata") or {}).get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0


class PodWatch:
    """Watches pods matching ``selector`` and hands every event to the waiter for that pod."""

    def __init__(
        self, api: KubeAPI, selector: str, *, timeout_seconds: int = 300, keep_facts: bool = False
    ) -> None:
        self._api = api
        self._selector = selector
        self._timeout = timeout_seconds  # the server ends each stream after this; we resume
        self._waiters: dict[str, Waiter] = {}
        self._keep = keep_facts
        self.facts: dict[str, PodFacts] = {}
        """With ``keep_facts``: each pod seen (by name) as its latest event says; a pod
        is dropped when it is deleted, and all are read again when the watch lists."""
        self._current = False  # no event missed since the stream last said anything
        self._heard = 0.0  # monotonic time the stream last said anything (bookmarks too)
        self.others: Waiter | None = None
        """Given the events of every pod no waiter waits on (the provider's loss watch)."""
        self._task: asyncio.Task[None] | None = None
        self._synced: asyncio.Future[None] | None = None
        self.relists = 0
        """How many times the watch listed (1 at start, +1 per 410 Gone)."""
        self.restarts = 0
        """How many times a watch stream was opened again (server timeout, broken connection)."""

    def start(self) -> None:
        """Start the watch, if it is not running (on the running event loop)."""
        if self._task is None or self._task.done():
            self._synced = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._synced), name="sandman-pod-watch")

    @property
    def started(self) -> bool:
        """Whether the watch runs (it may not have listed yet)."""
        return self._task is not None and not self._task.done()

    async def ensure_started(self) -> None:
        """Start the watch on first use; returns once it has listed, so no event is missed."""
        self.start()
        assert self._synced is not None
        await asyncio.shield(self._synced)

    @property
    def current(self) -> bool:
        """Whether `facts` are as current as the watch's stream: it runs, has listed,
        missed no event since (a failed stream or a 410 until it is heard from again),
        and was heard from within the bookmark interval."""
        return self.started and self._current and time.monotonic() - self._heard < _QUIET_MAX

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

    def _dispatch(
        self, kind: str, pod: dict[str, Any], facts: dict[str, PodFacts] | None = None
    ) -> None:
        name = (pod.get("metadata") or {}).get("name", "")
        if self._keep:
            self._note(self.facts if facts is None else facts, name, kind, pod)
        waiter = self._waiters.get(name, self.others)
        if waiter is not None:
            try:
                waiter(kind, pod)
            except Exception:
                logger.exception("pod waiter failed")

    def saw(self, pod: dict[str, Any]) -> None:
        """A pod as a write of ours answered it (a relabel's PATCH): its facts at once, so
        that a list right after sees the write, before the watch tells of it."""
        if self._keep:
            self._note(self.facts, (pod.get("metadata") or {}).get("name", ""), "SAW", pod)

    @staticmethod
    def _note(facts: dict[str, PodFacts], name: str, kind: str, pod: dict[str, Any]) -> None:
        if kind == "DELETED":
            facts.pop(name, None)
            return
        before = facts.get(name)
        if before is not None and 0 < _version(pod) < before.version:
            return  # an event sent before a write whose answer `saw` noted
        try:
            facts[name] = facts_of(pod)
        except Exception:  # a pod we cannot read: a list asks for it whole
            facts.pop(name, None)
            logger.warning("cannot read pod %s", name, exc_info=True)

    async def _list(self) -> str:
        version = ""
        listed: dict[str, PodFacts] = {}  # replaces the facts at the end: drops the deleted
        async for chunk, at in self._api.pod_pages(self._selector):
            for pod in chunk:
                self._dispatch("LISTED", pod, listed)
            version = at
        self.facts = listed
        self.relists += 1
        self._heard, self._current = time.monotonic(), True
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
                    # Resumed from the last version seen: what was missed came first.
                    self._heard, self._current = time.monotonic(), True
                self.restarts += 1
            except WatchExpired:
                logger.info("pod watch expired (410 Gone): listing again")
                self._current = False
                version = None
            except (errors.SandboxError, ValueError) as exc:
                self._current = False
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
