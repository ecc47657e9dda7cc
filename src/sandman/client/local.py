"""``sandman.local()``: a client with an in-process pool on the local provider."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from sandman.client._async import AsyncClient
from sandman.client._sync import Client
from sandman.client.backends import InProcessBackend
from sandman.pool import Pool, PoolConfig
from sandman.pool.events import EventHook
from sandman.pool.watchdog import Watchdog
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig

__all__ = ["LocalBackend", "local", "local_sync"]


class LocalBackend(InProcessBackend):
    """The embedded pool plus its watchdog, which cleans up if this process is killed."""

    def __init__(self, pool: Pool, config: LocalConfig) -> None:
        super().__init__(pool)
        self._config = config
        self._watchdog: Watchdog | None = None

    async def open_session(self) -> str:
        if self._watchdog is None:
            self._watchdog = Watchdog.start(self._config, self.pool.config.name)
        return await super().open_session()

    async def aclose(self) -> None:
        await super().aclose()
        # Its sandboxes are gone: the provider unmounts its disk filesystem if no other holds a layer.
        await self.pool.provider.aclose()
        if self._watchdog is not None:
            self._watchdog.stop()


def local(
    *,
    state_dir: str | Path | None = None,
    runtime: str | None = None,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
) -> AsyncClient:
    """An `AsyncClient` whose sandboxes come from a pool in this process (the local provider).

    ``async with sandman.local() as client: async with client.sandbox("busybox") as sb: ...``
    Every sandbox it made is deleted when the client closes, and, by a watchdog
    process, if this process dies without closing it (even by SIGKILL).
    ``hook`` gets the pool's lifecycle events and the client's ``session.replaced``.
    """
    settings: dict[str, object] = {}
    if state_dir is not None:
        settings["state_dir"] = Path(state_dir)
    if runtime is not None:
        settings["runtime"] = runtime
    config = LocalConfig.model_validate(settings)
    name = f"local-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    # A name of its own, swept by its watchdog: no later pool adopts it, so its
    # hand-overs need no record (a relabel each, ~1 ms).
    pool_config = pool or PoolConfig(name=name, record_hand_over=False)
    provider = LocalProvider(config)
    return AsyncClient(
        LocalBackend(Pool(provider, pool_config, hook=hook), config),
        heartbeat_interval=heartbeat_interval, hook=hook,
    )  # fmt: skip


def local_sync(
    *,
    state_dir: str | Path | None = None,
    runtime: str | None = None,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
) -> Client:
    """The blocking twin of `local`: ``with sandman.local_sync() as client: ...``."""
    return Client(
        local(state_dir=state_dir, runtime=runtime, pool=pool, hook=hook,
              heartbeat_interval=heartbeat_interval)
    )  # fmt: skip
