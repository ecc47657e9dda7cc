"""The ``sandman`` command line.

Only this package (and the server) read the environment: ``SANDMAN_STATE_DIR``,
``SANDMAN_URL``, ``SANDMAN_API_KEY``, the local provider's ``SANDMAN_RUNTIME``,
``SANDMAN_CGROUP_PARENT`` and ``SANDMAN_BEYOND_HOST`` and, for ``serve``,
``SANDMAN_API_KEYS``.
Errors are one readable line and a hint; ``--debug`` shows the traceback.

One module per command group; each exposes click commands that `build`
attaches to the root group.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import click

__all__ = ["build", "main"]


def build() -> click.Group:
    """The root ``sandman`` command group with every subcommand attached."""
    import click

    from sandman import errors
    from sandman.cli import (
        bench,
        egress,
        host,
        images,
        prepare,
        report,
        sandboxes,
        serve,
        shell,
        snapshots,
    )
    from sandman.cli import eval as evaluation
    from sandman.cli._common import fail

    class Root(click.Group):
        # Errors raised outside run_async (settings read before any coroutine
        # starts) still become one line and a hint, not a traceback.
        def invoke(self, ctx: click.Context) -> object:
            try:
                return super().invoke(ctx)
            except (errors.SandboxError, OSError) as exc:
                fail(exc, bool(ctx.obj and ctx.obj.get("debug")))

    @click.group(cls=Root)
    @click.version_option(package_name="sandman-rl")
    @click.option("--debug", is_flag=True, help="Show tracebacks.")
    @click.option(
        "--state-dir", envvar="SANDMAN_STATE_DIR", help="Local state (default /var/lib/sandman)."
    )
    @click.pass_context
    def cli(ctx: click.Context, debug: bool, state_dir: str | None) -> None:
        """Sandboxes for agentic reinforcement learning."""
        ctx.obj = {"debug": debug, "state_dir": state_dir}

    for module in (
        host,
        sandboxes,
        snapshots,
        egress,
        images,
        serve,
        prepare,
        shell,
        evaluation,
        bench,
        report,
    ):
        for command in module.COMMANDS:
            cli.add_command(command)
    return cli


_build = build  # the name the tests have used


def main() -> None:
    """Entry point of the ``sandman`` command."""
    try:
        import click  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the install
        sys.stderr.write("the sandman command needs its extra: pip install 'sandman-rl[cli]'\n")
        sys.exit(2)
    build()()
