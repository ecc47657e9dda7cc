"""One client process of a Kubernetes chaos run: ``python -m tests.chaos.kube_worker '<JSON>'``.

It holds an embedded pool on the Kubernetes provider (pods on the harness's KWOK nodes,
pod readiness: no daemon runs there, so a sandbox is "used" by asking the pool whether
it still runs, `Pool.check`), runs a burst of acquire / check / release with
cancellations at random points, then keeps ``hold`` sandboxes until told otherwise.

It speaks the protocol of `tests.chaos.worker` (the same events and commands), and
says its owner (the Lease of its process) in its ``ready`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from sandman.settings import KubernetesConfig
from tests.chaos.worker import GONE, emit, report_error

KWOK = KubernetesOptions(
    cpu_request=0.001,
    memory_request="1Mi",
    node_selector={"type": "kwok"},
    tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
)


class KubeWorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    seed: int
    pool: str
    namespace: str
    kubeconfig: str = ""
    server: str = ""
    """With ``token_file`` and ``ca_file``: the API server (a proxy the run can cut)."""
    token_file: str = ""
    ca_file: str = ""
    owner_lease: int = 3
    owner_grace: float = 2.0
    reconcile_interval: float = 1.0
    tasks: int = 3
    rounds: int = 2
    hold: int = 2
    cancel_rate: float = 0.3
    acquire_timeout: float = 30.0


class KubeWorker:
    def __init__(self, config: KubeWorkerConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        fields: dict[str, object] = {
            "namespace": config.namespace, "readiness": "pod",
            "owner_lease": config.owner_lease, "owner_grace": config.owner_grace,
            # KWOK's stages without their simulated delays: a pod is Ready in ~50 ms.
            "annotations": KWOK_NO_DELAY,
        }  # fmt: skip
        if config.server:
            fields |= {"server": config.server, "token_file": Path(config.token_file),
                       "ca_file": Path(config.ca_file)}  # fmt: skip
        else:
            fields["kubeconfig"] = Path(config.kubeconfig)
        self.provider = KubernetesProvider(KubernetesConfig.model_validate(fields))
        pool_config = PoolConfig(name=config.pool, reconcile_interval=config.reconcile_interval)
        self.pool = Pool(self.provider, pool_config, hook=self._on_event)
        self.session = ""
        self.held: set[str] = set()
        self.spec = SandboxSpec(image="sandman.local/busybox:1.35", kubernetes=KWOK)

    def _on_event(self, event: PoolEvent) -> None:
        if event.name == "create.started" and event.sandbox_id:
            emit("created", sandbox=event.sandbox_id)

    async def open(self) -> None:
        await self.pool.start()
        # The chaos here is the backend's: a session the run never lets expire.
        self.session = self.pool.open_session(lease=3600)

    async def acquire(self, *, cancel: bool) -> str | None:
        timeout = self.config.acquire_timeout
        try:
            if cancel:
                task = asyncio.ensure_future(
                    self.pool.acquire(self.spec, session=self.session, timeout=timeout)
                )
                await asyncio.sleep(self.rng.uniform(0, 0.6))
                ours = not task.done()
                task.cancel()
                try:
                    record = await task
                except asyncio.CancelledError:
                    if not ours:
                        raise
                    emit("cancelled", how="cancel")
                    return None
            else:
                record = await self.pool.acquire(self.spec, session=self.session, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - every exception is reported, typed or not
            report_error("acquire", exc)
            return None
        self.held.add(record.id)
        emit("acquired", sandbox=record.id, session=self.session)
        return record.id

    async def use(self, sandbox: str) -> bool:
        try:
            await self.pool.check(sandbox)
            return True
        except Exception as exc:  # noqa: BLE001
            report_error("exec", exc, sandbox)
            self.held.discard(sandbox)
            if type(exc).__name__ in GONE:
                emit("told", sandbox=sandbox, type=type(exc).__name__)
            else:
                self.release(sandbox)
            return False

    def release(self, sandbox: str) -> None:
        self.held.discard(sandbox)
        try:
            self.pool.release(sandbox)
        except Exception as exc:  # noqa: BLE001
            report_error("release", exc, sandbox)
        emit("released", sandbox=sandbox)

    async def task(self) -> None:
        for _ in range(self.config.rounds):
            sandbox = await self.acquire(cancel=self.rng.random() < self.config.cancel_rate)
            if sandbox is None:
                await asyncio.sleep(self.rng.uniform(0.1, 0.5))
                continue
            if await self.use(sandbox):
                await asyncio.sleep(self.rng.uniform(0, 0.5))
                self.release(sandbox)

    async def keep(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if await self.acquire(cancel=False) is not None:
                return
            await asyncio.sleep(0.5)

    async def burst(self) -> None:
        await asyncio.gather(*(self.task() for _ in range(self.config.tasks)))
        deadline = time.monotonic() + 30
        await asyncio.gather(*(self.keep(deadline) for _ in range(self.config.hold)))
        emit("holding", held=sorted(self.held))

    async def check(self) -> None:
        broken = []
        for sandbox in sorted(self.held):
            try:
                await self.pool.check(sandbox)
            except Exception as exc:  # noqa: BLE001
                report_error("probe", exc, sandbox)
                if type(exc).__name__ in GONE:
                    self.held.discard(sandbox)
                    emit("told", sandbox=sandbox, type=type(exc).__name__)
                else:
                    broken.append(sandbox)
        can_acquire = ""
        try:
            record = await self.pool.acquire(self.spec, session=self.session, timeout=30)
            self.pool.release(record.id)
        except Exception as exc:  # noqa: BLE001
            report_error("check-acquire", exc)
            can_acquire = f"{type(exc).__name__}: {exc}"[:300]
        records = [{"id": r.id, "state": r.state, "session": r.session} for r in self.pool.list()]
        emit(
            "check", session=self.session, held=sorted(self.held), broken=broken,
            can_acquire=can_acquire, records=records,
        )  # fmt: skip

    async def close(self) -> None:
        try:
            await self.pool.aclose()
        except Exception as exc:  # noqa: BLE001
            report_error("close", exc)
        with contextlib.suppress(Exception):
            await self.provider.aclose()
        emit("closed")


async def main(config: KubeWorkerConfig) -> None:
    worker = KubeWorker(config)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        await worker.open()
    except Exception as exc:  # noqa: BLE001
        report_error("open", exc)
        emit("closed")
        return
    emit("ready", session=worker.session, owner=worker.pool.owner)
    burst = asyncio.ensure_future(worker.burst())
    while line := (await reader.readline()).decode().strip():
        if line == "check":
            if not burst.done():
                burst.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await burst
            await worker.check()
        elif line == "release":
            for sandbox in sorted(worker.held):
                worker.release(sandbox)
            emit("released-all")
        elif line == "close":
            burst.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await burst
            await worker.close()
            return
    burst.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await burst
    await worker.close()


if __name__ == "__main__":
    asyncio.run(main(KubeWorkerConfig.model_validate_json(sys.argv[1])))
