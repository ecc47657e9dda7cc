"""What every command shares: error reporting, running a coroutine, the client options."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from pydantic import ValidationError

from sandman import errors
from sandman.settings import LocalConfig

if TYPE_CHECKING:
    from sandman.client import AsyncClient, RemoteBackend
    from sandman.daemon import DaemonClient

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_HINTS: dict[type[errors.SandboxError], str] = {
    errors.ImageNotFound: "import it first: sandman images import ARCHIVE --name NAME",
    errors.ImageError: "check the archive or reference; `sandman images ls` lists what is here",
    errors.CapacityError: "the machine is full: release sandboxes or try again later",
    errors.CreateTimeout: "raise --timeout, or check `sandman doctor`",
    errors.SandboxNotFound: "`sandman ls` lists the sandboxes",
    errors.DaemonUnavailable: "the sandbox's daemon is not answering; it may have died",
}


_KUBERNETES_HINT = (
    "check the Kubernetes configuration: --kubeconfig / KUBECONFIG and --context "
    "(`sandman serve`: SANDMAN_KUBERNETES), and the identity's permissions"
)
# A ConfigError's fix depends on whose configuration it is: by the module that raised it.
_CONFIG_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("sandman.providers.kubernetes", "sandman.cli.prepare"), _KUBERNETES_HINT),
    (("sandman.client.remote",),
     "check --url and --api-key (SANDMAN_URL, SANDMAN_API_KEY)"),
    (("sandman.server",),
     "check the service's SANDMAN_* variables and options: `sandman serve --help`"),
    (("sandman.providers.local", "sandman.images", "sandman.cli._common"),
     "`sandman doctor` checks this machine"),
)  # fmt: skip
_KUBERNETES_WORDS = ("kubeconfig", "SANDMAN_KUBERNETES", "Kubernetes")


def _raised_in(exc: BaseException) -> str:
    """The module whose code raised ``exc`` (its traceback's innermost frame)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", ""))


def _config_hint(exc: errors.ConfigError) -> str:
    where = _raised_in(exc)
    for modules, text in _CONFIG_HINTS:
        if any(where == m or where.startswith(f"{m}.") for m in modules):
            return text
    if any(word in str(exc) for word in _KUBERNETES_WORDS):  # e.g. serve's SANDMAN_KUBERNETES
        return _KUBERNETES_HINT
    return "check the command's arguments and options (--help)"


def hint(exc: errors.SandboxError) -> str:
    """The one-line suggestion shown under an error; a `ConfigError`'s fits whose
    configuration it is (the Kubernetes one, the service's, this machine's...)."""
    if isinstance(exc, errors.ConfigError):
        return _config_hint(exc)
    for cls in type(exc).__mro__:
        if cls in _HINTS:
            return _HINTS[cls]
    return "run with --debug for the details"


def fail(exc: BaseException, debug: bool) -> NoReturn:
    """Report ``exc`` as one line and a hint (or re-raise it with --debug) and exit 1."""
    if debug:
        raise exc
    click.echo(f"error: {exc}", err=True)
    if isinstance(exc, errors.SandboxError):
        click.echo(f"hint: {hint(exc)}", err=True)
    sys.exit(1)


def run_async(ctx: click.Context, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion; errors become one line and a hint."""
    debug: bool = ctx.obj["debug"]
    try:
        return asyncio.run(coro)
    except (errors.SandboxError, OSError) as exc:
        fail(exc, debug)


def local_config(ctx: click.Context) -> LocalConfig:
    """The local provider's settings: the root's --state-dir, and ``SANDMAN_RUNTIME`` and
    ``SANDMAN_CGROUP_PARENT`` from the environment."""
    values: dict[str, object] = {}
    if ctx.obj["state_dir"]:
        values["state_dir"] = Path(ctx.obj["state_dir"])
    for field in ("runtime", "cgroup_parent"):
        if os.environ.get(f"SANDMAN_{field.upper()}"):
            values[field] = os.environ[f"SANDMAN_{field.upper()}"]
    try:
        return LocalConfig.model_validate(values)
    except ValidationError as exc:
        raise errors.ConfigError(f"invalid local provider settings: {_one_line(exc)}") from None


def _one_line(exc: ValidationError) -> str:
    """Pydantic's report on one line: ``field: message (got value)`` per problem."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})" for e in exc.errors()
    )


def client_options(command: F) -> F:
    """Add --url and --api-key: talk to a service instead of the local pool."""
    command = click.option(
        "--api-key", envvar="SANDMAN_API_KEY", help="The service's API key (SANDMAN_API_KEY)."
    )(command)
    return click.option(
        "--url", envvar="SANDMAN_URL", help="A Sandman service instead of the local pool."
    )(command)


def open_client(
    ctx: click.Context, url: str | None, api_key: str | None, *, via_proxy: bool = False
) -> AsyncClient:
    """A client for the service at ``url`` (``via_proxy``: reach daemons through its
    proxy route), or for an embedded local pool."""
    from sandman.client import connect, local

    if url:
        return connect(url, api_key=api_key or "", via_proxy=via_proxy or None)
    return local(local_config(ctx))


def via_proxy_option(command: F) -> F:
    """Add --via-proxy: reach the daemon through the service's proxy route."""
    return click.option(
        "--via-proxy",
        is_flag=True,
        help="With --url: commands and files go through the service, not to the daemon.",
    )(command)


def remote_backend(url: str, api_key: str | None, *, via_proxy: bool = False) -> RemoteBackend:
    """The service at ``url``, for commands that act on sandboxes by id."""
    from sandman.client import RemoteBackend

    return RemoteBackend(url, api_key=api_key or "", via_proxy=via_proxy or None)


async def daemon_client(
    ctx: click.Context,
    sandbox_id: str,
    url: str | None,
    api_key: str | None,
    *,
    via_proxy: bool = False,
) -> DaemonClient:
    """A client of the daemon of sandbox ``sandbox_id``: one of the tenant's at the service
    (``url``), or one the local provider lists. Close it with ``aclose``."""
    if url:
        backend = remote_backend(url, api_key, via_proxy=via_proxy)
        try:
            endpoint = await backend.endpoint(sandbox_id)
        finally:
            await backend.aclose()
        return endpoint.client()
    from sandman.providers.local import LocalProvider

    info = await LocalProvider(local_config(ctx)).inspect(sandbox_id)
    if info.state != "running" or info.endpoint is None:
        raise errors.SandboxNotFound(f"sandbox {sandbox_id} is {info.state}, not running")
    return info.endpoint.client()
