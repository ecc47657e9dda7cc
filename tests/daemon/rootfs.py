"""sandmand as PID 1 of a rootfs that holds nothing but a static busybox (and what a
test adds), in new pid and mount namespaces with ``unshare`` and a chroot: what a
container runtime gives the daemon, minus the runtime."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandman.daemon import DaemonClient, daemon_path
from tests.daemon.running import wait_listening

TOKEN = "pid1-token"
BUSYBOX_APPLETS = ("sh", "sleep", "ps", "cat", "echo", "seq", "ls", "true", "kill")

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or not Path("/bin/busybox").exists(),
    reason="needs root, unshare and a static busybox (scripts/setup installs them)",
)


def busybox_is_static() -> bool:
    out = subprocess.run(
        ["file", "-L", "/bin/busybox"], capture_output=True, text=True, check=False
    ).stdout
    return "statically linked" in out


def make_rootfs(root: Path, applets: Iterable[str] = BUSYBOX_APPLETS) -> None:
    for sub in ("bin", ".sandman", "run", "tmp", "proc", "dev"):
        (root / sub).mkdir(parents=True)
    os.mknod(root / "dev" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for applet in applets:
        (root / "bin" / applet).symlink_to("busybox")
    shutil.copy2(daemon_path(), root / ".sandman" / "sandmand")


class Pid1:
    def __init__(self, root: Path, process: subprocess.Popen[bytes], log: Path) -> None:
        self.root = root
        self.process = process
        self.log = log
        self.sock = str(root / "run" / "sandmand.sock")

    def client(self) -> DaemonClient:
        return DaemonClient(uds=self.sock, token=TOKEN)

    def daemon_host_pid(self) -> int:
        # unshare --fork: the daemon is unshare's only child.
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text()
        return int(children.split()[0])


@contextmanager
def run_pid1(root: Path, log: Path) -> Iterator[Pid1]:
    """Start sandmand as PID 1 of ``root`` (made with `make_rootfs`); kill it at the end."""
    if not busybox_is_static():
        pytest.skip("/bin/busybox is not static (install busybox-static)")
    env = {"PATH": "/bin", "SANDMAND_TOKEN": TOKEN}
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", f"--root={root}",
             "/.sandman/sandmand", "--listen", "unix:/run/sandmand.sock"],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        wait_listening(process, log, 1)
        yield Pid1(root, process, log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=15)
