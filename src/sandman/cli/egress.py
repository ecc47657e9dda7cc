"""``sandman egress ID``: change where a running egress sandbox may connect."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from sandman.cli._common import client_options, local_config, remote_backend, run_async
from sandman.egress import Egress
from sandman.providers.local import LocalProvider

if TYPE_CHECKING:
    from sandman.client.remote import RemoteBackend

__all__ = ["COMMANDS"]


@click.command()
@click.argument("sandbox_id", metavar="ID")
@click.option("--allow", "allow", multiple=True, help="A CIDR, domain or *.domain (repeat).")
@click.option("--deny", "deny", multiple=True, help="Never there, whatever --allow says (repeat).")
@click.option(
    "--anywhere", is_flag=True, help="Anywhere but --deny (and the walls) instead of a list."
)
@client_options
@click.pass_context
def egress(
    ctx: click.Context,
    sandbox_id: str,
    allow: tuple[str, ...],
    deny: tuple[str, ...],
    anywhere: bool,
    url: str | None,
    api_key: str | None,
) -> None:
    """Set where egress sandbox ID may connect, at once (what it has open too):
    only --allow (none given: nowhere, the network closed), or --anywhere."""
    if anywhere and allow:
        raise click.UsageError("--anywhere and --allow: choose one")
    rules = Egress(allow=None if anywhere else list(allow), deny=list(deny))

    async def go() -> None:
        if url:
            backend: RemoteBackend = remote_backend(url, api_key)
            try:
                await backend.set_egress(sandbox_id, rules)
            finally:
                await backend.aclose()
            return
        provider = LocalProvider(local_config(ctx))
        try:
            await provider.set_egress(sandbox_id, rules)
        finally:
            await provider.aclose()

    run_async(ctx, go())
    where = "anywhere" if rules.allow is None else ", ".join(rules.allow) or "nowhere"
    denied = f" but {', '.join(rules.deny)}" if rules.deny else ""
    click.echo(f"egress of {sandbox_id}: {where}{denied}")


COMMANDS: list[click.Command] = [egress]
