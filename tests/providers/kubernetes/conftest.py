"""What the Kubernetes unit tests share: a real HTTP server on loopback standing in
for the API server (a fault injector), and the provider's own client pointed at it."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.credentials import Credentials


@contextlib.asynccontextmanager
async def loopback(routes: Mapping[str, Handler]) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 answering ``routes`` (any method); yields its URL."""
    app = web.Application()
    for path, handle in routes.items():
        app.router.add_route("*", path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def kube_api(url: str) -> AsyncIterator[KubeAPI]:
    """The provider's API client for the server at ``url``, namespace ``ns``."""
    credentials = Credentials(server=url, namespace="ns", ssl_context=ssl.create_default_context())
    client = KubeAPI(credentials, timeout=5)
    try:
        yield client
    finally:
        await client.aclose()


def plugin_script(path: Path, body: str) -> Path:
    """An executable sh script (an exec credential plugin) that counts its runs in
    ``<path>.runs``, read by `runs`."""
    path.write_text(f'#!/bin/sh\necho run >> "{path}.runs"\n{body}\n')
    path.chmod(0o755)
    return path


def runs(script: Path) -> int:
    counter = Path(f"{script}.runs")
    return len(counter.read_text().splitlines()) if counter.exists() else 0
