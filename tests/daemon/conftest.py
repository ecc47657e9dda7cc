from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandman.daemon import DaemonClient
from tests.daemon.running import RunningDaemon, start_daemon

TOKEN = "s3cret-token"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    """A real sandmand on the host, listening on a unix socket and on TCP loopback."""
    running = start_daemon(tmp_path, token=TOKEN)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(params=["unix", "tcp"])
async def client(
    request: pytest.FixtureRequest, daemon: RunningDaemon
) -> AsyncIterator[DaemonClient]:
    async with daemon.client(transport=request.param) as client:
        yield client


def _daemon_processes() -> set[int]:
    """Live (non-zombie) sandmand processes this test process started (its children).

    Only our own children: sandboxes of other tests, other sessions or the
    local provider run sandmand too, and come and go on their own."""
    found = set()
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if b"sandmand" in cmdline.split(b"\0", 1)[0] and state != "Z" and ppid == me:
            found.add(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def no_daemon_left_behind() -> Iterator[None]:
    """Every test stops every daemon it started, even when it fails."""
    before = _daemon_processes()
    yield
    deadline = time.monotonic() + 10
    while (left := _daemon_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, f"sandmand processes left behind: {sorted(left)}"
