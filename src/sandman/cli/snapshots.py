"""``sandman snapshot save|ls|rm``, ``fork``, ``restore``, ``pause`` and ``resume``.

Without --url they act on this machine's local provider (sandboxes from `sandman
create`); a snapshot made here expires after its --ttl (`sandman gc` deletes it then).
With --url they act on the tenant's sandboxes at a service. ``snapshot save --as-image
REF --kubernetes`` makes a pod of a namespace an image in a registry.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from sandman import errors
from sandman.cli._common import (
    Duration,
    age,
    client_options,
    echo_table,
    kubernetes_options,
    kubernetes_provider,
    local_config,
    run_async,
    service_or_local,
)
from sandman.cli.images import credentials, in_cli_terms, registry_options
from sandman.cli.sandboxes import create_ready
from sandman.pool.records import LABEL_EXPIRES
from sandman.pool.snapshots import expires_at
from sandman.providers.local import LocalProvider

if TYPE_CHECKING:
    from sandman.client.remote import RemoteBackend
    from sandman.images.registry import Credentials
    from sandman.providers.kubernetes import KubernetesProvider

__all__ = ["COMMANDS"]


def _size(n: int) -> str:
    for unit, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


@click.group("snapshot")
def snapshot() -> None:
    """Keep a sandbox's files, list what is kept, delete it."""


@snapshot.command("save")
@click.argument("sandbox_id", metavar="ID")
@click.option("--ttl", type=Duration(), default="1h", show_default=True, help="Its lifetime.")
@click.option("--memory", is_flag=True, help="Its processes too (needs runtime runsc).")
@click.option(
    "--as-image",
    "as_image",
    metavar="NAME|REF",
    help="Make it an image instead: NAME in this machine's store (create IMAGE=NAME "
    "later), or with --kubernetes REF (REPOSITORY:TAG) pushed to a registry.",
)
@click.option(
    "--kubernetes",
    "on_kubernetes",
    is_flag=True,
    help="With --as-image: ID is a pod of a namespace (its daemon reachable from here).",
)
@kubernetes_options("With --kubernetes: the pod's (default: the context's).")
@registry_options
@client_options
@click.pass_context
def save(
    ctx: click.Context,
    sandbox_id: str,
    ttl: float,
    memory: bool,
    as_image: str | None,
    on_kubernetes: bool,
    kubeconfig: Path | None,
    context: str | None,
    namespace: str | None,
    insecure: bool,
    creds: str | None,
    authfile: Path | None,
    url: str | None,
    api_key: str | None,
) -> None:
    """Keep sandbox ID's files as a snapshot and print its id; the sandbox goes on.

    With --as-image NAME, its files over its image's become the image NAME instead.
    With --kubernetes too, ID is a pod, and its files over its image's are pushed as
    image REF (only the layer the registry lacks is uploaded); prints it by digest
    (REPOSITORY@sha256:...), for later sandboxes' image. Registry options as for
    `sandman images push`."""
    if on_kubernetes and as_image is None:
        raise click.UsageError(
            "--kubernetes goes with --as-image REF: a pod's snapshot is kept by its pool "
            "(the SDK's `sb.snapshot()`)"
        )
    if (insecure or creds or authfile) and not on_kubernetes:
        raise click.UsageError("--insecure, --creds and --authfile go with --kubernetes")
    if as_image is not None:
        if url:
            raise click.UsageError(
                "--as-image writes to this machine's image store, or with --kubernetes to "
                "a registry; a service's store is shared by its tenants, so it takes no "
                "images from them"
            )
        if on_kubernetes:
            auth = credentials(creds, authfile, as_image)
            kube = kubernetes_provider(kubeconfig, context, namespace)
            call = _push_image(kube, sandbox_id, as_image, auth, not insecure)
            pushed = run_async(ctx, in_cli_terms(call))
            click.echo(pushed)
            click.echo(f"a sandbox of it: SandboxSpec(image={pushed!r})", err=True)
            return
        run_async(ctx, _as_image(ctx, sandbox_id, as_image))
        click.echo(as_image)
        click.echo(f"`sandman create {as_image}` makes a sandbox of it", err=True)
        return

    async def remote(backend: RemoteBackend) -> str:
        return (await backend.snapshot(sandbox_id, memory=memory, ttl=ttl)).id

    async def local(provider: LocalProvider) -> str:
        labels = {LABEL_EXPIRES: f"{time.time() + ttl:.0f}"}
        return (await provider.snapshot(sandbox_id, labels=labels, memory=memory)).id

    snapshot_id = service_or_local(ctx, url, api_key, remote, local)
    click.echo(snapshot_id)
    click.echo(
        f"`sandman fork {snapshot_id}` makes a sandbox of it; it is deleted in {age(ttl)}",
        err=True,
    )


async def _as_image(ctx: click.Context, sandbox_id: str, name: str) -> None:
    provider = LocalProvider(local_config(ctx))
    try:
        labels = {LABEL_EXPIRES: f"{time.time() + 600:.0f}"}
        snap = await provider.snapshot(sandbox_id, labels=labels)
        try:
            await provider.save_image(snap.id, name)
        finally:
            await provider.delete_snapshot(snap.id)
    finally:
        await provider.aclose()


async def _push_image(
    provider: KubernetesProvider,
    sandbox_id: str,
    reference: str,
    auth: Credentials | None,
    tls_verify: bool,
) -> str:
    """Snapshot the pod, push the snapshot as ``reference`` and delete it; the image by
    digest."""
    from sandman.images.registry import PROBE_TIMEOUT, parse_reference, probe_registry

    try:
        # A bad reference or an unreachable registry at once, before the pod is read.
        target = parse_reference(reference)
        await probe_registry(target, tls_verify=tls_verify, timeout=PROBE_TIMEOUT, action="push")
        labels = {LABEL_EXPIRES: f"{time.time() + 600:.0f}"}
        try:
            snap = await provider.snapshot(sandbox_id, labels=labels)
        except errors.SandboxNotFound:
            raise errors.SandboxNotFound(
                f"no pod {sandbox_id} in namespace {provider.namespace} (--namespace)"
            ) from None
        try:
            digest = await provider.save_image(snap.id, reference, auth=auth, tls_verify=tls_verify)
        finally:
            await provider.delete_snapshot(snap.id)
    finally:
        await provider.aclose()
    return f"{target.name.removesuffix(f':{target.tag}')}@{digest}"


@snapshot.command("ls")
@client_options
@click.pass_context
def list_snapshots(ctx: click.Context, url: str | None, api_key: str | None) -> None:
    """List the snapshots (this machine's, or with --url the tenant's)."""
    now = time.time()

    async def remote(backend: RemoteBackend) -> list[tuple[str, ...]]:
        return [
            (s.id, s.image, _size(s.size), age(now - s.created_at), age(s.expires_at - now),
             s.source or "-")
            for s in await backend.snapshots()
        ]  # fmt: skip

    async def local(provider: LocalProvider) -> list[tuple[str, ...]]:
        return [
            (s.id, s.image, _size(s.size), age(now - s.created_at),
             age(expires_at(s) - now), s.source or "-")
            for s in await provider.snapshots()
        ]  # fmt: skip

    rows = service_or_local(ctx, url, api_key, remote, local)
    header = ("ID", "IMAGE", "SIZE", "AGE", "EXPIRES IN", "SOURCE")
    echo_table(header, rows, empty="no snapshots (`sandman snapshot save ID` makes one)")


@snapshot.command("rm")
@click.argument("ids", nargs=-1, required=True)
@client_options
@click.pass_context
def remove(ctx: click.Context, ids: tuple[str, ...], url: str | None, api_key: str | None) -> None:
    """Delete snapshots; sandboxes made from them keep their files."""

    async def remote(backend: RemoteBackend) -> None:
        for snapshot_id in ids:
            await backend.delete_snapshot(snapshot_id)
            click.echo(f"deleted {snapshot_id}")

    async def local(provider: LocalProvider) -> None:
        known = {s.id for s in await provider.snapshots()}
        for snapshot_id in ids:
            await provider.delete_snapshot(snapshot_id)
            there = snapshot_id in known
            click.echo(f"deleted {snapshot_id}" if there else f"{snapshot_id} was already gone")

    service_or_local(ctx, url, api_key, remote, local)


@click.command()
@click.argument("source", metavar="SNAPSHOT|ID")
@click.option("-n", "count", type=click.IntRange(1, 1000), default=1, show_default=True)
@click.option("--ttl", type=Duration(), default="1h", show_default=True, help="Their lifetime.")
@click.option("--timeout", type=float, default=600.0, show_default=True)
@click.pass_context
def fork(ctx: click.Context, source: str, count: int, ttl: float, timeout: float) -> None:
    """Make N sandboxes from a snapshot, or from sandbox ID as it is now; print their ids.

    This machine's sandboxes (as `sandman create` makes): a service's forks belong to a
    client session, so use the SDK's `sb.fork(n)` there."""

    async def go(provider: LocalProvider) -> list[str]:
        made_here = None
        snapshot_id = source
        if source.startswith("sb-"):
            labels = {LABEL_EXPIRES: f"{time.time() + 600:.0f}"}
            made_here = (await provider.snapshot(source, labels=labels)).id
            snapshot_id = made_here
        try:
            spec = (await asyncio.to_thread(provider.snapshot_store.get, snapshot_id)).spec
            if spec is None:
                raise errors.SnapshotNotFound(f"snapshot {snapshot_id} records no spec")
            spec = spec.model_copy(update={"snapshot": snapshot_id})
            return list(
                await asyncio.gather(
                    *(create_ready(provider, spec, ttl, timeout) for _ in range(count))
                )
            )
        finally:
            if made_here is not None:
                await provider.delete_snapshot(made_here)

    async def refuse(backend: RemoteBackend) -> list[str]:
        raise AssertionError("unreachable")  # pragma: no cover

    for sandbox_id in service_or_local(ctx, None, None, refuse, go):
        click.echo(sandbox_id)


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.argument("snapshot_id", metavar="SNAPSHOT")
@client_options
@click.pass_context
def restore(
    ctx: click.Context, sandbox_id: str, snapshot_id: str, url: str | None, api_key: str | None
) -> None:
    """Reset sandbox ID to SNAPSHOT in place (same id; its processes end)."""

    async def remote(backend: RemoteBackend) -> None:
        await backend.restore(sandbox_id, snapshot_id)

    async def local(provider: LocalProvider) -> None:
        info = await provider.restore(sandbox_id, snapshot_id)
        if info.endpoint is not None:
            async with info.endpoint.client() as daemon:
                await daemon.wait_ready(60)

    service_or_local(ctx, url, api_key, remote, local)
    click.echo(f"restored {sandbox_id} to {snapshot_id}")


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option("--memory", is_flag=True, help="Free its memory too: checkpointed (runsc).")
@client_options
@click.pass_context
def pause(
    ctx: click.Context, sandbox_id: str, memory: bool, url: str | None, api_key: str | None
) -> None:
    """Stop every process of sandbox ID (no CPU) until `sandman resume ID`; with --memory,
    checkpointed to disk (no memory either; gVisor with its own network stack)."""

    async def remote(backend: RemoteBackend) -> None:
        await backend.pause(sandbox_id, memory=memory)

    async def local(provider: LocalProvider) -> None:
        await provider.pause(sandbox_id, memory=memory)

    service_or_local(ctx, url, api_key, remote, local)
    click.echo(f"paused {sandbox_id}")


@click.command()
@click.argument("sandbox_id", metavar="ID")
@client_options
@click.pass_context
def resume(ctx: click.Context, sandbox_id: str, url: str | None, api_key: str | None) -> None:
    """Let paused sandbox ID run again."""

    async def remote(backend: RemoteBackend) -> None:
        await backend.resume(sandbox_id)

    async def local(provider: LocalProvider) -> None:
        await provider.resume(sandbox_id)

    service_or_local(ctx, url, api_key, remote, local)
    click.echo(f"resumed {sandbox_id}")


COMMANDS: list[click.Command] = [snapshot, fork, restore, pause, resume]
