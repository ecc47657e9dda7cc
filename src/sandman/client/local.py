"""``sandman.local()`` and ``sandman.kubernetes()``: a client with an in-process pool on
the local or the Kubernetes provider."""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any, TypeVar

from pydantic import ValidationError

from sandman import errors
from sandman.client._async import AsyncClient
from sandman.client._sync import Client
from sandman.client.backends import InProcessBackend
from sandman.client.watchdog import Watchdog
from sandman.pool import Pool, PoolConfig
from sandman.pool.events import EventHook
from sandman.providers.local import LocalProvider
from sandman.settings import KubernetesConfig, LocalConfig

__all__ = ["LocalBackend", "kubernetes", "kubernetes_sync", "local", "local_sync"]


class LocalBackend(InProcessBackend):
    """The embedded pool plus its watchdog, which cleans up if this process is killed."""

    def __init__(self, pool: Pool, config: LocalConfig) -> None:
        super().__init__(pool, own_provider=True)
        self._config = config
        self._watchdog: Watchdog | None = None

    async def open_session(self) -> str:
        if self._watchdog is None:
            self._watchdog = Watchdog.start(self._config, self.pool.config.name)
        return await super().open_session()

    async def aclose(self) -> None:
        await super().aclose()
        if self._watchdog is not None:
            self._watchdog.stop()


def local(
    config: LocalConfig | None = None,
    *,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
    **settings: Any,
) -> AsyncClient:
    """An `AsyncClient` whose sandboxes come from a pool in this process (the local provider).

    ``async with sandman.local() as client: async with client.sandbox("busybox") as sb: ...``
    Every sandbox it made is deleted when the client closes, and, by a watchdog
    process, if this process dies without closing it (even by SIGKILL).
    ``hook`` gets the pool's lifecycle events and the client's ``session.replaced``.
    The provider's settings are a `LocalConfig`, or its fields as keywords
    (``state_dir=``, ``runtime=``, ``cgroup_parent=``, ``disk=``...).
    """
    config = _config(LocalConfig, config, settings)
    provider = LocalProvider(config)
    return AsyncClient(
        LocalBackend(Pool(provider, pool or _own_pool("local"), hook=hook), config),
        heartbeat_interval=heartbeat_interval,
        hook=hook,
    )


def local_sync(
    config: LocalConfig | None = None,
    *,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
    **settings: Any,
) -> Client:
    """The blocking twin of `local`: ``with sandman.local_sync() as client: ...``."""
    return Client(
        local(config, pool=pool, hook=hook, heartbeat_interval=heartbeat_interval, **settings)
    )


def kubernetes(
    config: KubernetesConfig | None = None,
    *,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
    **settings: Any,
) -> AsyncClient:
    """An `AsyncClient` whose sandboxes are pods, from a pool in this process.

    ``sandman.kubernetes(kubeconfig="~/.kube/config", namespace="sandman")``: the
    provider's settings are a `KubernetesConfig`, or its fields as keywords.
    Every sandbox it made is deleted when the client closes. The pool's name
    (the pods' ``sandman.io/pool`` label) is this process's own unless
    ``pool`` names one: a pool deletes the pods of its name it does not know.
    """
    from sandman.providers.kubernetes import KubernetesProvider  # its HTTP stack, on demand

    provider = KubernetesProvider(_config(KubernetesConfig, config, settings))
    return AsyncClient(
        InProcessBackend(Pool(provider, pool or _own_pool("k8s"), hook=hook), own_provider=True),
        heartbeat_interval=heartbeat_interval,
        hook=hook,
    )


def kubernetes_sync(
    config: KubernetesConfig | None = None,
    *,
    pool: PoolConfig | None = None,
    hook: EventHook | None = None,
    heartbeat_interval: float = 5.0,
    **settings: Any,
) -> Client:
    """The blocking twin of `kubernetes`: ``with sandman.kubernetes_sync(...) as client: ...``."""
    return Client(
        kubernetes(config, pool=pool, hook=hook, heartbeat_interval=heartbeat_interval, **settings)
    )


_C = TypeVar("_C", LocalConfig, KubernetesConfig)


def _config(kind: type[_C], config: _C | None, settings: dict[str, Any]) -> _C:
    """``config``, or one made of ``settings`` (a ConfigError naming what is wrong)."""
    if config is not None and settings:
        raise errors.ConfigError(
            f"give a {kind.__name__} or its fields as keywords, not both: {sorted(settings)}"
        )
    if config is not None:
        return config
    try:
        return kind.model_validate(settings)
    except ValidationError as exc:
        raise errors.ConfigError(f"invalid {kind.__name__}: {exc}") from None


def _own_pool(prefix: str) -> PoolConfig:
    """A pool of this process's own name: no later pool adopts it, so its hand-overs
    need no record (a relabel each: ~1 ms locally, a PATCH on Kubernetes)."""
    return PoolConfig(name=_pool_name(prefix), record_hand_over=False)


def _pool_name(prefix: str) -> str:
    """This process's own pool name, a valid label value (at most 63 characters)."""
    host = socket.gethostname().split(".")[0][:32].strip("-_.") or "host"
    return f"{prefix}-{host}-{os.getpid()}-{secrets.token_hex(3)}"
