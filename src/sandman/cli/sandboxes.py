"""Sandbox commands: ``run``, ``ls``, ``rm``, ``gc``."""

from __future__ import annotations

import sys
import time

import click

from sandman.cli._common import client_options, local_config, open_client, run_async
from sandman.providers.local import LocalProvider


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("image")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--cpu", type=float, default=1.0, show_default=True)
@click.option("--memory", default="1Gi", show_default=True)
@click.option("--network", type=click.Choice(["none", "isolated", "egress"]), default="none")
@click.option("--timeout", type=float, default=None, help="Seconds the command may run.")
@client_options
@click.pass_context
def run(
    ctx: click.Context, image: str, command: tuple[str, ...], cpu: float, memory: str,
    network: str, timeout: float | None, url: str | None, api_key: str | None,
) -> None:  # fmt: skip
    """Run one command in a fresh sandbox, print its output, release it: run IMAGE -- CMD..."""

    async def go() -> int:
        client = open_client(ctx, url, api_key)
        async with (
            client,
            client.sandbox(image, cpu=cpu, memory=memory, network=network, timeout=600) as sb,
        ):
            result = await sb.exec(list(command), timeout=timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        return result.exit_code

    sys.exit(run_async(ctx, go()))


@click.command("ls")
@click.pass_context
def list_sandboxes(ctx: click.Context) -> None:
    """List this machine's sandboxes (local provider)."""
    infos = run_async(ctx, LocalProvider(local_config(ctx)).list())
    now = time.time()
    for info in infos:
        pool = info.labels.get("sandman.io/pool", "-")
        age = now - info.created_at
        click.echo(f"{info.id}  {info.state:<8}  {info.image:<24}  {age:8.0f}s  pool={pool}")


@click.command("rm")
@click.argument("ids", nargs=-1, required=True)
@click.pass_context
def remove(ctx: click.Context, ids: tuple[str, ...]) -> None:
    """Delete sandboxes by id (local provider)."""

    async def go() -> None:
        provider = LocalProvider(local_config(ctx))
        for sandbox_id in ids:
            await provider.delete(sandbox_id)
            click.echo(f"deleted {sandbox_id}")

    run_async(ctx, go())


@click.command()
@click.option(
    "--all", "everything", is_flag=True, help="Delete every sandbox, not just stale ones."
)
@click.pass_context
def gc(ctx: click.Context, everything: bool) -> None:
    """Reap now: sandboxes past their hard lifetime, and ones that are not running."""

    async def go() -> int:
        provider = LocalProvider(local_config(ctx))
        now = time.time()
        reaped = 0
        for info in await provider.list():
            expires = float(info.labels.get("sandman.io/expires-at", "inf") or "inf")
            stale = info.state != "running" and now - info.created_at > 60
            if everything or expires < now or stale:
                await provider.delete(info.id)
                reaped += 1
        return reaped

    click.echo(f"reaped {run_async(ctx, go())} sandbox(es)")


COMMANDS: list[click.Command] = [run, list_sandboxes, remove, gc]
