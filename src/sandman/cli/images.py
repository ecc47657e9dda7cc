"""``sandman images``: the local image store."""

from __future__ import annotations

from pathlib import Path

import click

from sandman.cli._common import echo_table, local_config, run_async
from sandman.images import ImageStore


def _store(ctx: click.Context) -> ImageStore:
    return ImageStore(local_config(ctx).state_dir / "images")


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
@click.pass_context
def images_prune(ctx: click.Context) -> None:
    """Remove stored layers that no image uses (images and their layers stay)."""
    report = run_async(ctx, _store(ctx).prune())
    click.echo(f"removed {len(report.layers)} layers, {report.bytes / 2**20:.1f} MiB")


COMMANDS: list[click.Command] = [images]
