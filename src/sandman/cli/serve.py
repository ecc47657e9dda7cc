"""``sandman serve``: the HTTP service over one pool, for many client processes.

Settings come from ``SANDMAN_*`` variables (`ServerSettings.from_env`:
``SANDMAN_API_KEYS="tenant:KEY,..."`` and the rest) and from the flags, which
win. SIGTERM and SIGINT shut it down gracefully: it stops accepting, lets
acquires in flight be answered, then releases every sandbox or leaves them
for the next instance of the same pool to adopt (``--on-shutdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click
from pydantic import ValidationError

from sandman import errors
from sandman.cli._common import Duration, fail, local_config
from sandman.models import SandboxSpec, explain

if TYPE_CHECKING:
    from sandman.client.watchdog import Watchdog
    from sandman.providers.base import Provider
    from sandman.server import ServerSettings, WarmSpares

PROVIDERS = ("local", "kubernetes")
_LISTEN_BACKLOG = 65535
# Longer than any client's idle expiry (httpx: 5 s, uvicorn's own default, so the two
# raced: a request sent on a connection the server was closing got a reset) and than a
# pause of the service's loop under load, after which every connection idle since
# before it was closed at once. Load balancers keep 60 s.
_KEEP_ALIVE = 75


def make_provider(ctx: click.Context, name: str) -> Provider:
    """The provider the service's pool runs on (``kubernetes`` takes its settings as JSON
    from ``SANDMAN_KUBERNETES``)."""
    if name == "local":
        from sandman.providers.local import LocalProvider

        return LocalProvider(local_config(ctx))
    try:
        from sandman.providers.kubernetes import KubernetesProvider
        from sandman.settings import KubernetesConfig
    except ImportError as exc:
        raise errors.ConfigError(
            f"the {name} provider is not available in this installation ({exc})"
        ) from exc
    # Its settings as JSON in one variable: kubeconfig, context, namespace...
    raw = os.environ.get("SANDMAN_KUBERNETES", "{}")
    try:
        config = KubernetesConfig.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise errors.ConfigError(f"SANDMAN_KUBERNETES: {problems}") from None
    return KubernetesProvider(config)


def check_api_keys(raw: str) -> None:
    """Each ``tenant:KEY`` of ``SANDMAN_API_KEYS`` whose key is refused, said plainly
    ("tenant x's key has 3 characters; use at least 16"), without the key."""
    from sandman.server import ApiKey

    for item in raw.split(","):
        tenant, sep, key = (part.strip() for part in item.partition(":"))
        if not sep:
            continue  # the settings say how keys are written
        try:
            ApiKey(tenant=tenant, key=key)
        except ValidationError as exc:
            problems = dict(explain(exc))
            if "key" in problems:
                raise errors.ConfigError(
                    f"SANDMAN_API_KEYS: tenant {tenant}'s key {problems['key']} "
                    "(e.g. openssl rand -hex 16)"
                ) from None
            raise errors.ConfigError(
                f"SANDMAN_API_KEYS: tenant name {tenant!r} is refused: use at most 63 of "
                "lowercase letters, digits, '.', '_' and '-'"
            ) from None


def default_pool_name() -> str:
    """Stable across restarts on one machine, so the next instance finds what was left."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname().lower())
    return f"serve-{host}"[:63].strip("-.")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--pool-name", envvar="SANDMAN_POOL_NAME", help="Default: serve-<hostname>.")
@click.option(
    "--provider",
    type=click.Choice(PROVIDERS),
    default="local",
    show_default=True,
    envvar="SANDMAN_PROVIDER",
)
@click.option(
    "--on-shutdown",
    type=click.Choice(["release", "leave"]),
    default=None,
    help="Release every sandbox at shutdown (default), or leave them for the next instance.",
)
@click.option(
    "--adopt/--no-adopt",
    default=True,
    show_default=True,
    help="At start, adopt running sandboxes a previous instance of this pool left.",
)
@click.option(
    "--lease",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds a silent client session keeps its sandboxes.",
)
@click.option(
    "--lifetime",
    type=Duration(),
    default="6h",
    show_default=True,
    help="Hard lifetime of every sandbox (30m, 2h, 1d): past it, it is deleted, held or not.",
)
@click.option("--anonymous-tenant", help="Requests without an API key act as this tenant.")
@click.option(
    "--warm",
    "warm",
    multiple=True,
    metavar="TENANT=IMAGE:N",
    help="Keep N ready spares of IMAGE (default limits) for TENANT; repeatable.",
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append the pool's events to this file (JSON lines) for `sandman report`.",
)
@click.option("--log-level", default="info", show_default=True)
@click.pass_context
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    pool_name: str | None,
    provider: str,
    on_shutdown: str | None,
    adopt: bool,
    lease: float,
    lifetime: float,
    anonymous_tenant: str | None,
    warm: tuple[str, ...],
    events: Path | None,
    log_level: str,
) -> None:
    """Serve the HTTP API (and /metrics) over one pool until SIGTERM or SIGINT."""
    spares = [_warm_spares(item) for item in warm]
    from sandman.server import ServerSettings

    debug: bool = ctx.obj["debug"]
    try:
        check_api_keys(os.environ.get("SANDMAN_API_KEYS", ""))
        release = None if on_shutdown is None else on_shutdown == "release"
        settings = ServerSettings.from_env(
            os.environ, release_on_shutdown=release, anonymous_tenant=anonymous_tenant
        )
        settings = settings.model_copy(update={"warm": [*settings.warm, *spares]})
        if not settings.api_keys and settings.anonymous_tenant is None:
            raise errors.ConfigError(
                "no API keys: set SANDMAN_API_KEYS=tenant:KEY[,tenant:KEY...] "
                "(or --anonymous-tenant NAME, for a single user on localhost)"
            )
        backend = make_provider(ctx, provider)
        asyncio.run(
            _serve(
                ctx,
                backend,
                settings,
                host=host,
                port=port,
                lease=lease,
                lifetime=lifetime,
                adopt=adopt,
                pool_name=pool_name or default_pool_name(),
                log_level=log_level,
                events=events,
            )
        )
    except (errors.SandboxError, OSError) as exc:
        fail(exc, debug)


def _warm_spares(item: str) -> WarmSpares:
    """``TENANT=IMAGE:N`` as spares; a usage error naming --warm otherwise."""
    from sandman.server import WarmSpares

    tenant, _, rest = item.partition("=")
    image, _, count = rest.rpartition(":")
    if not tenant or not image or not count.isdigit():
        raise click.BadParameter(
            f"{item!r} is not TENANT=IMAGE:N (e.g. team-a=busybox:latest:8)", param_hint="'--warm'"
        )
    try:
        return WarmSpares(tenant=tenant, spec=SandboxSpec(image=image), count=int(count))
    except ValidationError as exc:
        raise click.BadParameter(
            f"{item!r}: {exc.errors()[0]['msg']}", param_hint="'--warm'"
        ) from None


async def _serve(
    ctx: click.Context,
    provider: Provider,
    settings: ServerSettings,
    *,
    host: str,
    port: int,
    lease: float,
    lifetime: float,
    adopt: bool,
    pool_name: str,
    log_level: str,
    events: Path | None = None,
) -> None:
    import uvicorn

    from sandman.pool import EventLog, Pool, PoolConfig
    from sandman.server import create_app, service_of

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal after the graceful shutdown, which
            # kills the process before the watchdog is told and the provider closed.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def stop(self, sig: int) -> None:
            # Not ready from the signal on (/v1/ready), before uvicorn stops listening
            # and drains: a load balancer takes this instance out first.
            service_of(app).stop_accepting()
            self.handle_exit(sig, None)

    config = PoolConfig(name=pool_name, lease=lease, lifetime=lifetime, adopt_orphans=adopt)
    log = EventLog(events) if events is not None else None
    pool = Pool(provider, config, hook=log)
    app = create_app(pool, settings)
    watchdog = _watchdog(ctx, provider, pool_name) if settings.release_on_shutdown else None
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        ws="none",
        # A burst's acquires are long requests, each on a connection of its own: thousands
        # of clients' connections arrive at once and overflowed uvicorn's 2048 (the
        # kernel caps the queue at net.core.somaxconn: raise that for bigger bursts).
        backlog=_LISTEN_BACKLOG,
        timeout_keep_alive=_KEEP_ALIVE,
        # uvicorn waits this long for open requests (acquires) before the lifespan's
        # shutdown, which then gives what is still in flight its own grace.
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace)),
    )
    server = Server(server_config)
    mode = "release" if settings.release_on_shutdown else "leave"
    click.echo(
        f"sandman: pool {pool_name} on the {provider.name} provider, "
        f"http://{host}:{port} (on shutdown: {mode})",
        err=True,
    )
    try:
        await server.serve()
    finally:
        if watchdog is not None:
            watchdog.stop()
        if log is not None:
            log.close()
        close = getattr(provider, "aclose", None)
        if close is not None:
            await close()
    if not server.started:
        raise errors.ConfigError(f"could not serve on {host}:{port} (see the log above)")


def _watchdog(ctx: click.Context, provider: Provider, pool_name: str) -> Watchdog | None:
    """A local pool's watchdog: if the service is SIGKILLed, its sandboxes go too."""
    from sandman.client.watchdog import Watchdog

    if provider.name != "local":
        return None
    return Watchdog.start(local_config(ctx), pool_name)


COMMANDS: list[click.Command] = [serve]
