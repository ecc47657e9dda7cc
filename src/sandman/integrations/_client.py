"""The client every adapter in a process shares: one per event loop and backend.

Frameworks build sandbox environments from a class path and a few keywords,
many per process (one per sample, trial or rollout), so the adapters never
open a client of their own: they ask `shared_client` for this event loop's,
which keeps one pool (and its pacing) behind every sandbox. The backend is
``url`` or ``SANDMAN_URL`` (the service, with the key from
``SANDMAN_API_KEY``: never an argument, so never in a config a framework
writes down), else the embedded pool of `sandman.local` on ``state_dir``.

A client lives until `close_shared_clients` (inspect's ``task_cleanup``) or
the process ends: the embedded pool's watchdog, or the service's session
lease, then deletes what it still held.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from pathlib import Path

from sandman.client import AsyncClient, connect, local

__all__ = ["API_KEY_VARIABLE", "URL_VARIABLE", "close_shared_clients", "shared_client"]

logger = logging.getLogger(__name__)

URL_VARIABLE = "SANDMAN_URL"
API_KEY_VARIABLE = "SANDMAN_API_KEY"

_Key = tuple[str, str, bool | None]
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, AsyncClient]] = (
    weakref.WeakKeyDictionary()
)


def _key(url: str | None, state_dir: str | os.PathLike[str] | None, via_proxy: bool | None) -> _Key:
    if url:
        return ("service", url.rstrip("/"), via_proxy)
    return ("local", str(Path(state_dir)) if state_dir is not None else "", None)


def shared_client(
    *,
    url: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    via_proxy: bool | None = None,
) -> AsyncClient:
    """This event loop's client for the service at ``url`` (default ``$SANDMAN_URL``),
    or, with neither, for the embedded local pool on ``state_dir`` (default: the
    local provider's). Made on first use; call it from a coroutine."""
    loop = asyncio.get_running_loop()
    url = url or os.environ.get(URL_VARIABLE) or None
    key = _key(url, state_dir, via_proxy)
    clients = _clients.setdefault(loop, {})
    client = clients.get(key)
    if client is None:
        if url:
            api_key = os.environ.get(API_KEY_VARIABLE) or None
            client = connect(url, api_key=api_key, via_proxy=via_proxy)
            logger.debug("sandman: a client for the service at %s", url)
        else:
            client = local() if state_dir is None else local(state_dir=Path(state_dir))
            logger.debug("sandman: an embedded local pool (%s)", state_dir or "default state_dir")
        clients[key] = client
    return client


async def close_shared_clients() -> None:
    """Close this event loop's clients (releasing whatever they still hold)."""
    clients = _clients.pop(asyncio.get_running_loop(), {})
    for client in clients.values():
        await client.aclose()
