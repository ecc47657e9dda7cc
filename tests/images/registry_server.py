"""A real registry on 127.0.0.1 for the pull tests: Debian's ``docker-registry`` binary.

`start_registry` writes its config (filesystem storage, a free loopback port,
htpasswd auth when asked), starts it, and waits until ``GET /v2/`` answers.
`push` copies an OCI layout into it with skopeo. Nothing here talks to any
address but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REGISTRY_BINARY = "/usr/bin/docker-registry"
READY_TIMEOUT = 20.0


def missing_tools() -> str | None:
    """Why the registry tests cannot run here, or None when they can."""
    missing = [
        tool
        for tool, found in [
            ("docker-registry", Path(REGISTRY_BINARY).is_file()),
            ("skopeo", shutil.which("skopeo") is not None),
            ("apache2-utils (htpasswd)", shutil.which("htpasswd") is not None),
        ]
        if not found
    ]
    if not missing:
        return None
    return (
        f"needs {', '.join(missing)}: apt-get install -y skopeo docker-registry apache2-utils "
        "(scripts/setup installs them)"
    )


def free_port() -> int:
    """A loopback port nobody listens on (just now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Registry:
    """A running registry: ``host`` is ``127.0.0.1:<port>``, as image references spell it."""

    host: str
    root: Path
    process: subprocess.Popen[bytes]
    username: str | None = None
    password: str | None = None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        path = self.root / "registry.log"
        return path.read_text(errors="replace") if path.exists() else ""


def start_registry(
    root: Path,
    *,
    username: str | None = None,
    password: str | None = None,
    access_log: bool = False,
) -> Registry:
    """Start a registry storing under `root`; with htpasswd (bcrypt) auth when given a user;
    with `access_log`, every request is in `Registry.log` (see `blob_fetches`)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = [
        "version: 0.1",
        "log:",
        "  level: info",
        "  accesslog:",
        f"    disabled: {'false' if access_log else 'true'}",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {root / 'data'}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: 127.0.0.1:{port}",
        "  secret: sandman-tests-only",
    ]
    if username is not None and password is not None:
        htpasswd = subprocess.run(
            ["htpasswd", "-Bbn", username, password], check=True, capture_output=True
        ).stdout
        (root / "htpasswd").write_bytes(htpasswd)
        config += [
            "auth:",
            "  htpasswd:",
            "    realm: sandman-tests",
            f"    path: {root / 'htpasswd'}",
        ]
    (root / "config.yml").write_text("\n".join(config) + "\n")
    with open(root / "registry.log", "wb") as log:
        process = subprocess.Popen(
            [REGISTRY_BINARY, "serve", str(root / "config.yml")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    registry = Registry(f"127.0.0.1:{port}", root, process, username, password)
    try:
        _wait_ready(registry)
    except BaseException:
        registry.stop()
        raise
    return registry


def _wait_ready(registry: Registry) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    url = f"http://{registry.host}/v2/"
    while True:
        if registry.process.poll() is not None:
            raise RuntimeError(f"docker-registry exited early:\n{registry.log()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # up, and wants credentials
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"docker-registry not ready within {READY_TIMEOUT}s:\n{registry.log()}"
            )
        time.sleep(0.05)


def push(layout: Path, tag: str, registry: Registry, repository: str) -> str:
    """Copy image `tag` of OCI layout `layout` to `registry` as `repository:tag`; its reference."""
    reference = f"{registry.host}/{repository}:{tag}"
    command = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if registry.username is not None:
        command.append(f"--dest-creds={registry.username}:{registry.password}")
    command += [f"oci:{layout}:{tag}", f"docker://{reference}"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"pushing {reference} failed: {result.stderr}\n{registry.log()}")
    return reference


def blob_fetches(registry: Registry) -> list[str]:
    """The blob digests fetched so far (``GET /v2/<name>/blobs/<digest>``), in order; needs
    a registry started with ``access_log=True``."""
    return re.findall(r'"GET /v2/\S+/blobs/(sha256:[0-9a-f]{64}) HTTP', registry.log())


class SilentServer:
    """A loopback port that accepts TCP connections (in the kernel) but never answers."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(16)
        self.host = f"127.0.0.1:{self._socket.getsockname()[1]}"

    def close(self) -> None:
        self._socket.close()


class UnansweredPort:
    """A loopback port whose accept queue is full, so new connections get no answer at all
    (the kernel drops their SYNs): what a firewalled or vanished host looks like."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(0)
        port = self._socket.getsockname()[1]
        self.host = f"127.0.0.1:{port}"
        self._fillers = []
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            self._fillers.append(filler)

    def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        self._socket.close()
