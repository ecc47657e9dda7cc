"""What every command shares: error reporting, running a coroutine, the client options."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

import click
from pydantic import ValidationError

from sandman import errors
from sandman.models import SandboxSpec, explain, parse_bytes
from sandman.settings import KubernetesConfig, LocalConfig

if TYPE_CHECKING:
    from sandman.client import AsyncClient, RemoteBackend
    from sandman.daemon import DaemonClient
    from sandman.providers.kubernetes import KubernetesProvider
    from sandman.providers.local import LocalProvider

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_HINTS: dict[type[errors.SandboxError], str] = {
    errors.ImageNotFound: (
        "get it first: `sandman images pull REF`, `sandman images build -f Dockerfile "
        "CONTEXT -t NAME`, or `sandman images import ARCHIVE --name NAME`"
    ),
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
    """The local provider's settings: the root's --state-dir, and ``SANDMAN_RUNTIME``,
    ``SANDMAN_CGROUP_PARENT`` and ``SANDMAN_BEYOND_HOST`` from the environment."""
    values: dict[str, object] = {}
    if ctx.obj["state_dir"]:
        values["state_dir"] = Path(ctx.obj["state_dir"])
    for field in ("runtime", "cgroup_parent", "beyond_host"):
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


def service_or_local(
    ctx: click.Context,
    url: str | None,
    api_key: str | None,
    remote: Callable[[RemoteBackend], Awaitable[T]],
    local: Callable[[LocalProvider], Awaitable[T]],
) -> T:
    """``remote`` against the service at ``url``, else ``local`` against this machine's
    provider; either closed after (the provider unmounts its disk filesystem if no
    sandbox is left)."""
    from sandman.providers.local import LocalProvider

    async def go() -> T:
        if url:
            backend = remote_backend(url, api_key)
            try:
                return await remote(backend)
            finally:
                await backend.aclose()
        provider = LocalProvider(local_config(ctx))
        try:
            return await local(provider)
        finally:
            await provider.aclose()

    return run_async(ctx, go())


def kubernetes_options(namespace_help: str) -> Callable[[F], F]:
    """Add --kubeconfig, --context and --namespace (``namespace_help``): the cluster and
    namespace of a command's --kubernetes (`kubernetes_provider`)."""

    def add(command: F) -> F:
        command = click.option("--namespace", help=namespace_help)(command)
        command = click.option("--context", help="With --kubernetes: the kubeconfig context.")(
            command
        )
        return click.option(
            "--kubeconfig",
            envvar="KUBECONFIG",
            type=click.Path(path_type=Path),
            help="With --kubernetes. Default: $KUBECONFIG, else the pod's service account.",
        )(command)

    return add


def kubernetes_provider(
    kubeconfig: Path | None, context: str | None, namespace: str | None
) -> KubernetesProvider:
    """The provider of the namespace that `kubernetes_options` name; BadParameter for a
    namespace Kubernetes would refuse."""
    from sandman.providers.kubernetes import KubernetesProvider  # its HTTP stack, on demand

    try:
        config = KubernetesConfig(kubeconfig=kubeconfig, context=context, namespace=namespace)
    except ValidationError as exc:
        raise click.BadParameter(exc.errors()[0]["msg"], param_hint="--namespace") from None
    return KubernetesProvider(config)


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


class Size(click.ParamType[int]):
    """A byte quantity: ``512Mi``, ``2Gi``, ``1G`` or bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size (try 512Mi)", param, ctx)


class Duration(click.ParamType[float]):
    """Seconds, or a number with a unit: ``90s``, ``30m``, ``2h``, ``1d``."""

    name = "duration"
    _UNITS: ClassVar[dict[str, int]] = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        number, unit = text.rstrip("smhd"), text[len(text.rstrip("smhd")) :]
        try:
            seconds = float(number) * self._UNITS[unit]
        except (KeyError, ValueError):
            self.fail(f"{value!r} is not a duration (try 30m, 2h or 3600)", param, ctx)
        if seconds <= 0:
            self.fail(f"{value!r} is not a duration: it must be more than 0", param, ctx)
        return seconds


def limit_options(command: F) -> F:
    """Add --cpu, --memory and --network: a sandbox's limits (checked by `spec_of`)."""
    command = click.option(
        "--network", type=click.Choice(["none", "isolated", "egress"]), default="none"
    )(command)
    command = click.option(
        "--memory", type=Size(), default="1Gi", show_default=True, help="e.g. 512Mi, 2Gi."
    )(command)
    return click.option("--cpu", type=float, default=1.0, show_default=True, help="Cores.")(command)


# The option (or argument) of each spec field the commands set.
_OPTION_OF = {"image": "IMAGE", "cpu": "--cpu", "memory": "--memory", "pids": "--pids",
              "disk": "--disk", "network": "--network"}  # fmt: skip


def spec_of(image: str, **fields: Any) -> SandboxSpec:
    """The spec the options describe (None: the default); a bad value is the usage
    error of its option (``Invalid value for '--cpu': must be more than 0, not 0``)."""
    try:
        return SandboxSpec(image=image, **{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        field, words = explain(exc)[0]
        option = _OPTION_OF.get(field.split(".")[0], field)
        raise click.BadParameter(words, param_hint=f"'{option}'") from None


def echo_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], *, empty: str) -> None:
    """``rows`` under ``header`` in aligned columns; ``empty`` alone when there are none."""
    if not rows:
        click.echo(empty)
        return
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def age(seconds: float) -> str:
    """``42s``, ``7m``, ``3h``, ``2d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"
