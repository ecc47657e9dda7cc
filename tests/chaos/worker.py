"""One client process of a chaos run: ``python -m tests.chaos.worker '<WorkerConfig JSON>'``.

It holds an embedded pool (``mode="embedded"``: the same client ``sandman.local()``
makes, with the run's state directory, cgroup parent and pool name) or talks to a
service (``mode="remote"``), runs a burst of acquire / exec / release with
cancellations at random points, then keeps ``hold`` sandboxes until told otherwise.

It reports on stdout, one JSON object a line (`Report` events):

- ``ready`` (the session is open, and the watchdog started), ``holding`` (the burst is over);
- ``created`` (the pool recorded the intent for a sandbox: embedded only), ``acquired``,
  ``released``, ``told`` (a call said the sandbox is gone: the holder drops it);
- ``error``: an exception that reached this caller, with whether it is typed (a
  `sandman.SandboxError`); a cancellation or deadline this worker caused itself is not;
- ``check``: answer to the ``check`` command (see `Worker.check`), ``released-all``
  (to ``release``: each sandbox held was given back, or the error said why not),
  ``closed``.

Commands on stdin, one a line: ``check``, ``release``, ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
import traceback
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

import sandman
from sandman.client._async import AsyncClient, AsyncSandbox
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent

GONE = ("SandboxNotFound", "SandboxLost")
"""Errors that tell a holder its sandbox is gone: it stops counting it as its own."""


class WorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    mode: Literal["embedded", "remote"]
    seed: int
    state_dir: str = ""
    cgroup_parent: str = ""
    pool: str = ""
    lease: float = 3.0
    reconcile_interval: float = 1.0
    url: str = ""
    api_key: str = ""
    heartbeat: float = 0.5
    tasks: int = 3
    rounds: int = 3
    hold: int = 2
    cancel_rate: float = 0.3
    networks: tuple[str, ...] = ("none", "none", "isolated", "egress")
    acquire_timeout: float = 30.0
    snapshot_rate: float = 0.0
    """How often a use also snapshots, forks, restores, pauses and resumes its sandbox."""


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def is_typed(exc: BaseException) -> bool:
    return isinstance(exc, sandman.SandboxError)


def report_error(op: str, exc: BaseException, sandbox: str | None = None) -> None:
    emit(
        "error", op=op, type=type(exc).__name__, typed=is_typed(exc), message=str(exc)[:500],
        sandbox=sandbox,
        traceback="" if is_typed(exc) else "".join(traceback.format_exception(exc))[-3000:],
    )  # fmt: skip


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.pool: Pool | None = None
        self.client = self._client()
        self.held: dict[str, AsyncSandbox] = {}

    def _client(self) -> AsyncClient:
        config = self.config
        if config.mode == "remote":
            return sandman.connect(
                config.url, api_key=config.api_key, heartbeat_interval=config.heartbeat,
                timeout=10.0,
            )  # fmt: skip
        from sandman.client.local import LocalBackend
        from sandman.providers.local import LocalProvider
        from sandman.settings import LocalConfig

        local = LocalConfig(state_dir=config.state_dir, cgroup_parent=config.cgroup_parent)
        pool_config = PoolConfig(
            name=config.pool, lease=config.lease, reconcile_interval=config.reconcile_interval
        )
        self.pool = Pool(LocalProvider(local), pool_config, hook=self._on_event)
        return AsyncClient(LocalBackend(self.pool, local), heartbeat_interval=config.heartbeat)

    def _on_event(self, event: PoolEvent) -> None:
        if event.name == "create.started" and event.sandbox_id:
            emit("created", sandbox=event.sandbox_id)

    def session(self) -> str | None:
        return self.client._session

    def spec(self) -> SandboxSpec:
        network = self.rng.choice(self.config.networks)
        return SandboxSpec.model_validate(
            {"image": "busybox", "memory": "64Mi", "pids": 64, "network": network}
        )

    # -- the burst ----------------------------------------------------------------------

    async def acquire(self, *, cancel: bool) -> AsyncSandbox | None:
        """A sandbox, or None if this worker cut the acquire off itself (or it failed)."""
        spec = self.spec()
        timeout = self.config.acquire_timeout
        try:
            if cancel and self.rng.random() < 0.5:
                task = asyncio.ensure_future(self.client.acquire(spec, timeout=timeout))
                await asyncio.sleep(self.rng.uniform(0, 0.6))
                ours = not task.done()
                task.cancel()
                try:
                    sb = await task
                except asyncio.CancelledError:
                    if not ours:
                        raise
                    emit("cancelled", how="cancel")
                    return None
            elif cancel:
                async with asyncio.timeout(self.rng.uniform(0, 0.6)) as deadline:
                    try:
                        sb = await self.client.acquire(spec, timeout=timeout)
                    except asyncio.CancelledError:
                        if deadline.expired():
                            emit("cancelled", how="deadline")
                            return None
                        raise
            else:
                sb = await self.client.acquire(spec, timeout=timeout)
        except TimeoutError as exc:
            if is_typed(exc):
                report_error("acquire", exc)
            else:
                emit("cancelled", how="deadline")
            return None
        except Exception as exc:  # noqa: BLE001 - every exception is reported, typed or not
            report_error("acquire", exc)
            return None
        self.held[sb.id] = sb
        emit("acquired", sandbox=sb.id, network=spec.network, session=self.session())
        return sb

    async def use(self, sb: AsyncSandbox) -> bool:
        """A command and a file; False if the sandbox is no longer this holder's."""
        try:
            result = await sb.exec(f"echo {sb.id} > /tmp/me && cat /tmp/me", timeout=10)
            if result.stdout.strip() != sb.id:
                emit("error", op="exec", type="WrongOutput", typed=True, message=result.stdout)
            if self.rng.random() < self.config.snapshot_rate:
                await self.branch(sb)
            return True
        except Exception as exc:  # noqa: BLE001
            report_error("exec", exc, sb.id)
            await self.drop(sb, exc)
            return False

    async def branch(self, sb: AsyncSandbox) -> None:
        """A snapshot, a fork of it used and released, a restore, a pause and a resume:
        a fault may hit any of them."""
        snap = await sb.snapshot(ttl=60)
        try:
            (fork,) = await sb.fork(1)
            emit("acquired", sandbox=fork.id, network="fork", session=self.session())
            try:
                await fork.exec("cat /tmp/me", timeout=10)
            finally:
                await self.release(fork)
            await sb.restore(snap)
            await sb.pause()
            await sb.resume()
        finally:
            with contextlib.suppress(Exception):
                await self.client.delete_snapshot(snap)

    async def drop(self, sb: AsyncSandbox, exc: BaseException) -> None:
        """After an error: a sandbox said to be gone is no longer counted; another is released."""
        self.held.pop(sb.id, None)
        if type(exc).__name__ in GONE:
            emit("told", sandbox=sb.id, type=type(exc).__name__)
            return
        await self.release(sb)

    async def release(self, sb: AsyncSandbox) -> None:
        self.held.pop(sb.id, None)
        try:
            await sb.release()
        except Exception as exc:  # noqa: BLE001
            report_error("release", exc, sb.id)
        emit("released", sandbox=sb.id)

    async def task(self) -> None:
        for _ in range(self.config.rounds):
            cancel = self.rng.random() < self.config.cancel_rate
            sb = await self.acquire(cancel=cancel)
            if sb is None:
                await asyncio.sleep(self.rng.uniform(0.1, 0.5))
                continue
            if await self.use(sb):
                await asyncio.sleep(self.rng.uniform(0, 0.5))
                await self.release(sb)

    async def keep(self, deadline: float) -> None:
        """One sandbox to keep: as a trainer would, it tries again (for a while) when an
        acquire fails."""
        while time.monotonic() < deadline:
            if await self.acquire(cancel=False) is not None:
                return
            await asyncio.sleep(0.5)

    async def burst(self) -> None:
        await asyncio.gather(*(self.task() for _ in range(self.config.tasks)))
        deadline = time.monotonic() + 20
        await asyncio.gather(*(self.keep(deadline) for _ in range(self.config.hold)))
        emit("holding", held=sorted(self.held))

    # -- commands ---------------------------------------------------------------------

    async def check(self) -> None:
        """Probe every sandbox held (the holder learns here if one is gone), see if a new
        one can still be had, and report what this holder and its pool count as theirs."""
        broken = []
        for sb in list(self.held.values()):
            try:
                await sb.exec(["true"], timeout=10)
            except Exception as exc:  # noqa: BLE001
                report_error("probe", exc, sb.id)
                if type(exc).__name__ in GONE:
                    self.held.pop(sb.id, None)
                    emit("told", sandbox=sb.id, type=type(exc).__name__)
                else:
                    broken.append(sb.id)
        can_acquire = ""
        try:
            async with self.client.sandbox(spec := self.spec(), timeout=30) as sb:
                await sb.exec(["true"], timeout=10)
        except Exception as exc:  # noqa: BLE001
            report_error("check-acquire", exc)
            can_acquire = f"{type(exc).__name__}: {exc}"[:300]
        del spec
        records = None
        if self.pool is not None:
            records = [
                {"id": r.id, "state": r.state, "session": r.session} for r in self.pool.list()
            ]
        emit(
            "check", session=self.session(), held=sorted(self.held), broken=broken,
            can_acquire=can_acquire, records=records,
        )  # fmt: skip

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception as exc:  # noqa: BLE001
            report_error("close", exc)
        emit("closed")


async def main(config: WorkerConfig) -> None:
    worker = Worker(config)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        await worker.client._ensure_session()
    except Exception as exc:  # noqa: BLE001
        report_error("open", exc)
        emit("closed")
        return
    emit("ready", session=worker.session())
    burst = asyncio.ensure_future(worker.burst())
    while line := (await reader.readline()).decode().strip():
        if line == "check":
            if not burst.done():
                burst.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await burst
            await worker.check()
        elif line == "release":
            for sb in list(worker.held.values()):
                await worker.release(sb)
            emit("released-all")
        elif line == "close":
            burst.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await burst
            await worker.close()
            return
    # stdin closed: the run is gone; close as a program would at exit.
    burst.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await burst
    await worker.close()


if __name__ == "__main__":
    asyncio.run(main(WorkerConfig.model_validate_json(sys.argv[1])))
