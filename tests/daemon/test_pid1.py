"""sandmand as PID 1 of a rootfs that holds nothing but a static busybox.

Uses ``unshare`` (util-linux) for new pid and mount namespaces and a chroot,
which is what a container runtime gives the daemon, minus the runtime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sandman.daemon import DaemonClient, daemon_path
from tests.daemon.rootfs import (
    TOKEN,
    Pid1,
    busybox_is_static,
    make_rootfs,
    needs_unshare,
    run_pid1,
)
from tests.daemon.running import wait_listening

pytestmark = needs_unshare


@pytest.fixture
def pid1(tmp_path: Path) -> Iterator[Pid1]:
    root = tmp_path / "rootfs"
    make_rootfs(root)
    with run_pid1(root, tmp_path / "sandmand.log") as running:
        yield running


def test_binary_is_static_and_small() -> None:
    out = subprocess.run(
        ["file", str(daemon_path())], capture_output=True, text=True, check=False
    ).stdout
    assert "statically linked" in out
    assert daemon_path().stat().st_size < 8 * 1024 * 1024


async def _zombies(client: DaemonClient) -> list[str]:
    ps = await client.exec(["ps", "-o", "pid,stat,comm"], check=True)
    return [line for line in ps.stdout.splitlines()[1:] if line.split()[1].startswith("Z")]


@pytest.mark.anyio
async def test_runs_as_pid1_and_reaps_orphans(pid1: Pid1) -> None:
    async with pid1.client() as client:
        assert (await client.health()).pid == 1
        assert (await client.exec("echo $$; ls /", check=True)).stdout.split()[0] != "1"
        await client.exec("for i in $(seq 1 40); do (sleep 0.05 &); done", check=True)
        with anyio.fail_after(10):
            while zombies := await _zombies(client):
                await anyio.sleep(0.02)
        assert zombies == []


@pytest.mark.anyio
async def test_sigterm_reaches_children_and_the_daemon_exits_cleanly(pid1: Pid1) -> None:
    async with pid1.client() as client:
        await client.spawn(
            "trap 'echo term > /tmp/got-term; exit 0' TERM; while true; do sleep 0.05; done"
        )
        sh = await client.create_shell()
        await client.run_in_shell(sh.id, "echo shell up", check=True)
    os.kill(pid1.daemon_host_pid(), signal.SIGTERM)
    assert pid1.process.wait(timeout=15) == 0
    assert (pid1.root / "tmp" / "got-term").read_text() == "term\n"
    assert not Path(pid1.sock).exists()


@pytest.mark.anyio
async def test_pids_limited_sandbox_does_not_fill_with_zombies(tmp_path: Path) -> None:
    cgroup_root = Path("/sys/fs/cgroup/pids")
    if not (cgroup_root / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 pids controller")
    if not busybox_is_static():
        pytest.skip("/bin/busybox is not static")
    cgroup = cgroup_root / f"sandman-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    root = tmp_path / "rootfs"
    make_rootfs(root)
    log = tmp_path / "sandmand.log"
    try:
        (cgroup / "pids.max").write_text("64")
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh",
                 "unshare", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", f"--root={root}",
                 "/.sandman/sandmand", "--listen", "unix:/run/sandmand.sock"],
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SANDMAND_TOKEN": TOKEN},
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        try:
            wait_listening(process, log, 1)
            async with DaemonClient(uds=str(root / "run" / "sandmand.sock"), token=TOKEN) as c:
                # 15 rounds of 30 orphans = 450 processes through a 64-task limit
                # (the daemon's own threads count too): only possible if every
                # orphan is reaped; a zombie keeps its pid.
                for _ in range(15):
                    result = await c.exec("for i in $(seq 1 30); do (true &); done; echo ok")
                    assert (result.stdout, result.stderr) == ("ok\n", "")
                    with anyio.fail_after(10):
                        while int((cgroup / "pids.current").read_text()) > 30:
                            await anyio.sleep(0.01)
        finally:
            process.kill()
            process.wait(timeout=15)
    finally:
        deadline = time.monotonic() + 10
        while (cgroup / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.01)
        cgroup.rmdir()
