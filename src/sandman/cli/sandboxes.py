"""Sandbox commands: ``run``, ``create``, ``exec``, ``cp``, ``ls``, ``rm``, ``gc``.

(One command group: each command is short; the options, the local-or-service choice
and the error printing they share with the other groups are `sandman.cli._common`'s.)

``create`` makes a sandbox of the local provider that outlives the command
(until ``rm``, or ``gc`` past its ``--ttl``).
``exec``, ``cp``, ``ls`` and ``rm`` act on the local provider's sandboxes, or,
with ``--url`` (``SANDMAN_URL``), on the tenant's sandboxes at a service; ``gc``
on the local provider's, or with ``--kubernetes`` on a namespace's pods.
"""

from __future__ import annotations

import asyncio
import io
import secrets
import signal
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import anyio
import click

from sandman import errors
from sandman.cli._common import (
    Duration,
    Size,
    age,
    client_options,
    daemon_client,
    echo_table,
    kubernetes_options,
    kubernetes_provider,
    limit_options,
    local_config,
    open_client,
    remote_backend,
    run_async,
    service_or_local,
    spec_of,
    via_proxy_option,
)
from sandman.daemon import DaemonClient
from sandman.models import SandboxSpec
from sandman.pool import owner as owners
from sandman.pool.records import LABEL_EXPIRES
from sandman.pool.snapshots import expires_at
from sandman.providers.base import (
    BackendOwners,
    KeepsOwners,
    Provider,
    SandboxInfo,
    SnapshotInfo,
    Snapshots,
)
from sandman.providers.local import LocalProvider

if TYPE_CHECKING:
    from sandman.client.remote import RemoteBackend


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("image")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@limit_options
@click.option("--timeout", type=float, default=None, help="Seconds the command may run.")
@client_options
@click.pass_context
def run(
    ctx: click.Context,
    image: str,
    command: tuple[str, ...],
    cpu: float,
    memory: int,
    network: str,
    timeout: float | None,
    url: str | None,
    api_key: str | None,
) -> None:
    """Run one command in a fresh sandbox, print its output, release it: run IMAGE -- CMD..."""
    spec = spec_of(image, cpu=cpu, memory=memory, network=network)

    async def go() -> int:
        client = open_client(ctx, url, api_key)
        async with client, client.sandbox(spec, timeout=600) as sb:
            result = await sb.exec(list(command), timeout=timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.timed_out:
            _timed_out(timeout)
            return 124  # as timeout(1) does, and exec
        return result.exit_code

    sys.exit(run_async(ctx, go()))


def _timed_out(timeout: float | None) -> None:
    click.echo(f"timed out after {timeout or 0:g} s; killed", err=True)


@click.command()
@click.argument("image")
@limit_options
@click.option("--pids", type=int, default=None, help="Most tasks at once (default 1024).")
@click.option(
    "--disk", type=Size(), default=None, help="What it may write, e.g. 5Gi (default: the host's)."
)
@click.option(
    "--ttl",
    type=Duration(),
    default="1h",
    show_default=True,
    help="Its lifetime (30m, 2h, 1d): past it, `sandman gc` deletes it.",
)
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait until ready."
)
@click.option("--url", envvar="SANDMAN_URL", hidden=True)
@click.pass_context
def create(
    ctx: click.Context,
    image: str,
    cpu: float,
    memory: int,
    network: str,
    pids: int | None,
    disk: int | None,
    ttl: float,
    timeout: float,
    url: str | None,
) -> None:
    """Make a sandbox that outlives this command and print its id: create IMAGE.

    Use it with `sandman exec ID -- CMD`, `cp`, and `rm ID` when done; past its
    --ttl, `sandman gc` deletes it. A sandbox of this machine's local provider:
    a service's sandboxes live as long as the client session that holds them.
    """
    if url:
        raise click.UsageError(
            "create makes a sandbox on this machine; a service's sandboxes live only as long "
            "as the session of the client holding them: use the SDK (sandman.connect), "
            "`sandman run --url` or `sandman shell --url` (unset SANDMAN_URL for a local one)"
        )
    spec = spec_of(image, cpu=cpu, memory=memory, network=network, pids=pids, disk=disk)

    async def go() -> str:
        provider = LocalProvider(local_config(ctx))
        try:
            return await create_ready(provider, spec, ttl, timeout)
        finally:
            await provider.aclose()

    sandbox_id = run_async(ctx, go())
    click.echo(sandbox_id)
    click.echo(f"sandbox {sandbox_id} is ready for {age(ttl)}; `sandman rm {sandbox_id}` "
               "deletes it", err=True)  # fmt: skip


async def create_ready(
    provider: LocalProvider, spec: SandboxSpec, ttl: float, timeout: float
) -> str:
    """A ready sandbox of ``spec`` expiring in ``ttl`` seconds; nothing left on failure."""
    sandbox_id = f"sb-{secrets.token_hex(6)}"
    labels = {LABEL_EXPIRES: f"{time.time() + ttl:.0f}"}
    try:
        async with asyncio.timeout(timeout):
            info = await provider.create(spec, sandbox_id=sandbox_id, labels=labels)
            if info.endpoint is not None:
                async with info.endpoint.client() as daemon:
                    await daemon.wait_ready(timeout)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await provider.delete(sandbox_id)
        if isinstance(exc, TimeoutError) and not isinstance(exc, errors.SandboxError):
            raise errors.CreateTimeout(f"sandbox {sandbox_id} not ready in {timeout:g} s") from None
        raise
    return sandbox_id


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", metavar="ID")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--cwd", help="Working directory in the sandbox.")
@click.option("-e", "--env", multiple=True, metavar="KEY=VALUE", help="An environment variable.")
@click.option("--timeout", type=float, default=None, help="Seconds the command may run.")
@click.option(
    "-u",
    "--user",
    metavar="USER[:GROUP]",
    help="Run as this user: a name or uid (optionally :group), from the sandbox's /etc/passwd.",
)
@click.option(
    "--merge-stderr",
    is_flag=True,
    help="One stream for both outputs, interleaved as written, on stdout.",
)
@client_options
@via_proxy_option
@click.pass_context
def exec_command(
    ctx: click.Context,
    sandbox_id: str,
    command: tuple[str, ...],
    cwd: str | None,
    env: tuple[str, ...],
    timeout: float | None,
    user: str | None,
    merge_stderr: bool,
    url: str | None,
    api_key: str | None,
    via_proxy: bool,
) -> None:
    """Run a command in a running sandbox, its output as it comes: exec ID -- CMD..."""
    variables = dict(_key_value(item) for item in env)

    async def go() -> int:
        daemon = await daemon_client(ctx, sandbox_id, url, api_key, via_proxy=via_proxy)
        async with (
            daemon,
            daemon.exec_stream(
                list(command),
                cwd=cwd,
                env=variables,
                timeout=timeout,
                user=user,
                merge_stderr=merge_stderr,
            ) as events,
        ):
            async for event in events:
                if event.event == "exit":
                    if event.timed_out:
                        _timed_out(timeout)
                        return 124  # as timeout(1) does
                    if event.exit_code is not None:
                        return event.exit_code
                    return 128 + _signal_number(event.signal)
                click.echo(event.data, nl=False, err=event.event == "stderr")
        raise errors.DaemonUnavailable("the command's output ended without its exit")

    sys.exit(run_async(ctx, go()))


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
    return key, value


def _signal_number(name: str | None) -> int:
    """The number of a signal the daemon names (``KILL`` or ``SIGKILL``); 1 if unknown."""
    name = name or ""
    try:
        return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
        return 1


def _sandbox_path(arg: str) -> tuple[str, str] | None:
    """``ID:/path`` as (id, path); None for a local path."""
    sandbox_id, sep, path = arg.partition(":")
    if sep and sandbox_id and "/" not in sandbox_id and path.startswith("/"):
        return sandbox_id, path
    return None


@click.command("cp")
@click.argument("source")
@click.argument("destination")
@client_options
@via_proxy_option
@click.pass_context
def copy(
    ctx: click.Context,
    source: str,
    destination: str,
    url: str | None,
    api_key: str | None,
    via_proxy: bool,
) -> None:
    """Copy a file or directory into or out of a running sandbox.

    One side is ID:/absolute/path: cp ./src ID:/work, or cp ID:/work/out.txt ./
    A directory's contents land in the destination directory.
    """
    src, dst = _sandbox_path(source), _sandbox_path(destination)
    if (src is None) == (dst is None):
        fail_message = "both" if src else "neither"
        raise click.UsageError(f"{fail_message} side is a sandbox path: one must be ID:/path")
    sandbox_id = (src or dst or ("", ""))[0]

    async def go() -> str:
        daemon = await daemon_client(ctx, sandbox_id, url, api_key, via_proxy=via_proxy)
        async with daemon:
            if dst is not None:
                return await _upload(daemon, Path(source), dst[1])
            assert src is not None
            return await _download(daemon, src[1], Path(destination))

    click.echo(run_async(ctx, go()))


def _pack(local: Path) -> tuple[bool, bytes, int]:
    """(is a directory, its tar or the file's bytes, the file's mode)."""
    if local.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for child in sorted(local.iterdir()):
                tar.add(child, arcname=child.name)
        return True, buffer.getvalue(), 0
    if not local.is_file():
        raise errors.ConfigError(f"nothing to copy at {local}")
    return False, local.read_bytes(), local.stat().st_mode & 0o7777


async def _upload(daemon: DaemonClient, local: Path, remote: str) -> str:
    is_dir, data, mode = await asyncio.to_thread(_pack, local)
    if is_dir:
        result = await daemon.upload_archive(remote, data)
        files = f"{result.files} file" + ("s" if result.files != 1 else "")
        return f"copied {local}/ -> {remote}/ ({files}, {result.bytes} bytes)"
    target = remote
    if remote.endswith("/") or (
        await daemon.exists(remote) and (await daemon.stat(remote)).type == "directory"
    ):
        target = str(PurePosixPath(remote) / local.name)
    stat = await daemon.write_file(target, data, mode=mode)
    return f"copied {local} -> {target} ({stat.size} bytes)"


async def _download(daemon: DaemonClient, remote: str, local: Path) -> str:
    stat = await daemon.stat(remote)
    if stat.type == "directory":
        # Unpacked by sandman.daemon.untar, which trusts nothing the sandbox sends.
        result = await daemon.download_tree(remote, local)
        return f"copied {remote}/ -> {local}/ ({result.files} entries, {result.bytes} bytes)"
    # The name comes from the path asked for, never from the daemon's answer.
    name = PurePosixPath(remote).name
    if not name or name in (".", ".."):
        raise click.UsageError(f"{remote!r} does not name a file")
    target = local / name if await asyncio.to_thread(local.is_dir) else local
    await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
    try:
        mode = int(stat.mode, 8) & 0o777
    except ValueError:
        mode = 0o644
    size = await daemon.download_file(remote, target, mode=mode)
    return f"copied {remote} -> {target} ({size} bytes)"


@click.command("ls")
@client_options
@click.pass_context
def list_sandboxes(ctx: click.Context, url: str | None, api_key: str | None) -> None:
    """List this machine's sandboxes, or with --url the tenant's sandboxes at the service."""
    now = time.time()
    if url:

        async def listed() -> list[dict[str, object]]:
            backend = remote_backend(url, api_key)
            try:
                return await backend.sandboxes()
            finally:
                await backend.aclose()

        rows = []
        for item in run_async(ctx, listed()):
            timeline = item.get("timeline")
            since = min(timeline.values()) if isinstance(timeline, dict) and timeline else now
            rows.append((str(item["id"]), str(item["state"]), str(item["image"]),
                         age(now - since), str(item.get("session") or "-")))  # fmt: skip
        header = ("ID", "STATE", "IMAGE", "AGE", "SESSION")
        echo_table(header, rows, empty="no sandboxes (of this API key's tenant)")
        return
    infos = run_async(ctx, LocalProvider(local_config(ctx)).list())
    rows = [
        (info.id, info.state, info.image, age(now - info.created_at),
         info.labels.get("sandman.io/pool", "-"))
        for info in infos
    ]  # fmt: skip
    header = ("ID", "STATE", "IMAGE", "AGE", "POOL")
    echo_table(header, rows, empty="no sandboxes (`sandman create IMAGE` makes one)")


@click.command("rm")
@click.argument("ids", nargs=-1, required=True)
@client_options
@click.pass_context
def remove(ctx: click.Context, ids: tuple[str, ...], url: str | None, api_key: str | None) -> None:
    """Delete sandboxes by id (local provider), or with --url release the tenant's."""

    async def remote(backend: RemoteBackend) -> None:
        for sandbox_id in ids:
            # An unknown id is an error here; one released is listed a while.
            state = (await backend.describe(sandbox_id)).get("state")
            if state in _ENDED:
                click.echo(f"{sandbox_id} was already gone ({state})")
                continue
            await backend.release(sandbox_id)
            click.echo(f"released {sandbox_id}")

    async def local(provider: LocalProvider) -> None:
        for sandbox_id in ids:
            try:
                await provider.inspect(sandbox_id)
                there = True
            except errors.SandboxNotFound:
                there = False
            await provider.delete(sandbox_id)  # also what a half-made one left
            click.echo(f"deleted {sandbox_id}" if there else f"{sandbox_id} was already gone")

    service_or_local(ctx, url, api_key, remote, local)


_ENDED = ("releasing", "gone", "failed", "lost")
"""States of a service's sandbox that a release has nothing left to do for."""


@click.command()
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Delete every sandbox of this state directory (or namespace), those of live pools "
    "included (they lose them in the middle of their work).",
)
@click.option(
    "--grace",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds a sandbox that does not run, or a directory a crash left, is spared "
    "first: a create in flight is one for a moment.",
)
@click.option(
    "--kubernetes",
    "on_kubernetes",
    is_flag=True,
    help="Reap the pods of a namespace instead: owners are pool processes' Leases there.",
)
@kubernetes_options("With --kubernetes: the sandboxes' (default: the context's).")
@click.pass_context
def gc(
    ctx: click.Context,
    everything: bool,
    grace: float,
    on_kubernetes: bool,
    kubeconfig: Path | None,
    context: str | None,
    namespace: str | None,
) -> None:
    """Reap what no live pool holds: sandboxes whose owner process is dead (whatever
    their pool), past their hard lifetime, not running (for GRACE), and what creates
    or deletes killed half-way left. A sandbox whose owner is alive is never touched
    (but with --all). Prints each one reaped and why.

    On Kubernetes (--kubernetes) an owner is a pool process's Lease: dead once it has
    expired and is then seen unchanged for its duration plus the provider's
    ``owner_grace`` (so this may wait that long), or once it is missing. A dead
    owner's Lease goes with its last pod. Snapshots too: this machine's, or with
    --kubernetes those this host keeps of the namespace (in the default
    ``snapshot_dir``), once their owner is dead or their time to live is over."""

    async def go() -> tuple[list[tuple[str, str]], list[str]]:
        provider: Provider
        if on_kubernetes:
            provider = kubernetes_provider(kubeconfig, context, namespace)
        else:
            provider = LocalProvider(local_config(ctx))
        reaped: list[tuple[str, str]] = []
        failed: list[str] = []
        try:
            infos = await provider.list()
            # After the sandboxes: an owner's record is made before its first sandbox.
            backend = await _judge_owners(provider, infos) if not everything else None
            liveness = owners.Liveness(backend)
            now = time.time()
            for info in infos:
                reason = "--all" if everything else reap_reason(info, now, grace, liveness)
                if reason is None:
                    continue
                try:
                    await provider.delete(info.id)
                except errors.SandboxError as exc:
                    failed.append(f"could not reap {info.id} ({reason}): {exc}")
                    continue
                reaped.append((info.id, reason))
            if isinstance(provider, LocalProvider):
                strays = await provider.remove_strays(older_than=grace)
                reaped += [(n, "a create killed before its record was whole") for n in strays]
            if isinstance(provider, Snapshots):
                # Local: this machine's; Kubernetes: those this host keeps of the namespace.
                for snapshot in await provider.snapshots():
                    reason = (
                        "--all" if everything else snapshot_reap_reason(snapshot, now, liveness)
                    )
                    if reason is not None:
                        await provider.delete_snapshot(snapshot.id)
                        reaped.append((snapshot.id, reason))
                store = getattr(provider, "snapshot_store", None)
                if store is not None:
                    strays = await anyio.to_thread.run_sync(store.remove_strays)
                    reaped += [(n, "a snapshot killed half-way") for n in strays]
            if backend is not None and isinstance(provider, KeepsOwners):
                for dead in backend.dead:
                    await provider.forget_owner(dead, backend.versions.get(dead))
        finally:
            await provider.aclose()  # unmounts the disk filesystem if no sandbox is left
        return reaped, failed

    reaped, failed = run_async(ctx, go())
    for name, reason in reaped:
        click.echo(f"reaped {name}: {reason}")
    for line in failed:
        click.echo(line, err=True)
    counts = Counter(reason.split(" (")[0] for _, reason in reaped)
    summary = ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))
    click.echo(f"reaped {len(reaped)} sandbox(es)" + (f" ({summary})" if summary else ""))
    if failed:
        sys.exit(1)


async def _judge_owners(provider: Provider, infos: list[SandboxInfo]) -> BackendOwners | None:
    """The provider's owner records, judged; if one that some sandbox names looks expired,
    it is watched until it is judged (its duration plus the grace, at most)."""
    if not isinstance(provider, KeepsOwners):
        return None
    named = {info.labels.get(owners.LABEL_OWNER, "") for info in infos}
    backend = await provider.owners()
    deadline = time.monotonic() + _JUDGE_LIMIT
    # A Lease seen once cannot be judged dead: it must be seen unchanged for a while.
    while backend.undecided_for > 0 and time.monotonic() < deadline:
        if not any(backend(o) == "unknown" for o in named if o in backend.statuses):
            break
        await asyncio.sleep(min(1.0, backend.undecided_for + 0.05))
        backend = await provider.owners()
    return backend


_JUDGE_LIMIT = 600.0
"""Seconds `gc` watches Leases at most (a Lease of hours would keep it that long)."""


def reap_reason(
    info: SandboxInfo, now: float, grace: float, liveness: Callable[[str], owners.OwnerStatus]
) -> str | None:
    """Why `gc` reaps a sandbox, or None to leave it."""
    owner = info.labels.get(owners.LABEL_OWNER)
    status = liveness(owner) if owner is not None else None
    if status == "alive":
        return None
    try:
        expires = float(info.labels.get(LABEL_EXPIRES) or "inf")
    except ValueError:
        expires = float("inf")
    if expires < now:
        return "past its lifetime"
    if owner is not None and status == "dead":
        return f"owner dead ({owners.describe(owner)})"
    if info.state != "running" and now - info.created_at > grace:
        if not info.labels and info.state == "unknown":
            return "no record"
        return f"not running ({info.state})"
    return None


def snapshot_reap_reason(
    info: SnapshotInfo, now: float, liveness: Callable[[str], owners.OwnerStatus]
) -> str | None:
    """Why `gc` reaps a snapshot, or None to leave it (its pool's process lives)."""
    owner = info.labels.get(owners.LABEL_OWNER)
    status = liveness(owner) if owner is not None else None
    if status == "alive":
        return None
    if not info.labels:
        return "no record"
    if expires_at(info) < now:
        return "past its time to live"
    if status == "dead" and owner is not None:
        return f"owner dead ({owners.describe(owner)})"
    return None


COMMANDS: list[click.Command] = [run, create, exec_command, copy, list_sandboxes, remove, gc]
