"""``sandman shell`` driven like a person would: in tmux, with keys and the screen; on the
embedded local pool and against a ``sandman serve`` process (``--url``)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import anyio
import httpx
import pytest
from click.testing import CliRunner

from sandman.cli import build
from sandman.client import AsyncSandbox
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import KEY_A
from tests.server.test_serve import Host, free_port, served
from tests.support import until

CGROUP_ROOT = Path("/sys/fs/cgroup")
# busybox sh's prompt; capture-pane drops the trailing space.
PROMPT = re.compile(r"^/ #$", re.MULTILINE)


class Tmux:
    """One tmux server of our own (its own socket), so nothing else is touched."""

    def __init__(self) -> None:
        self.socket = f"sandman-test-{uuid.uuid4().hex[:12]}"

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=30,
        )

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "shell").stdout

    def shows(self, line: str) -> bool:
        """Whether one line of the screen is exactly ``line``."""
        return re.search(rf"^{re.escape(line)}$", self.screen(), re.MULTILINE) is not None

    def alive(self) -> bool:
        return self("has-session", "-t", "shell", check=False).returncode == 0

    def kill(self) -> None:
        """Stop the server and remove its socket (kill-server leaves it behind)."""
        self("kill-server", check=False)
        tmpdir = Path(os.environ.get("TMUX_TMPDIR", "/tmp"))
        (tmpdir / f"tmux-{os.getuid()}" / self.socket).unlink(missing_ok=True)


def _leftovers(state: Path, sandbox_id: str) -> list[str]:
    """What of the sandbox (or the CLI that ran it) still exists."""
    found = [f"dir {p}" for p in (state / "sandboxes").glob("*")]
    found += [f"runtime state {p}" for p in (state / "runtime").glob("*/*")]
    found += [
        f"cgroup {h / 'sandman' / sandbox_id}"
        for h in CGROUP_ROOT.iterdir()
        if (h / "sandman" / sandbox_id).exists()
    ]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or proc.name == str(os.getpid()):
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cgroups = (proc / "cgroup").read_text()
            mounts = (proc / "mountinfo").read_text()
        except OSError:
            continue
        # The state dir's disk filesystem (<state>/disk) is mounted on the host
        # while its provider lives; a sandbox's own mounts name its directories.
        mine = (f"{state}/sandboxes", f"{state}/disk/{sandbox_id}")
        if (
            str(state).encode() in cmdline
            or sandbox_id in cgroups
            or any(path in mounts for path in mine)
        ):
            found.append(f"process {proc.name}: {cmdline[:120]!r}")
    return found


def _runs(sandbox_id: str, cmdline: bytes) -> bool:
    """Whether a process with this command line runs in the sandbox."""
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "cmdline").read_bytes() == cmdline and sandbox_id in (
                proc / "cgroup"
            ).read_text():
                return True
        except OSError:
            continue
    return False


@pytest.fixture
def state() -> Iterator[Path]:
    # Short on purpose: the daemon's socket path must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="sm-", dir="/tmp"))
    try:
        yield path
    finally:

        async def delete_all() -> None:
            provider = LocalProvider(LocalConfig(state_dir=path))
            try:
                for info in await provider.list():
                    await provider.delete(info.id)
            finally:
                await provider.aclose()

        anyio.run(delete_all)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    server = Tmux()
    try:
        yield server
    finally:
        server.kill()


def _start_shell(tmux: Tmux, state: Path, busybox_tar: Path, *options: str) -> tuple[Path, str]:
    """``sandman shell bb OPTIONS`` in a 100x30 tmux pane, at its prompt; its rc file and
    sandbox."""
    imported = CliRunner().invoke(
        build(), ["--state-dir", str(state), "images", "import", str(busybox_tar), "--name", "bb"]
    )
    assert imported.exit_code == 0, imported.output
    rc_file = state / "rc"
    sandman = [sys.executable, "-c", "from sandman.cli import main; main()"]
    command = f"{shlex.join([*sandman, '--state-dir', str(state), 'shell', 'bb', *options])}; "
    command += f"echo $? > {shlex.quote(str(rc_file))}"
    tmux("new-session", "-d", "-s", "shell", "-x", "100", "-y", "30", command)
    until("the prompt", lambda: PROMPT.search(tmux.screen()) is not None, 90, tmux.screen)
    banner = re.search(r"in sandbox (sb-[0-9a-f]+)", tmux.screen())
    assert banner, tmux.screen()
    return rc_file, banner.group(1)


def _listed(state: Path) -> str:
    listed = CliRunner().invoke(build(), ["--state-dir", str(state), "ls"])
    assert listed.exit_code == 0, listed.output
    return listed.output


def _assert_released(state: Path, sandbox_id: str) -> None:
    empty = "no sandboxes (`sandman create IMAGE` makes one)\n"
    until("`sandman ls` to be empty", lambda: _listed(state) == empty, 30, lambda: _listed(state))
    until(
        "nothing of the sandbox left",
        lambda: not _leftovers(state, sandbox_id),
        30,
        lambda: "\n".join(_leftovers(state, sandbox_id)),
    )


def _assert_ended(tmux: Tmux, rc_file: Path, rc: str, state: Path, sandbox_id: str) -> None:
    """The pane's ``sandman shell`` exits with status ``rc`` and leaves nothing behind."""
    until("the session to end", lambda: not tmux.alive(), 60, tmux.screen)
    assert rc_file.read_text().strip() == rc
    _assert_released(state, sandbox_id)


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
# Creating the sandbox can be slow on a busy machine.
slow = pytest.mark.timeout(180)


@needs_root_and_crun
@needs_tmux
@slow
def test_shell_in_tmux(busybox_tar: Path, state: Path, tmux: Tmux) -> None:
    rc_file, sandbox_id = _start_shell(tmux, state, busybox_tar)
    tmux("send-keys", "-t", "shell", "echo $((6*7))", "Enter")
    until("42", lambda: tmux.shows("42"), 20, tmux.screen)
    tmux("send-keys", "-t", "shell", "stty size", "Enter")
    until("the pane's size", lambda: tmux.shows("30 100"), 20, tmux.screen)
    # A resized window reaches the sandbox's terminal (SIGWINCH -> resize).
    tmux("resize-window", "-t", "shell", "-x", "120", "-y", "40")

    def resized() -> bool:
        # SIGWINCH and the keys reach sandman by different routes: ask until it has landed.
        tmux("send-keys", "-t", "shell", "clear; stty size", "Enter")
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline and not tmux.shows("40 120"):
            time.sleep(0.05)
        return tmux.shows("40 120")

    until("the new size", resized, 20, tmux.screen)
    # Ctrl-C goes to the sandbox, not to the CLI.
    tmux("send-keys", "-t", "shell", "sleep 1000", "Enter")
    until("sleep to run", lambda: _runs(sandbox_id, b"sleep\x001000\x00"), 20, tmux.screen)
    tmux("send-keys", "-t", "shell", "C-c")
    tmux("send-keys", "-t", "shell", "echo after-$((1+1))", "Enter")
    until("the shell after ^C", lambda: tmux.shows("after-2"), 20, tmux.screen)

    tmux("send-keys", "-t", "shell", "exit 7", "Enter")
    _assert_ended(tmux, rc_file, "7", state, sandbox_id)


@needs_root_and_crun
@needs_tmux
@slow
def test_shell_ends_when_its_sandbox_goes_away(busybox_tar: Path, state: Path, tmux: Tmux) -> None:
    rc_file, sandbox_id = _start_shell(tmux, state, busybox_tar)
    removed = CliRunner().invoke(build(), ["--state-dir", str(state), "rm", sandbox_id])
    assert removed.exit_code == 0, removed.output
    _assert_ended(tmux, rc_file, "1", state, sandbox_id)


@needs_root_and_crun
@needs_tmux
@slow
def test_shell_hung_up_releases_its_sandbox(busybox_tar: Path, state: Path, tmux: Tmux) -> None:
    _, sandbox_id = _start_shell(tmux, state, busybox_tar)
    tmux("kill-session", "-t", "shell")  # the terminal goes away: SIGHUP
    _assert_released(state, sandbox_id)


@needs_root_and_crun
@needs_tmux
@slow
def test_shell_against_a_service_via_its_proxy(busybox_tar: Path, state: Path, tmux: Tmux) -> None:
    config = LocalConfig(state_dir=state)  # the default cgroup parent, as `_leftovers` expects
    host = Host(config, LocalProvider(config))
    pool = f"shell-test-{uuid.uuid4().hex[:8]}"
    with served(host, free_port(), pool, "--log-level", "info") as server:  # requests logged
        anyio.run(server.wait_healthy)
        auth = {"Authorization": f"Bearer {KEY_A}"}

        def sandboxes() -> list[tuple[str, str]]:
            listed = httpx.get(f"{server.url}/v1/sandboxes", headers=auth, timeout=10)
            return [(s["id"], s["state"]) for s in listed.json()["sandboxes"]]

        # The service's pool and the image import share one state dir: bb is the service's.
        options = ("--url", server.url, "--api-key", KEY_A, "--via-proxy")
        rc_file, sandbox_id = _start_shell(tmux, state, busybox_tar, *options)
        assert sandboxes() == [(sandbox_id, "leased")]
        tmux("send-keys", "-t", "shell", "echo $((6*7))", "Enter")
        until("42", lambda: tmux.shows("42"), 20, tmux.screen)
        tmux("send-keys", "-t", "shell", "exit 5", "Enter")
        until("the session to end", lambda: not tmux.alive(), 60, tmux.screen)
        assert rc_file.read_text().strip() == "5"
        # Released on the service (which keeps it listed as gone), and nothing of it left.
        until("the service to let it go", lambda: sandboxes() == [(sandbox_id, "gone")], 30,
               lambda: repr(sandboxes()))  # fmt: skip
        _assert_released(state, sandbox_id)
        # The keys and the screen went through the service's proxy route, not to the daemon.
        assert f"/v1/sandboxes/{sandbox_id}/daemon/v1/processes" in server.output()
        assert anyio.run(server.terminate) == 0, server.output()


def test_shell_via_proxy_needs_a_url() -> None:
    result = CliRunner().invoke(build(), ["shell", "bb", "--via-proxy"], input="")
    assert result.exit_code == 2
    assert "--via-proxy needs --url" in result.output


def test_shell_without_a_terminal_says_so() -> None:
    result = CliRunner().invoke(build(), ["shell", "bb"], input="")
    assert result.exit_code == 1
    assert "error: sandman shell needs a terminal" in result.output
    assert "hint:" in result.output


def test_keys_and_resizes_are_sent_in_the_order_they_happened() -> None:
    from sandman.cli.shell import _send_input

    calls: list[tuple[object, ...]] = []

    class Recorder:
        """Stands in for the sandbox's two calls, to see their order."""

        async def write_stdin(self, process_id: str, data: bytes) -> None:
            calls.append(("keys", data))

        async def resize(self, process_id: str, *, rows: int, cols: int) -> None:
            calls.append(("resize", rows, cols))

    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        pending: deque[bytes | None] = deque([b"a", b"b", None, b"c", None, b"d", b""])

        async def go() -> None:
            ready = asyncio.Event()
            ready.set()
            sandbox = cast(AsyncSandbox, Recorder())
            await asyncio.wait_for(_send_input(sandbox, "p", slave, pending, ready), 5)

        asyncio.run(go())
    finally:
        os.close(master)
        os.close(slave)
    assert calls == [
        ("keys", b"ab"), ("resize", 30, 100), ("keys", b"c"), ("resize", 30, 100), ("keys", b"d"),
    ]  # fmt: skip
