"""``sandman shell IMAGE``: an interactive shell in a fresh sandbox, released on exit.

The shell runs on a pseudo-terminal in the sandbox (a ``tty=True`` background
process). This end puts the local terminal in raw mode, sends keystrokes to
the process's stdin, long-polls its output onto stdout and forwards window
size changes (SIGWINCH) as resizes. It ends when the shell exits (with its
exit code), when the connection drops, or on SIGHUP/SIGTERM; the terminal is
restored and the sandbox released on every one of those paths.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import sys
import termios
import tty
from collections import deque
from collections.abc import Iterator
from typing import Any

import click

from sandman import errors
from sandman.cli._common import (
    client_options,
    limit_options,
    open_client,
    run_async,
    spec_of,
    via_proxy_option,
)
from sandman.client import AsyncSandbox

# Looked for in this order when --shell is not given.
_SHELLS = ("/bin/bash", "/usr/bin/bash", "/bin/sh")
# Seconds one output long-poll may park in the daemon (its maximum is 60).
_POLL = 30.0


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    """The terminal on ``fd`` in raw mode (keys pass through, Ctrl-C included), then as before."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def _pick_shell(sb: AsyncSandbox, wanted: str | None) -> str:
    """``wanted``, else bash if the image has it, else /bin/sh."""
    for path in (wanted,) if wanted else _SHELLS:
        with contextlib.suppress(errors.PathNotFound):
            await sb.stat(path)
            return path
    raise errors.ConfigError(
        f"the image has no {wanted or '/bin/sh'}; name an installed shell with --shell PATH"
    )


async def _show_output(sb: AsyncSandbox, process_id: str, fd_out: int) -> int:
    """Copy the terminal's output to ``fd_out`` until the shell exits; its exit code."""
    offset = 0
    while True:
        out = await sb.read_output(process_id, stdout_offset=offset, wait=_POLL, encoding="base64")
        data = base64.b64decode(out.stdout)
        if data:
            _write_all(fd_out, data)
        offset = out.stdout_next_offset
        if not out.running:
            # The daemon reports the exit only once the output has drained.
            return out.exit_code if out.exit_code is not None else 1


async def _send_input(
    sb: AsyncSandbox, process_id: str, fd: int, pending: deque[bytes | None], ready: asyncio.Event
) -> None:
    """Send keystrokes (bytes) and window-size changes (None) in the order they happened,
    so that what is typed after a resize sees the new size; b"" ends it (terminal gone).
    Keystrokes that arrived meanwhile go in one request."""
    while True:
        await ready.wait()
        ready.clear()
        while pending:
            item = pending.popleft()
            if item is None:
                size = os.get_terminal_size(fd)
                await sb.resize(process_id, rows=size.lines, cols=size.columns)
                continue
            if not item:
                return
            while pending and pending[0]:  # stops at a resize or the end
                item += pending.popleft() or b""
            await sb.write_stdin(process_id, item)


async def _interact(sb: AsyncSandbox, process_id: str, fd_in: int, fd_out: int) -> int:
    """Pump keys, output and window sizes until the shell exits; its exit code.

    A lost local terminal (EOF) or SIGHUP/SIGTERM ends the session as a
    hangup would (129 / 143); a lost connection raises.
    """
    loop = asyncio.get_running_loop()
    pending: deque[bytes | None] = deque()
    ready = asyncio.Event()
    hangup: asyncio.Future[int] = loop.create_future()

    def put(item: bytes | None) -> None:
        pending.append(item)
        ready.set()

    def on_key() -> None:
        try:
            data = os.read(fd_in, 4096)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd_in)
        put(data)

    def on_signal(signum: int) -> None:
        if not hangup.done():
            hangup.set_result(128 + signum)

    loop.add_reader(fd_in, on_key)
    loop.add_signal_handler(signal.SIGWINCH, put, None)
    for signum in (signal.SIGHUP, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    put(None)  # the window may have changed since the shell started
    output = asyncio.ensure_future(_show_output(sb, process_id, fd_out))
    helpers: list[asyncio.Future[None]] = [
        asyncio.ensure_future(_send_input(sb, process_id, fd_in, pending, ready)),
    ]
    watched: set[asyncio.Future[Any]] = {output, hangup, *helpers}
    try:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if output in done:
            return output.result()
        if hangup in done:
            return hangup.result()
        for task in done:
            task.result()  # a helper failed (connection lost): raise it
        return 128 + signal.SIGHUP  # the key reader saw EOF
    finally:
        loop.remove_reader(fd_in)
        loop.remove_signal_handler(signal.SIGWINCH)
        for signum in (signal.SIGHUP, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        for future in watched:
            future.cancel()
        await asyncio.gather(*watched, return_exceptions=True)


@click.command()
@click.argument("image")
@limit_options
@click.option(
    "--shell", "shell_path", help="Shell to run (default: bash if present, else /bin/sh)."
)
@client_options
@via_proxy_option
@click.pass_context
def shell(
    ctx: click.Context,
    image: str,
    cpu: float,
    memory: int,
    network: str,
    shell_path: str | None,
    url: str | None,
    api_key: str | None,
    via_proxy: bool,
) -> None:
    """An interactive shell in a fresh sandbox; exiting the shell releases it."""
    spec = spec_of(image, cpu=cpu, memory=memory, network=network)
    if via_proxy and not url:
        raise click.UsageError("--via-proxy needs --url (or SANDMAN_URL): it is a service's route")
    if not sys.stdin.isatty():
        click.echo("error: sandman shell needs a terminal: stdin is not a tty", err=True)
        click.echo("hint: for a command without one, use: sandman run IMAGE -- CMD", err=True)
        sys.exit(1)
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()

    async def go() -> int:
        client = open_client(ctx, url, api_key, via_proxy=via_proxy)
        async with client, client.sandbox(spec, timeout=600) as sb:
            path = await _pick_shell(sb, shell_path)
            size = os.get_terminal_size(fd_in)
            env = {"TERM": os.environ.get("TERM", "xterm")}
            proc = await sb.spawn([path], env=env, tty=True, rows=size.lines, cols=size.columns)
            click.echo(
                f"sandman: {path} in sandbox {sb.id}; exit the shell to release it", err=True
            )
            with _raw(fd_in):
                try:
                    return await _interact(sb, proc.id, fd_in, fd_out)
                except BaseException:
                    _write_all(fd_out, b"\r\n")  # the error on a line of its own
                    raise

    sys.exit(run_async(ctx, go()))


COMMANDS: list[click.Command] = [shell]
