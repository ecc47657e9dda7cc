"""``sandman images``: the local image store."""

from __future__ import annotations

from pathlib import Path

import click

from sandman.cli._common import Size, echo_table, local_config, run_async
from sandman.images import ImageStore
from sandman.images.build import BUILD_MEMORY
from sandman.providers.local.snapshots import image_users


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


@images.command("pull")
@click.argument("reference")
@click.option("--insecure", is_flag=True, help="Plain HTTP / unverified TLS registry.")
@click.pass_context
def images_pull(ctx: click.Context, reference: str, insecure: bool) -> None:
    """Pull an image from a registry (skopeo)."""
    image = run_async(ctx, _store(ctx).pull(reference, tls_verify=not insecure))
    click.echo(f"{image.short_id}  {', '.join(image.names)}")


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
