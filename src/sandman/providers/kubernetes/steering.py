"""The provider's view of which nodes hold which images, for `placement.image_affinity`.

One node list per provider, refreshed at most every `REFRESH` seconds and
shared by every create: a burst of thousands of creates costs one list, not
thousands. Steering is a preference, so nothing here fails a create: a
failed list is logged and the last one (or none) is used; a 403 (the
identity may not read nodes, see ``deploy/node-reader/``) turns steering off
with one warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from sandman.providers.kubernetes.api import Forbidden, KubeAPI
from sandman.providers.kubernetes.placement import image_affinity

__all__ = ["REFRESH", "NodeImages"]

logger = logging.getLogger(__name__)

REFRESH = 30.0
"""Seconds a node list is used before the next; the kubelet reports images about as often."""
FIRST_WAIT = 5.0
"""How long a create waits for the very first list; later ones never wait (the last list
stands in while the next one is fetched)."""


class NodeImages:
    """Preferred-affinity terms toward the nodes that hold an image, from a cached node list."""

    def __init__(
        self,
        api: KubeAPI,
        *,
        refresh: float = REFRESH,
        first_wait: float = FIRST_WAIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._refresh = refresh
        self._first_wait = first_wait
        self._clock = clock
        self._nodes: list[dict[str, Any]] | None = None
        self._listed_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        # image -> term, per node list: the term costs a scan of every node's images.
        self._terms: dict[str, dict[str, Any] | None] = {}
        self.enabled = True
        """False once the API said this identity may not list nodes."""

    async def term(self, image: str) -> dict[str, Any] | None:
        """The preferred scheduling term toward nodes holding `image`, or None (no node
        known to hold it, no node list yet, steering off, or an unparseable reference)."""
        if not self.enabled:
            return None
        if self._clock() - self._listed_at >= self._refresh and self._task is None:
            self._task = asyncio.create_task(self._list(), name="sandman-node-list")
        if self._nodes is None and self._task is not None:
            # The first list: worth a short wait, never a long one (nor a failure).
            await asyncio.wait({self._task}, timeout=self._first_wait)
        nodes = self._nodes
        if nodes is None:
            return None
        if image not in self._terms:
            try:
                self._terms[image] = image_affinity(image, nodes)
            except ValueError:
                # The create itself reports a bad reference (the kubelet's ImageError).
                self._terms[image] = None
        return self._terms[image]

    async def _list(self) -> None:
        try:
            nodes = await self._api.list_nodes()
        except Forbidden as exc:
            self.enabled = False
            logger.warning(
                "steering toward nodes that hold an image is off: this identity may not "
                "list nodes (grant it deploy/node-reader/): %s",
                exc,
            )
        except Exception:
            # Steering is a preference: keep the last list, try again after the interval.
            logger.warning("listing nodes for image steering failed", exc_info=True)
        else:
            self._nodes, self._terms = nodes, {}
        finally:
            self._listed_at = self._clock()
            self._task = None

    async def aclose(self) -> None:
        """Stop a list in flight."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
