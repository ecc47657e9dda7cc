"""Pool processes as owners on Kubernetes: one ``coordination.k8s.io/v1`` Lease each.

A pool process's pods carry ``sandman.io/owner=k.<lease name>``; the Lease, in the
pods' namespace, is created before the first pod and renewed every third of its
duration (one PATCH per interval per process, whatever the number of sandboxes),
and deleted on a clean close. A process killed with SIGKILL stops renewing: once
its Lease is judged dead, anyone may reap its pods (`sandman gc`, another pool's
reconcile), and then delete the Lease.

Judging a Lease (`OwnerJudge`) never compares two machines' clocks alone. Its
``renewTime`` is written with the holder's clock; a Lease that looks fresh by it is
``alive``. One that looks expired is ``dead`` only once this observer has seen it
unchanged (the same resourceVersion) for its duration plus a grace, on this
process's monotonic clock, through observations none of which failed: a holder
whose clock is behind ours, or that could not renew while the API server was
away (we could not observe either, or we stood still ourselves: our count starts
again), keeps its pods. Until then it is ``unknown``. A missing Lease is ``dead``:
it is created before its owner's first pod and deleted only after its last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandman import errors
from sandman.providers.base import BackendOwners, OwnerStatus
from sandman.providers.kubernetes.api import Conflict, KubeAPI
from sandman.providers.kubernetes.pods import MANAGED_BY

__all__ = ["PREFIX", "LeaseKeeper", "OwnerJudge", "forget", "lease_name", "micro_time"]

logger = logging.getLogger(__name__)

PREFIX = "k."
"""Owner values of this form name a Lease (``k.<lease name>``); the local form is ``p.``."""
LABEL_OWNER = "sandman.io/owner"  # sandman.pool.owner.LABEL_OWNER: the pool is a layer above


def lease_name(owner: str) -> str | None:
    """The Lease an owner value names; None for a value of another form."""
    if not owner.startswith(PREFIX) or len(owner) <= len(PREFIX):
        return None
    return owner[len(PREFIX) :]


def micro_time(at: float) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


@dataclass
class _Seen:
    version: str
    since: float  # monotonic: first seen at this version, in an unbroken run of observations
    last: float  # monotonic: seen last


class OwnerJudge:
    """Which Lease owners are alive, from repeated observations (see the module's docstring).

    Pure: times are passed in. ``grace`` is added to each Lease's own duration.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._seen: dict[str, _Seen] = {}

    def interrupted(self) -> None:
        """An observation failed: what was seen unchanged counts again from the next one."""
        self._seen.clear()

    def observe(
        self, leases: Iterable[Mapping[str, Any]], *, wall: float, now: float
    ) -> BackendOwners:
        """Judge ``leases`` (every Sandman Lease of the namespace, listed at ``wall`` on this
        host's clock and ``now`` on its monotonic clock)."""
        statuses: dict[str, OwnerStatus] = {}
        versions: dict[str, str] = {}
        seen: dict[str, _Seen] = {}
        pending = longest = 0.0
        for lease in leases:
            metadata = lease.get("metadata") or {}
            name = str(metadata.get("name", ""))
            version = str(metadata.get("resourceVersion", ""))
            spec = lease.get("spec") or {}
            if not name:
                continue
            duration = spec.get("leaseDurationSeconds")
            # Seen last longer ago than the Lease lasts: we cannot tell whether the API
            # server could be reached in between (this process stood still), so no
            # renewal can be said to have been missed: count again.
            gap = (duration if isinstance(duration, int) else 0) + self.grace
            previous = self._seen.get(name)
            if previous is None or previous.version != version or now - previous.last > gap:
                previous = _Seen(version, now, now)
            previous.last = now
            seen[name] = previous
            versions[PREFIX + name] = version
            status = statuses[PREFIX + name] = self._status(spec, previous, wall=wall, now=now)
            if isinstance(duration, int):
                longest = max(longest, gap)
                if status == "unknown":
                    pending = max(pending, previous.since + gap - now)
        self._seen = seen
        return BackendOwners(
            statuses=statuses,
            prefix=PREFIX,
            versions=versions,
            undecided_for=pending,
            longest=longest,
        )

    def _status(
        self, spec: Mapping[str, Any], seen: _Seen, *, wall: float, now: float
    ) -> OwnerStatus:
        duration = spec.get("leaseDurationSeconds")
        renewed = _parse_time(spec.get("renewTime")) or _parse_time(spec.get("acquireTime"))
        if not isinstance(duration, int) or renewed is None:
            return "unknown"  # not a Lease we wrote: never a reason to reap
        if renewed + duration > wall:
            return "alive"
        if now - seen.since >= duration + self.grace:
            return "dead"
        return "unknown"


class LeaseKeeper:
    """This process's Lease: created by `open`, renewed in the background, deleted by `close`."""

    def __init__(self, api: KubeAPI, *, duration: int) -> None:
        self.api = api
        self.duration = duration
        self.name = f"sandman-owner-{secrets.token_hex(6)}"
        self.owner = PREFIX + self.name
        host = socket.gethostname().split(".")[0][:40] or "host"
        self.holder = f"{host}/{os.getpid()}"
        self._task: asyncio.Task[None] | None = None
        self.renewals = 0
        self.failures = 0

    def _body(self, now: float) -> dict[str, Any]:
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "labels": {MANAGED_BY[0]: MANAGED_BY[1], LABEL_OWNER: self.owner},
            },
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": self.duration,
                "acquireTime": micro_time(now),
                "renewTime": micro_time(now),
            },
        }

    async def open(self) -> str:
        """Create the Lease (before any pod names it) and start renewing it."""
        await self.api.create_lease(self._body(time.time()))
        self._task = asyncio.create_task(self._renew(), name=f"sandman-lease-{self.name}")
        return self.owner

    async def _renew(self) -> None:
        interval = self.duration / 3
        while True:
            await asyncio.sleep(interval)
            try:
                # A renewal that hangs (an API server stalled) is a failed one: try again
                # soon, not after the client's own request timeout.
                async with asyncio.timeout(max(1.0, self.duration / 3)):
                    await self.api.patch_lease(
                        self.name, {"spec": {"renewTime": micro_time(time.time())}}
                    )
            except errors.SandboxNotFound:
                # Deleted by someone who took this process for dead (it stood still past
                # its Lease): claim it again, so what is left of its pods stays its own.
                logger.warning("lease %s was deleted: created again", self.name)
                with contextlib.suppress(errors.SandboxError):
                    await self.api.create_lease(self._body(time.time()))
            except (errors.SandboxError, TimeoutError) as exc:
                # The API server away for a moment: try again soon, well within the Lease.
                self.failures += 1
                logger.info("renewing lease %s failed: %s", self.name, exc)
                interval = min(1.0, self.duration / 3)
                continue
            self.renewals += 1
            interval = self.duration / 3

    async def close(self, *, delete: bool = True) -> None:
        """Stop renewing; delete the Lease (else it expires, and its pods are reaped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if delete:
            await self.api.delete_lease(self.name)


async def forget(api: KubeAPI, owner: str, version: str | None, pods_selector: str) -> bool:
    """Delete a dead owner's Lease if no pod names it any more (a consistent list) and it
    is still at ``version`` (else its holder came back). Whether it is gone."""
    name = lease_name(owner)
    if name is None:
        return False
    items, _ = await api.list_pods(f"{pods_selector},{LABEL_OWNER}={owner}")
    if items:
        return False
    try:
        await api.delete_lease(name, resource_version=version)
    except Conflict:
        return False
    return True
