"""The processes of a chaos run: client workers (`tests.chaos.worker`) and ``sandman serve``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tests.chaos.worker import WorkerConfig

if TYPE_CHECKING:
    from tests.chaos.kube_worker import KubeWorkerConfig

REPO = Path(__file__).resolve().parents[2]

# The service's pool reconciles every second (``sandman serve`` has no flag for it):
# an orphan must go within the short wait a chaos iteration gives it.
_SERVE = (
    "import functools, sandman.pool as p; "
    "p.PoolConfig = functools.partial(p.PoolConfig, reconcile_interval=1.0); "
    "from sandman.cli import main; main()"
)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this checkout's sources first."""
    path = [str(REPO / "src"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def processes_with(*needles: bytes) -> list[int]:
    """Pids whose command line contains every one of ``needles``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(proc.name))
    return found


def signal_pid(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class WorkerProcess:
    """One `tests.chaos.worker` (or ``kube_worker``) process and the events it has
    reported so far."""

    def __init__(self, config: WorkerConfig | KubeWorkerConfig, log_dir: Path) -> None:
        self.config = config
        self.module = (
            "tests.chaos.worker" if isinstance(config, WorkerConfig) else "tests.chaos.kube_worker"
        )
        self.name = config.name
        self.log = log_dir / f"{config.name}.log"
        self.journal = log_dir / f"{config.name}.events.jsonl"
        self.events: list[dict[str, Any]] = []
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.killed = False  # by the run, on purpose

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, self.config.model_dump_json(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                cwd=REPO, env=child_env(), start_new_session=True,
            )  # fmt: skip
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        journal = self.journal.open("ab")
        while line := await self.process.stdout.readline():
            journal.write(line)
            journal.flush()
            try:
                self.events.append(json.loads(line))
            except ValueError:
                self.events.append({"event": "garbage", "line": line.decode(errors="replace")})
            self._changed.set()
        journal.close()
        await self.process.wait()
        self._changed.set()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    async def wait_for(self, kind: str, timeout: float, *, after: int = 0) -> dict[str, Any] | None:
        """The first ``kind`` event at index ``after`` or later; None if the process
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events[after:]:
                if event["event"] == kind:
                    return event
            if not self.alive and (self._reader is None or self._reader.done()):
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 1.0)):
                    await self._changed.wait()

    async def command(self, line: str, answer: str, timeout: float) -> dict[str, Any] | None:
        if not self.alive:
            return None
        assert self.process is not None and self.process.stdin is not None
        mark = len(self.events)
        try:
            self.process.stdin.write(line.encode() + b"\n")
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return None
        return await self.wait_for(answer, timeout, after=mark)

    def session(self) -> str | None:
        """Its session as last reported."""
        found = [e["session"] for e in self.events if e.get("session")]
        return found[-1] if found else None

    def acquired_in(self) -> dict[str, str]:
        """The session each sandbox it acquired was acquired in."""
        return {e["sandbox"]: e.get("session") or "" for e in self.of("acquired")}

    def held(self) -> set[str]:
        """What it holds by its own events: acquired, and neither released nor told gone."""
        held: set[str] = set()
        for event in self.events:
            if event["event"] == "acquired":
                held.add(event["sandbox"])
            elif event["event"] in ("released", "told"):
                held.discard(event["sandbox"])
        return held

    def watchdogs(self) -> list[int]:
        return processes_with(b"sandman.client.watchdog", self.config.pool.encode())

    def signal(self, sig: signal.Signals) -> None:
        if self.alive:
            if sig == signal.SIGKILL:
                self.killed = True
            signal_pid(self.pid, sig)

    async def stop(self, timeout: float = 15.0) -> str:
        """Ask it to close; SIGKILL it if it has not exited ``timeout`` seconds later.
        Returns what went wrong ("" if nothing)."""
        problem = ""
        if self.alive and await self.command("close", "closed", timeout) is None and self.alive:
            problem = f"{self.name} did not close within {timeout:.0f} s: killed"
        if self.process is not None:
            try:
                async with asyncio.timeout(5):
                    await self.process.wait()
            except TimeoutError:
                problem = problem or f"{self.name} did not exit after closing: killed"
                self.signal(signal.SIGKILL)
                await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader
        return problem

    def crashed(self) -> str:
        """A traceback it died with, if it died on its own."""
        if self.process is None or self.process.returncode in (None, 0) or self.killed:
            return ""
        text = self.log.read_text(errors="replace")
        return text[-3000:] if "Traceback" in text else ""


class ServiceProcess:
    """``sandman serve`` on the local provider, restartable on the same port and pool."""

    def __init__(
        self, *, state_dir: Path, cgroup_parent: str, pool: str, api_key: str, lease: float,
        log_dir: Path,
    ) -> None:  # fmt: skip
        self.state_dir = state_dir
        self.cgroup_parent = cgroup_parent
        self.pool = pool
        self.api_key = api_key
        self.lease = lease
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self.mode = "release"

    def start(self, *, on_shutdown: str = "release", adopt: bool = True) -> None:
        self.lives += 1
        self.mode = on_shutdown
        log = self.log_dir / f"serve-{self.lives}.log"
        env = child_env(
            SANDMAN_STATE_DIR=str(self.state_dir), SANDMAN_CGROUP_PARENT=self.cgroup_parent,
            SANDMAN_API_KEYS=f"chaos:{self.api_key}",
        )  # fmt: skip
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, "serve", "--port", str(self.port),
                 "--pool-name", self.pool, "--lease", str(self.lease), "--log-level", "warning",
                 "--on-shutdown", on_shutdown, "--adopt" if adopt else "--no-adopt"],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.log_dir.glob("serve-*.log"))
        )

    async def wait_healthy(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as http:
            while time.monotonic() < deadline:
                if not self.alive:
                    return False
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/v1/health")).status_code == 200:
                        return True
                await asyncio.sleep(0.05)
        return False

    async def sandboxes(self) -> list[dict[str, Any]] | None:
        """The pool's records as the service lists them (its tenant's: every sandbox here)."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=10, headers=headers) as http:
                answer = await http.get("/v1/sandboxes")
        except httpx.TransportError:
            return None
        if answer.status_code != 200:
            return None
        listed: list[dict[str, Any]] = answer.json()["sandboxes"]
        return listed

    def watchdogs(self) -> list[int]:
        return processes_with(b"sandman.client.watchdog", self.pool.encode())

    def signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.alive:
            signal_pid(self.process.pid, sig)

    async def kill(self) -> None:
        if self.process is not None:
            self.signal(signal.SIGKILL)
            await asyncio.to_thread(self.process.wait)

    async def terminate(self, timeout: float = 90.0) -> int | None:
        """SIGTERM and wait; SIGKILL after ``timeout``. Its exit status (None: killed)."""
        if self.process is None:
            return None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            await self.kill()
            return None
