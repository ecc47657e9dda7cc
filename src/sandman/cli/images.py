"""``sandman images``: the local image store.

``pull`` and ``push`` take registry credentials one way: ``--creds USER[:PASSWORD]``
(the password from ``SANDMAN_REGISTRY_PASSWORD``, else asked for without echo), or
``--authfile PATH`` (a containers-auth.json file), or ``SANDMAN_REGISTRY_USER`` and
``SANDMAN_REGISTRY_PASSWORD``; and ``--insecure`` for a plain-HTTP registry. No
password is printed, logged or put on a command line.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from sandman.cli._common import Size, echo_table, local_config, run_async
from sandman.errors import ImageError
from sandman.images import ImageStore, RegistryAuth
from sandman.images.build import BUILD_MEMORY
from sandman.images.registry import AUTH_REMEDY, TLS_REMEDY, Credentials, parse_reference
from sandman.providers.local.snapshots import image_users

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

USER_ENV = "SANDMAN_REGISTRY_USER"
PASSWORD_ENV = "SANDMAN_REGISTRY_PASSWORD"


def _store(ctx: click.Context) -> ImageStore:
    state = local_config(ctx).state_dir
    return ImageStore(state / "images", in_use=image_users(state))


@click.group()
def images() -> None:
    """The local image store."""


@images.command("import")
@click.argument("archive", type=click.Path(exists=True, path_type=Path))
@click.option("--name", help="Name it (e.g. task:1); docker archives carry their own.")
@click.pass_context
def images_import(ctx: click.Context, archive: Path, name: str | None) -> None:
    """Import a docker-save or OCI archive, an OCI layout dir, or a rootfs tarball."""
    store = _store(ctx)
    image = run_async(
        ctx,
        store.import_oci_layout(archive, name=name)
        if archive.is_dir()
        else store.import_archive(archive, name=name),
    )
    click.echo(f"{image.short_id}  {', '.join(image.names) or '<none>'}")


def registry_options(command: F) -> F:
    """Add --insecure, --creds and --authfile: how ``pull`` and ``push`` reach a registry."""
    command = click.option(
        "--authfile",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Credentials from this containers-auth.json file (as `podman login` writes).",
    )(command)
    command = click.option(
        "--creds",
        metavar="USER[:PASSWORD]",
        help=f"Registry credentials; without PASSWORD, ${PASSWORD_ENV} or a prompt "
        f"(also ${USER_ENV}).",
    )(command)
    insecure = click.option(
        "--insecure", is_flag=True, help="Plain HTTP / unverified TLS registry."
    )
    return insecure(command)


def credentials(creds: str | None, authfile: Path | None, reference: str) -> Credentials | None:
    """The credentials the options and the environment give (None: none), a missing
    password asked for without echo. Never shows the password, in errors neither."""
    # Empty is unset, as for the other SANDMAN_* variables.
    user_env, password_env = os.environ.get(USER_ENV) or None, os.environ.get(PASSWORD_ENV) or None
    if creds is not None and authfile is not None:
        raise click.UsageError("give --creds or --authfile, not both")
    if authfile is not None:
        return authfile
    if creds is None:
        if not user_env:
            if password_env:
                raise click.UsageError(f"${PASSWORD_ENV} is set but ${USER_ENV} is not")
            return None
        user, password = user_env, password_env
    else:
        user, colon, given = creds.partition(":")
        if not user:
            # Not the value: it may hold the password.
            raise click.BadParameter(
                "the user name is empty (USER[:PASSWORD])", param_hint="--creds"
            )
        password = given if colon else password_env
    if password is None:
        try:
            registry = parse_reference(reference).registry
        except ImageError:
            registry = reference  # the command reports it
        password = click.prompt(f"Password for {user} at {registry}", hide_input=True, err=True)
    return RegistryAuth(username=user, password=password)


async def in_cli_terms(call: Awaitable[T]) -> T:
    """`call`, its registry errors saying the CLI's options where they name the API's."""
    try:
        return await call
    except ImageError as exc:
        text = str(exc).replace(TLS_REMEDY, "pass --insecure")
        text = text.replace(AUTH_REMEDY, "give --creds USER or --authfile PATH")
        if text == str(exc):
            raise
        raise type(exc)(text) from exc


@images.command("pull")
@click.argument("reference")
@registry_options
@click.pass_context
def images_pull(
    ctx: click.Context, reference: str, insecure: bool, creds: str | None, authfile: Path | None
) -> None:
    """Pull an image from a registry (skopeo)."""
    auth = credentials(creds, authfile, reference)
    call = _store(ctx).pull(reference, auth=auth, tls_verify=not insecure)
    image = run_async(ctx, in_cli_terms(call))
    click.echo(f"{image.short_id}  {', '.join(image.names)}")


@images.command("push")
@click.argument("name")
@click.argument("reference")
@registry_options
@click.option(
    "--timeout", type=float, default=3600.0, show_default=True, help="Seconds for the whole push."
)
@click.pass_context
def images_push(
    ctx: click.Context,
    name: str,
    reference: str,
    insecure: bool,
    creds: str | None,
    authfile: Path | None,
    timeout: float,
) -> None:
    """Push image NAME of this store to a registry as REFERENCE (skopeo); print it by
    digest (REPOSITORY@sha256:...), as a pod's image. Layers the registry has are not
    uploaded again."""
    auth = credentials(creds, authfile, reference)
    call = _store(ctx).push(name, reference, auth=auth, tls_verify=not insecure, timeout=timeout)
    digest = run_async(ctx, in_cli_terms(call))
    target = parse_reference(reference)
    repository = target.name.removesuffix(f":{target.tag}")
    click.echo(f"pushed {name} to {target.name}", err=True)
    click.echo(f"{repository}@{digest}")


@images.command("build")
@click.argument(
    "context", type=click.Path(exists=True, file_okay=False, path_type=Path), default="."
)
@click.option(
    "-f",
    "--file",
    "dockerfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The Dockerfile (default: CONTEXT/Dockerfile).",
)
@click.option("-t", "--tag", "name", help="Name the image (e.g. task:1).")
@click.option(
    "--build-arg", "build_args", multiple=True, metavar="KEY=VALUE", help="An ARG's value."
)
@click.option("--network", is_flag=True, help="Let RUN steps use the host's network.")
@click.option("--no-cache", is_flag=True, help="Build from nothing, without buildah's cache.")
@click.option(
    "--memory", type=Size(), default=BUILD_MEMORY, show_default="4Gi", help="Each RUN step's limit."
)
@click.pass_context
def images_build(
    ctx: click.Context,
    context: Path,
    dockerfile: Path | None,
    name: str | None,
    build_args: tuple[str, ...],
    network: bool,
    no_cache: bool,
    memory: int,
) -> None:
    """Build an image from a Dockerfile with buildah; FROM names an image of this store."""
    args: dict[str, str] = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--build-arg")
        args[key] = value
    image = run_async(
        ctx,
        _store(ctx).build(
            dockerfile if dockerfile is not None else context / "Dockerfile",
            context,
            name=name,
            build_args=args,
            network=network,
            cache=not no_cache,
            memory=memory,
        ),
    )
    click.echo(f"{image.short_id}  {', '.join(image.names) or '<none>'}")


@images.command("ls")
@click.pass_context
def images_ls(ctx: click.Context) -> None:
    """List imported images."""
    rows = [
        (image.short_id, f"{image.size / 2**20:.1f} MiB", ", ".join(image.names) or "<none>")
        for image in run_async(ctx, _store(ctx).list())
    ]
    empty = "no images (`sandman images import ARCHIVE` or `sandman images pull REF` adds one)"
    echo_table(("ID", "SIZE", "NAMES"), rows, empty=empty)


@images.command("rm")
@click.argument("reference")
@click.pass_context
def images_rm(ctx: click.Context, reference: str) -> None:
    """Remove an image name (the image goes with its last name)."""
    run_async(ctx, _store(ctx).remove(reference))
    click.echo(f"removed {reference}")


@images.command("prune")
@click.option("--build-cache", is_flag=True, help="Also drop buildah's build cache.")
@click.pass_context
def images_prune(ctx: click.Context, build_cache: bool) -> None:
    """Remove stored layers that no image uses (images and their layers stay)."""
    store = _store(ctx)
    report = run_async(ctx, store.prune())
    click.echo(f"removed {len(report.layers)} layers, {report.bytes / 2**20:.1f} MiB")
    if build_cache:
        freed = run_async(ctx, store.drop_build_cache())
        click.echo(f"dropped the build cache, {freed / 2**20:.1f} MiB")


COMMANDS: list[click.Command] = [images]
