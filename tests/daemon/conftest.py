from __future__ import annotations

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
    """Live (non-zombie) sandmand processes on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"sandmand" in cmdline.split(b"\0", 1)[0] and state != "Z":
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
