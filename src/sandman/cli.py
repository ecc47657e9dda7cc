"""The ``sandman`` command line.

Only this module (and the server) read the environment: ``SANDMAN_STATE_DIR``,
``SANDMAN_URL``, ``SANDMAN_API_KEY`` and, for ``serve``, ``SANDMAN_API_KEYS``.
Errors are one readable line and a hint; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

try:
    import click
except ImportError:  # pragma: no cover - depends on the install
    click = None  # type: ignore[assignment]

from sandman import errors
from sandman.providers.local.host import check_host

__all__ = ["main"]

T = TypeVar("T")

_HINTS: dict[type[errors.SandboxError], str] = {
    errors.ImageNotFound: "import it first: sandman images import ARCHIVE --name NAME",
    errors.ImageError: "check the archive or reference; `sandman images ls` lists what is here",
    errors.ConfigError: "`sandman doctor` checks this machine",
    errors.CapacityError: "the machine is full: release sandboxes or try again later",
    errors.CreateTimeout: "raise --timeout, or check `sandman doctor`",
    errors.SandboxNotFound: "`sandman ls` lists the sandboxes",
    errors.DaemonUnavailable: "the sandbox's daemon is not answering; it may have died",
}


def _hint(exc: errors.SandboxError) -> str:
    for cls in type(exc).__mro__:
        if cls in _HINTS:
            return _HINTS[cls]
    return "run with --debug for the details"


def _fail(exc: BaseException, debug: bool) -> NoReturn:
    if debug:
        raise exc
    click.echo(f"error: {exc}", err=True)
    if isinstance(exc, errors.SandboxError):
        click.echo(f"hint: {_hint(exc)}", err=True)
    sys.exit(1)


def _run(coro: Coroutine[Any, Any, T], debug: bool) -> T:
    try:
        return asyncio.run(coro)
    except errors.SandboxError as exc:
        _fail(exc, debug)
    except OSError as exc:
        _fail(exc, debug)


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
    from sandman.settings import LocalConfig

    def local_config(ctx: click.Context) -> LocalConfig:
        # ctx.obj is the root's, inherited by every subcommand.
        state = ctx.obj["state_dir"]
        return LocalConfig(state_dir=Path(state)) if state else LocalConfig()

    @click.group()
    @click.version_option(package_name="sandman-rl")
    @click.option("--debug", is_flag=True, help="Show tracebacks.")
    @click.option(
        "--state-dir", envvar="SANDMAN_STATE_DIR", help="Local state (default /var/lib/sandman)."
    )
    @click.pass_context
    def cli(ctx: click.Context, debug: bool, state_dir: str | None) -> None:
        """Sandboxes for agentic reinforcement learning."""
        ctx.obj = {"debug": debug, "state_dir": state_dir}

    @cli.command()
    @click.option(
        "--runtime", type=click.Choice(["crun", "runc"]), default="crun", show_default=True
    )
    def doctor(runtime: str) -> None:
        """Tell what this machine lacks for the local provider, and how to fix it."""
        sys.exit(_doctor(runtime))

    @cli.command(context_settings={"ignore_unknown_options": True})
    @click.argument("image")
    @click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
    @click.option("--cpu", type=float, default=1.0, show_default=True)
    @click.option("--memory", default="1Gi", show_default=True)
    @click.option("--network", type=click.Choice(["none", "isolated", "egress"]), default="none")
    @click.option("--timeout", type=float, default=None, help="Seconds the command may run.")
    @click.option(
        "--url", envvar="SANDMAN_URL", help="A Sandman service instead of the local pool."
    )
    @click.option("--api-key", envvar="SANDMAN_API_KEY")
    @click.pass_context
    def run(
        ctx: click.Context, image: str, command: tuple[str, ...], cpu: float, memory: str,
        network: str, timeout: float | None, url: str | None, api_key: str | None,
    ) -> None:  # fmt: skip
        """Run one command in a fresh sandbox, print its output, release it: run IMAGE -- CMD..."""
        from sandman.client import connect, local

        async def go() -> int:
            client = (
                connect(url, api_key=api_key or "")
                if url
                else local(state_dir=local_config(ctx).state_dir)
            )
            async with (
                client,
                client.sandbox(image, cpu=cpu, memory=memory, network=network, timeout=600) as sb,
            ):
                result = await sb.exec(list(command), timeout=timeout)
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            return result.exit_code

        sys.exit(_run(go(), ctx.obj["debug"]))

    @cli.command("ls")
    @click.pass_context
    def list_sandboxes(ctx: click.Context) -> None:
        """List this machine's sandboxes (local provider)."""
        from sandman.providers.local import LocalProvider

        async def go() -> None:
            infos = await LocalProvider(local_config(ctx)).list()
            now = time.time()
            for info in infos:
                pool = info.labels.get("sandman.io/pool", "-")
                age = now - info.created_at
                click.echo(
                    f"{info.id}  {info.state:<8}  {info.image:<24}  {age:8.0f}s  pool={pool}"
                )

        _run(go(), ctx.obj["debug"])

    @cli.command("rm")
    @click.argument("ids", nargs=-1, required=True)
    @click.pass_context
    def remove(ctx: click.Context, ids: tuple[str, ...]) -> None:
        """Delete sandboxes by id (local provider)."""
        from sandman.providers.local import LocalProvider

        async def go() -> None:
            provider = LocalProvider(local_config(ctx))
            for sandbox_id in ids:
                await provider.delete(sandbox_id)
                click.echo(f"deleted {sandbox_id}")

        _run(go(), ctx.obj["debug"])

    @cli.command()
    @click.option(
        "--all", "everything", is_flag=True, help="Delete every sandbox, not just stale ones."
    )
    @click.pass_context
    def gc(ctx: click.Context, everything: bool) -> None:
        """Reap now: sandboxes past their hard lifetime, and ones that are not running."""
        from sandman.providers.local import LocalProvider

        async def go() -> None:
            provider = LocalProvider(local_config(ctx))
            now = time.time()
            reaped = 0
            for info in await provider.list():
                expires = float(info.labels.get("sandman.io/expires-at", "inf") or "inf")
                stale = info.state != "running" and now - info.created_at > 60
                if everything or expires < now or stale:
                    await provider.delete(info.id)
                    reaped += 1
            click.echo(f"reaped {reaped} sandbox(es)")

        _run(go(), ctx.obj["debug"])

    @cli.group()
    def images() -> None:
        """The local image store."""

    @images.command("import")
    @click.argument("archive", type=click.Path(exists=True, path_type=Path))
    @click.option("--name", help="Name it (e.g. task:1); docker archives carry their own.")
    @click.pass_context
    def images_import(ctx: click.Context, archive: Path, name: str | None) -> None:
        """Import a docker-save or OCI archive, an OCI layout dir, or a rootfs tarball."""
        from sandman.images import ImageStore

        layout = archive.is_dir()

        async def go() -> None:
            store = ImageStore(local_config(ctx).state_dir / "images")
            image = await (
                store.import_oci_layout(archive, name=name)
                if layout
                else store.import_archive(archive, name=name)
            )
            click.echo(f"{image.short_id}  {', '.join(image.names) or '<none>'}")

        _run(go(), ctx.obj["debug"])

    @images.command("pull")
    @click.argument("reference")
    @click.option("--insecure", is_flag=True, help="Plain HTTP / unverified TLS registry.")
    @click.pass_context
    def images_pull(ctx: click.Context, reference: str, insecure: bool) -> None:
        """Pull an image from a registry (skopeo)."""
        from sandman.images import ImageStore

        async def go() -> None:
            store = ImageStore(local_config(ctx).state_dir / "images")
            image = await store.pull(reference, tls_verify=not insecure)
            click.echo(f"{image.short_id}  {', '.join(image.names)}")

        _run(go(), ctx.obj["debug"])

    @images.command("ls")
    @click.pass_context
    def images_ls(ctx: click.Context) -> None:
        """List imported images."""
        from sandman.images import ImageStore

        async def go() -> None:
            for image in await ImageStore(local_config(ctx).state_dir / "images").list():
                names = ", ".join(image.names) or "<none>"
                click.echo(f"{image.short_id}  {image.size / 2**20:8.1f} MiB  {names}")

        _run(go(), ctx.obj["debug"])

    @images.command("rm")
    @click.argument("reference")
    @click.pass_context
    def images_rm(ctx: click.Context, reference: str) -> None:
        """Remove an image name (the image goes with its last name)."""
        from sandman.images import ImageStore

        async def go() -> None:
            await ImageStore(local_config(ctx).state_dir / "images").remove(reference)
            click.echo(f"removed {reference}")

        _run(go(), ctx.obj["debug"])

    return cli


def main() -> None:
    """Entry point of the ``sandman`` command."""
    if click is None:
        sys.stderr.write("the sandman command needs its extra: pip install 'sandman-rl[cli]'\n")
        sys.exit(2)
    _build()()
