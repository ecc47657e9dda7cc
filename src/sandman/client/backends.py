"""Where a client gets its sandboxes: a pool in this process, or (later) the service over HTTP.

The client talks to a `Backend`; only acquire, release and heartbeat go
through it. Commands and files go straight to the sandbox's daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import Pool
from sandman.providers.base import DaemonEndpoint

__all__ = ["Backend", "InProcessBackend", "Lease"]


@dataclass(frozen=True)
class Lease:
    """A sandbox handed to a session: where its daemon is, and when it must be gone."""

    id: str
    endpoint: DaemonEndpoint
    expires_at: float


class Backend(Protocol):
    @property
    def name(self) -> str:
        """Where the sandboxes come from, for events and logs (a pool's name, a URL)."""
        ...

    async def open_session(self) -> str: ...
    async def heartbeat(self, session: str) -> None: ...
    async def close_session(self, session: str) -> None: ...
    async def acquire(self, spec: SandboxSpec, *, session: str, timeout: float | None) -> Lease: ...
    async def release(self, sandbox_id: str) -> None: ...
    async def alive(self, sandbox_id: str) -> bool: ...
    async def timeline(self, sandbox_id: str) -> dict[str, float]: ...
    async def aclose(self) -> None: ...


class InProcessBackend:
    """A backend over a `Pool` in this process (``sandman.local()``)."""

    def __init__(self, pool: Pool, *, own_pool: bool = True) -> None:
        self.pool = pool
        self._own_pool = own_pool
        self._timelines: dict[str, dict[str, float]] = {}

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.pool.config.name

    async def open_session(self) -> str:
        await self.pool.start()
        return self.pool.open_session()

    async def heartbeat(self, session: str) -> None:
        self.pool.heartbeat(session)

    async def close_session(self, session: str) -> None:
        self.pool.close_session(session)

    async def acquire(self, spec: SandboxSpec, *, session: str, timeout: float | None) -> Lease:
        record = await self.pool.acquire(spec, session=session, timeout=timeout)
        if record.info is None or record.info.endpoint is None:
            self.pool.release(record.id)  # the caller never gets it
            raise errors.ProviderError(f"sandbox {record.id} has no daemon endpoint")
        # Kept after release too, so a caller can still see where the time went.
        self._timelines[record.id] = record.timeline
        return Lease(record.id, record.info.endpoint, record.expires_at)

    async def release(self, sandbox_id: str) -> None:
        self.pool.release(sandbox_id)

    async def alive(self, sandbox_id: str) -> bool:
        try:
            record = self.pool.get(sandbox_id)
        except errors.SandboxNotFound:
            return False
        if record.state != "leased":
            return False
        try:
            return (await self.pool.provider.inspect(sandbox_id)).state == "running"
        except errors.SandboxNotFound:
            return False

    async def timeline(self, sandbox_id: str) -> dict[str, float]:
        return dict(self._timelines.get(sandbox_id, {}))

    async def aclose(self) -> None:
        if self._own_pool:
            await self.pool.aclose()
