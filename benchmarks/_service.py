"""A throwaway ``sandman serve`` on this machine for a benchmark run (``--serve``).

Its own state directory (busybox imported as ``busybox``), cgroup parent, pool
name, port and API key; at the end SIGTERM (the service releases everything),
then the cgroup parent and state directory are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from _common import new_cgroup_parent

from sandman.images.busybox import busybox_rootfs_tar
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

TENANT = "bench"


@dataclass
class LocalService:
    url: str
    api_key: str
    provider: LocalProvider
    """The service's provider, seen from here: to count what the backend really holds."""
    process: asyncio.subprocess.Process
    log: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_healthy(
    url: str, process: asyncio.subprocess.Process, log: Path | None, timeout: float
) -> None:
    """Until ``sandman serve`` at ``url`` answers its health check; an error (with the
    end of its log, if it has one) if it exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=2) as http:
        while True:
            if process.returncode is not None:
                said = f": {log.read_text()[-2000:]}" if log is not None else ""
                raise RuntimeError(f"sandman serve exited {process.returncode}{said}")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/v1/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandman serve not healthy in {timeout} s ({log})")
            await asyncio.sleep(0.05)


async def stop(process: asyncio.subprocess.Process, timeout: float = 120) -> None:
    """SIGTERM (the service releases what it holds), then SIGKILL after ``timeout`` s."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def local_service(
    *, lease: float = 30.0, extra: tuple[str, ...] = ()
) -> AsyncIterator[LocalService]:
    """Start ``sandman serve`` on 127.0.0.1 and yield it once healthy; stop and clean up after."""
    state = Path(tempfile.mkdtemp(prefix="sms-", dir="/tmp"))
    config = LocalConfig(state_dir=state, cgroup_parent=new_cgroup_parent())
    provider = LocalProvider(config)
    key = secrets.token_urlsafe(24)
    port = free_port()
    log = state / "serve.log"
    process: asyncio.subprocess.Process | None = None
    try:
        await provider.images.import_archive(
            busybox_rootfs_tar(state / "busybox.tar"), name="busybox"
        )
        env = {
            **os.environ,
            "SANDMAN_STATE_DIR": str(state),
            "SANDMAN_CGROUP_PARENT": config.cgroup_parent,
            "SANDMAN_API_KEYS": f"{TENANT}:{key}",
        }
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "from sandman.cli import main; main()", "serve",
                 "--port", str(port), "--pool-name", f"bench-{uuid.uuid4().hex[:6]}",
                 "--lease", str(lease), "--log-level", "warning", *extra,
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        service = LocalService(f"http://127.0.0.1:{port}", key, provider, process, log)
        await wait_healthy(service.url, process, log, 60)
        yield service
    finally:
        if process is not None:
            await stop(process)
        for info in await provider.list():  # only if the service failed to release them
            await provider.delete(info.id)
        await provider.aclose()
        remove_cgroup_parent(config.cgroup_parent)
        shutil.rmtree(state, ignore_errors=True)
