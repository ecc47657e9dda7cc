"""Start the real sandmand binary for tests, and wait for it with deadlines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandman.daemon import DaemonClient, daemon_path

_LISTENING = re.compile(r"sandmand: listening on (unix|tcp):(\S+)")


@dataclass
class RunningDaemon:
    process: subprocess.Popen[bytes]
    token: str | None
    log_path: Path
    uds: str | None = None
    tcp: tuple[str, int] | None = None

    def client(
        self, *, transport: Literal["unix", "tcp"] = "unix", token: str | None = "default"
    ) -> DaemonClient:
        use_token = self.token if token == "default" else token
        if transport == "unix":
            assert self.uds is not None
            return DaemonClient(uds=self.uds, token=use_token)
        assert self.tcp is not None
        return DaemonClient(host=self.tcp[0], port=self.tcp[1], token=use_token)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def wait_listening(
    process: subprocess.Popen[bytes], log_path: Path, expected: int, timeout: float = 10.0
) -> dict[str, str]:
    """Poll the daemon's log until it has announced `expected` addresses."""
    deadline = time.monotonic() + timeout
    while True:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        addresses = {m[1]: m[2] for m in _LISTENING.finditer(text)}
        if len(addresses) >= expected:
            return addresses
        if process.poll() is not None:
            raise RuntimeError(f"sandmand exited {process.returncode}: {text}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandmand did not announce its addresses in time: {text}")
        time.sleep(0.005)


def start_daemon(
    tmp_path: Path,
    *,
    token: str | None,
    tcp: bool = True,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> RunningDaemon:
    sock = tmp_path / "sandmand.sock"
    args = [str(daemon_path()), "--listen", f"unix:{sock}"]
    if tcp:
        args += ["--listen", "tcp:127.0.0.1:0"]
    args += extra_args or []
    child_env = dict(env if env is not None else os.environ)
    if token is not None:
        child_env["SANDMAND_TOKEN"] = token
    log_path = tmp_path / "sandmand.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            args, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=tmp_path
        )
    try:
        addresses = wait_listening(process, log_path, 2 if tcp else 1)
    except BaseException:
        process.kill()
        process.wait()
        raise
    host_port = None
    if "tcp" in addresses:
        host, _, port = addresses["tcp"].rpartition(":")
        host_port = (host, int(port))
    return RunningDaemon(process, token, log_path, uds=addresses["unix"], tcp=host_port)
