"""The workload plays the attacker against the host, from inside a real sandbox.

Root in the sandbox, it may rewrite anything it can write: nothing it does
may redirect the host's connections to the daemon, impersonate the daemon,
or read the daemon's memory, environment or descriptors.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.base import DaemonEndpoint
from sandman.providers.local import LocalProvider
from sandman.providers.local.oci import MASKED_DIRS
from tests.providers.local.conftest import needs_root_and_crun, ready

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

SPEC = SandboxSpec(image="busybox", memory="256Mi", pids=128, cpu=1)


async def test_no_path_in_the_sandbox_leads_to_the_hosts_socket(provider: LocalProvider) -> None:
    info = await provider.create(SPEC)
    assert info.endpoint is not None and info.endpoint.uds is not None
    host_socket = os.stat(info.endpoint.uds)
    async with await ready(info) as sb:
        # Every socket file the sandbox can see, by device and inode.
        found = await sb.exec(
            "find / -path /proc -prune -o -type s -exec stat -c '%d %i %n' {} + 2>/dev/null"
        )
        seen = {tuple(line.split()[:2]) for line in found.stdout.splitlines()}
        assert (str(host_socket.st_dev), str(host_socket.st_ino)) not in seen
        # The old route: the daemon's socket directory bound read-write. Gone;
        # and whatever the workload does to its own tree, the host still
        # reaches its daemon.
        wreck = await sb.exec("ls /run/sandman; rm -rf /run /.sandman/* /tmp; echo done")
        assert "done" in wreck.stdout
        assert (await sb.exec("echo still here")).stdout == "still here\n"


async def test_the_daemon_cannot_be_read_or_traced_by_the_workload(
    provider: LocalProvider,
) -> None:
    info = await provider.create(SPEC)
    assert info.endpoint is not None
    async with await ready(info) as sb:
        for path in ("/proc/1/environ", "/proc/1/mem", "/proc/1/fd/3", "/proc/1/maps"):
            result = await sb.exec(["head", "-c", "64", path])
            assert result.exit_code != 0, f"{path} is readable: {result.stdout!r}"
            assert "Permission denied" in result.stderr, result.stderr
        # Its descriptors (the listening socket among them) cannot be opened.
        fds = (await sb.exec(["ls", "/proc/1/fd"])).stdout.split()
        opened = await sb.exec(
            ["sh", "-c", " ".join(f"cat /proc/1/fd/{n} </dev/null;" for n in fds)]
        )
        # (Descriptors of this very exec may close in between: "No such file".)
        problems = opened.stderr.splitlines()
        assert opened.stdout == "" and len(problems) == len(fds), opened
        assert all("Permission denied" in p or "No such file" in p for p in problems), problems
        assert sum("Permission denied" in p for p in problems) >= 3, problems  # 0, 1, 2 at least
        # The token is nowhere in the sandbox's files.
        token = info.endpoint.token
        grep = await sb.exec(
            ["grep", "-rlF", token, "/", "--exclude-dir=proc", "--exclude-dir=sys"]
        )
        assert grep.stdout == ""
        # The workload's own processes stay inspectable (execve resets the flag).
        own = await sb.exec("sleep 30 & head -c 5 /proc/$!/environ >/dev/null && echo readable")
        assert own.stdout == "readable\n"


class _FakeDaemon:
    """A unix-socket server that records every byte it is sent (and answers 200)."""

    def __init__(self, path: Path) -> None:
        self.received = bytearray()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[tuple[Path, _FakeDaemon]]:
    path = tmp_path / "fake.sock"
    fake = _FakeDaemon(path)
    try:
        yield path, fake
    finally:
        fake.close()


async def test_an_impostor_at_the_socket_gets_nothing(
    provider: LocalProvider, fake_daemon: tuple[Path, _FakeDaemon]
) -> None:
    """Were anything else ever to answer at a sandbox's socket path, the host
    would refuse it before sending a byte (the bearer token least of all)."""
    info = await provider.create(SPEC)
    assert info.endpoint is not None and info.endpoint.uds is not None
    assert info.endpoint.pid is not None
    path, fake = fake_daemon
    os.replace(path, info.endpoint.uds)  # the impostor takes the daemon's place
    impostor = DaemonEndpoint(
        uds=info.endpoint.uds, token=info.endpoint.token, pid=info.endpoint.pid
    )
    async with impostor.client() as client:
        with pytest.raises(sandman.UntrustedDaemon, match="not the sandbox's daemon"):
            await client.health()
        with pytest.raises(sandman.UntrustedDaemon):
            await client.wait_ready(timeout=5)  # not retried as if the daemon were starting
    assert bytes(fake.received) == b""
    # Listing again reports the same pid: a restarted pool checks the same way.
    (again,) = [i for i in await provider.list() if i.id == info.id]
    assert again.endpoint is not None and again.endpoint.pid == info.endpoint.pid


async def test_the_peer_check_passes_for_the_real_daemon(provider: LocalProvider) -> None:
    info = await provider.create(SPEC)
    assert info.endpoint is not None and info.endpoint.pid is not None
    async with await ready(info) as sb:
        assert (await sb.exec("echo ok")).stdout == "ok\n"
    wrong = info.endpoint.model_copy(update={"pid": info.endpoint.pid + 1})
    async with wrong.client() as client:
        with pytest.raises(sandman.UntrustedDaemon):
            await client.health()


async def test_masked_directories_are_empty_read_only_and_cost_no_superblock(
    provider: LocalProvider,
) -> None:
    # Each superblock a sandbox makes adds a shrinker slot to every memory cgroup on
    # the host: the masked directories are binds of one empty host directory, not a
    # tmpfs each (see oci.MASKED_DIRS).
    present = [p for p in MASKED_DIRS if os.path.isdir(p)]
    if not present:
        pytest.skip("none of the masked directories exists on this host")
    info = await provider.create(SPEC)
    assert info.endpoint is not None and info.endpoint.pid is not None
    mounts = {
        fields[4]: fields[fields.index("-") + 1]
        for line in Path(f"/proc/{info.endpoint.pid}/mountinfo").read_text().splitlines()
        if (fields := line.split())
    }
    async with await ready(info) as sb:
        for path in present:
            assert mounts[path] != "tmpfs", (path, mounts[path])
            assert (await sb.exec(["ls", "-A", path])).stdout == ""
            wrote = await sb.exec(["touch", f"{path}/x"])
            assert wrote.exit_code != 0 and "Read-only file system" in wrote.stderr
        assert (await sb.exec(["cat", "/proc/kcore"])).stdout == ""  # files: /dev/null
    assert not any((provider.config.state_dir / "empty").iterdir())
