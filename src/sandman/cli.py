"""The ``sandman`` command line."""

from __future__ import annotations

import sys

try:
    import click
except ImportError:  # pragma: no cover - depends on the install
    click = None  # type: ignore[assignment]

from sandman.providers.local.host import check_host

__all__ = ["main"]


def _doctor(runtime: str) -> int:
    findings = check_host(runtime)
    for finding in findings:
        mark = "ok " if finding.ok else "FAIL"
        line = f"[{mark}] {finding.what}"
        if not finding.ok:
            line += f"\n       fix: {finding.fix}"
        click.echo(line)
    failed = sum(not f.ok for f in findings)
    click.echo("ready for the local provider" if not failed else f"{failed} problem(s) to fix")
    return 1 if failed else 0


def _build() -> click.Group:
    @click.group()
    @click.version_option(package_name="sandman-rl")
    def cli() -> None:
        """Sandboxes for agentic reinforcement learning."""

    @cli.command()
    @click.option(
        "--runtime", type=click.Choice(["crun", "runc"]), default="crun", show_default=True
    )
    def doctor(runtime: str) -> None:
        """Tell what this machine lacks for the local provider, and how to fix it."""
        sys.exit(_doctor(runtime))

    return cli


def main() -> None:
    """Entry point of the ``sandman`` command."""
    if click is None:
        sys.stderr.write("the sandman command needs its extra: pip install 'sandman-rl[cli]'\n")
        sys.exit(2)
    _build()()
