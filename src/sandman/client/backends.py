"""Where a client gets its sandboxes: a pool in this process, or the service over HTTP.

The client talks to a `Backend`; only acquire, release and heartbeat go
through it. Commands and files go straight to the sandbox's daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sandman import errors
from sandman.egress import Egress
from sandman.models import SandboxSpec, Snapshot, Usage
from sandman.pool import Pool
from sandman.pool.snapshots import to_snapshot
from sandman.providers.base import DaemonEndpoint

__all__ = ["Backend", "InProcessBackend", "Lease"]


@dataclass(frozen=True)
class Lease:
    """A sandbox handed to a session: where its daemon is, and when it must be gone.

    ``timeline`` is where the sandbox's time went, kept with the sandbox
    (never in a table of the backend's, which would grow with every sandbox
    a long run ever acquires); a backend may update it in place.
    """

    id: str
    endpoint: DaemonEndpoint
    expires_at: float
    timeline: dict[str, float] = field(default_factory=dict)


class Backend(Protocol):
    @property
    def name(self) -> str:
        """Where the sandboxes come from, for events and logs (a pool's name, a URL)."""
        ...

    async def open_session(self) -> str: ...
    async def heartbeat(self, session: str) -> None: ...
    async def close_session(self, session: str) -> None: ...
    async def acquire(self, spec: SandboxSpec, *, session: str, timeout: float | None) -> Lease: ...
    async def release(self, sandbox_id: str) -> Usage | None:
        """Give the sandbox back; what it used, read just before, if the backend can tell."""
        ...

    async def usage(self, sandbox_id: str) -> Usage | None: ...
    async def warm(self, spec: SandboxSpec, count: int) -> None:
        """Keep ``count`` ready spares of ``spec`` (0: none)."""
        ...

    async def check(self, sandbox_id: str) -> None:
        """Return if the sandbox is held and runs; raise `SandboxLost` (with the reason)
        if it died, `SandboxNotFound` if it is gone otherwise (released, expired)."""
        ...

    async def timeline(self, lease: Lease) -> dict[str, float]: ...
    async def aclose(self) -> None: ...

    # Snapshots (`AsyncSandbox.snapshot`, `fork`, `restore`, `pause`, `resume`).
    async def snapshot(self, sandbox_id: str, *, memory: bool, ttl: float | None) -> Snapshot: ...
    async def get_snapshot(self, snapshot_id: str) -> Snapshot: ...
    async def snapshots(self) -> list[Snapshot]: ...
    async def delete_snapshot(self, snapshot_id: str) -> None: ...
    async def restore(self, sandbox_id: str, snapshot_id: str) -> DaemonEndpoint:
        """Reset the sandbox to the snapshot; its daemon's new endpoint."""
        ...

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None: ...
    async def resume(self, sandbox_id: str) -> None: ...
    async def set_egress(self, sandbox_id: str, egress: Egress) -> None: ...

    async def build_image(
        self, dockerfile: Path, context: Path, *, name: str, network: bool, cache: bool, reuse: bool
    ) -> None:
        """Build ``dockerfile`` over ``context`` as image ``name`` where the sandboxes are
        made; with ``reuse``, an image already stored under ``name`` is taken as it is."""
        ...


class InProcessBackend:
    """A backend over a `Pool` in this process (``sandman.local()``, ``sandman.kubernetes()``).

    Closing it closes the pool (``own_pool``) and then its provider (``own_provider``).
    """

    def __init__(self, pool: Pool, *, own_pool: bool = True, own_provider: bool = False) -> None:
        self.pool = pool
        self._own_pool = own_pool
        self._own_provider = own_provider

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
        # The pool's own record of it, stamped on until gone: the caller sees
        # where the time went even after the release.
        return Lease(record.id, record.info.endpoint, record.expires_at, record.timeline)

    async def release(self, sandbox_id: str) -> Usage | None:
        try:
            used = await self.pool.usage(sandbox_id)
        except (errors.SandboxError, OSError):
            used = None  # gone already, or unreadable: the release goes on
        self.pool.release(sandbox_id)
        return used

    async def usage(self, sandbox_id: str) -> Usage | None:
        return await self.pool.usage(sandbox_id)

    async def warm(self, spec: SandboxSpec, count: int) -> None:
        self.pool.warm(spec, count)

    async def check(self, sandbox_id: str) -> None:
        await self.pool.check(sandbox_id)

    async def timeline(self, lease: Lease) -> dict[str, float]:
        return dict(lease.timeline)

    async def snapshot(self, sandbox_id: str, *, memory: bool, ttl: float | None) -> Snapshot:
        return to_snapshot(await self.pool.snapshot(sandbox_id, memory=memory, ttl=ttl))

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return to_snapshot(self.pool.get_snapshot(snapshot_id))

    async def snapshots(self) -> list[Snapshot]:
        return [to_snapshot(info) for info in self.pool.snapshots()]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.pool.delete_snapshot(snapshot_id)

    async def restore(self, sandbox_id: str, snapshot_id: str) -> DaemonEndpoint:
        record = await self.pool.restore(sandbox_id, snapshot_id)
        if record.info is None or record.info.endpoint is None:
            raise errors.ProviderError(f"sandbox {sandbox_id} has no daemon endpoint")
        return record.info.endpoint

    async def pause(self, sandbox_id: str, *, memory: bool = False) -> None:
        await self.pool.pause(sandbox_id, memory=memory)

    async def resume(self, sandbox_id: str) -> None:
        await self.pool.resume(sandbox_id)

    async def set_egress(self, sandbox_id: str, egress: Egress) -> None:
        await self.pool.set_egress(sandbox_id, egress)

    async def build_image(
        self, dockerfile: Path, context: Path, *, name: str, network: bool, cache: bool, reuse: bool
    ) -> None:
        from sandman.images import ImageStore  # the local provider's store, when it has one

        store = getattr(self.pool.provider, "images", None)
        if not isinstance(store, ImageStore):
            raise errors.ConfigError(
                f"the {self.pool.provider.name} provider takes its images from a registry: "
                "build there (`sandman images build`, then push) and name the image"
            )
        if reuse:
            try:
                await store.get(name)
                return
            except errors.ImageNotFound:
                pass
        await store.build(dockerfile, context, name=name, network=network, cache=cache)

    async def aclose(self) -> None:
        if self._own_pool:
            await self.pool.aclose()
        if self._own_provider:
            # Its sandboxes are gone; the provider's own resources go now (a
            # local one unmounts its disk filesystem if no other holds a layer).
            await self.pool.provider.aclose()
