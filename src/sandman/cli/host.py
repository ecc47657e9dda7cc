"""``sandman doctor``: what this machine lacks for the local provider."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sandman.providers.local.host import check_capacity, check_gvisor, check_host


@click.command()
@click.option("--runtime", type=click.Choice(["crun", "runc"]), default="crun", show_default=True)
@click.option(
    "--sandboxes",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="how many idle sandboxes the host must hold at once: checks the kernel "
    "parameters that grow with the count",
)
def doctor(runtime: str, sandboxes: int) -> None:
    """Tell what this machine lacks for the local provider, and how to fix it."""
    findings = check_host(runtime) + check_capacity(sandboxes)
    for finding in findings:
        mark = "ok " if finding.ok else "FAIL"
        line = f"[{mark}] {finding.what}"
        if not finding.ok:
            line += f"\n       fix: {finding.fix}"
        click.echo(line)
    for line in check_gvisor(_built_runsc()):
        click.echo(f"[info] {line}")
    failed = sum(not f.ok for f in findings)
    click.echo("ready for the local provider" if not failed else f"{failed} problem(s) to fix")
    sys.exit(1 if failed else 0)


def _built_runsc() -> Path | None:
    """``hack/gvisor/.bin/runsc`` of the checkout this runs from, if it is one."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "hack" / "gvisor" / "build").exists():
            return parent / "hack" / "gvisor" / ".bin" / "runsc"
    return None


COMMANDS: list[click.Command] = [doctor]
