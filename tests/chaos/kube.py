"""Chaos on Kubernetes: the harness cluster (``hack/kube``), faults of the backend's side.

An iteration runs two client processes (`tests.chaos.kube_worker`: an embedded pool
each, pods on KWOK nodes) through a burst; the fault hits at a random point:

- ``delete-pods``: one or two pods a client holds deleted behind its pool's back;
- ``evict-pod``: one evicted through the eviction API;
- ``kill-client``: a client's process SIGKILLed (mid-burst or holding): its pods are
  reaped through its Lease, by ``sandman gc --kubernetes`` or the other pool's
  reconcile (``reaper``);
- ``cut-api``: both clients reach the API server through a proxy that is cut for a
  few seconds (every connection and watch dropped, new ones refused).

Then the same accounting as the local runs (`tests.chaos.engine.Iteration.check`:
lost, stuck, untyped), every client closes, and the inventory must settle to
nothing: the run's pods by label (a consistent list), the Leases of its clients, and
on the host, its processes and what `tests.chaos.inventory` finds under its scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.chaos import inventory
from tests.chaos.engine import Iteration, Outcome, Plan, _play
from tests.chaos.inventory import Item, Scope
from tests.chaos.kube_worker import KubeWorkerConfig
from tests.chaos.processes import REPO, WorkerProcess, child_env, processes_with
from tests.kube.conftest import KubeCluster
from tests.kube.support import Admin, CutProxy

OWNER_LEASE = 3
OWNER_GRACE = 2.0
SETTLE = 30.0
REAP = 45.0
"""Seconds a killed client's pods and Lease may take to go (expiry, judging, deletes)."""

FAULTS = ("delete-pods", "evict-pod", "kill-client", "cut-api")
"""Drawn at random; ``none`` (a control) is only run when asked for."""


def plan_for(
    seed: int, iteration: int, *, fault: str | None = None, at: float | None = None,
    **params: Any,
) -> Plan:  # fmt: skip
    """The plan of ``iteration`` of ``seed`` on Kubernetes (scenario ``kubernetes``)."""
    rng = random.Random(f"kube-chaos:{seed}:{iteration}")
    drawn_fault = rng.choice(FAULTS)
    fault = fault or drawn_fault
    drawn_at = round(rng.uniform(0.0, 1.5), 2)
    drawn: dict[str, Any] = {}
    if fault in ("delete-pods", "evict-pod", "kill-client"):
        drawn["when"] = rng.choice(["burst", "hold"])
    if fault == "delete-pods":
        drawn["count"] = rng.choice([1, 2])
    if fault == "kill-client":
        drawn["reaper"] = rng.choice(["gc", "pool"])
    if fault == "cut-api":
        drawn["duration"] = round(rng.uniform(1.0, 8.0), 2)
    seeds = tuple(rng.randrange(2**31) for _ in range(3))
    return Plan(seed, iteration, "kubernetes", fault, drawn_at if at is None else at,
                drawn | params, seeds)  # fmt: skip


class KubeIteration(Iteration):
    """One iteration on the cluster: the local `Iteration`'s accounting, the backend's faults."""

    def __init__(
        self, plan: Plan, scope: Scope, logs: Path, cluster: KubeCluster, admin: Admin,
        proxy: CutProxy | None,
    ) -> None:  # fmt: skip
        super().__init__(plan, scope, logs)
        self.cluster = cluster
        self.admin = admin
        self.proxy = proxy
        self.pools: set[str] = set()

    def kube_config(self, name: str, seed: int, **overrides: Any) -> KubeWorkerConfig:
        pool = f"{self.scope.pool_prefix}-{name}"
        self.pools.add(pool)
        values: dict[str, Any] = {
            "name": name, "seed": seed, "pool": pool, "namespace": self.cluster.namespace,
            "owner_lease": OWNER_LEASE, "owner_grace": OWNER_GRACE,
            "cancel_rate": 0.3,
        }  # fmt: skip
        if self.proxy is not None:
            token = self.scope.state_dir / "token"
            token.write_text(self.cluster.token)
            values |= {"server": self.proxy.url, "token_file": str(token),
                       "ca_file": str(self.cluster.ca)}  # fmt: skip
        else:
            values["kubeconfig"] = str(self.cluster.kubeconfig)
        values |= {k: v for k, v in self.plan.params.items() if k in ("tasks", "rounds", "hold")}
        return KubeWorkerConfig(**(values | overrides))

    async def start_worker(self, name: str, seed: int, **overrides: Any) -> WorkerProcess:
        worker = WorkerProcess(self.kube_config(name, seed, **overrides), self.logs)
        self.workers.append(worker)
        await worker.start()
        ready = await worker.wait_for("ready", 60)
        if ready is None:
            self.notes.append(f"worker {name} never became ready")
        elif not str(ready.get("owner", "")).startswith("k."):
            self.notes.append(f"worker {name} has no Lease owner ({ready.get('owner')!r})")
        return worker

    async def sample(self) -> None:
        """Nothing to learn as it goes: pods are found by label."""
        await asyncio.Event().wait()

    def owners(self) -> set[str]:
        return {e["owner"] for w in self.workers for e in w.of("ready") if e.get("owner")}

    # -- the faults ----------------------------------------------------------------------

    async def inject(self) -> None:
        plan = self.plan
        if plan.params.get("when", "burst") == "hold":
            for worker in self.workers:
                await worker.wait_for("holding", 120)
        else:
            await asyncio.sleep(plan.at)
        fault = plan.fault
        if fault == "none":
            return
        if fault == "delete-pods":
            await self.take_pods(int(plan.params.get("count", 1)), self.admin.delete, "deleted")
        elif fault == "evict-pod":
            await self.take_pods(1, self.evict, "evicted")
        elif fault == "kill-client":
            await self.kill_client(str(plan.params.get("reaper", "pool")))
        elif fault == "cut-api":
            assert self.proxy is not None
            self.proxy.sever()
            await asyncio.sleep(float(plan.params.get("duration", 3.0)))
            self.proxy.restore()
        else:
            raise ValueError(f"unknown fault {fault!r}")

    async def take_pods(self, count: int, how: Any, what: str) -> None:
        """``how`` (delete, evict) ``count`` pods the live clients hold, behind their pools."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = sorted(set().union(*(w.held() for w in self.live())))
            if held:
                for name in self.rng.sample(held, min(count, len(held))):
                    self.doomed.add(name)
                    await how(name)
                    self.notes.append(f"{what} pod {name}")
                return
            await asyncio.sleep(0.1)
        self.notes.append(f"{what}: no pod was held")

    async def evict(self, name: str) -> None:
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": name, "namespace": self.cluster.namespace}}  # fmt: skip
        answer = await self.admin.http.post(f"{self.admin.pods}/{name}/eviction", json=body)
        if answer.status_code not in (200, 201, 404):
            self.notes.append(f"eviction of {name}: {answer.status_code} {answer.text[:200]}")

    async def kill_client(self, reaper: str) -> None:
        victim = self.workers[0]
        owner = next((e["owner"] for e in victim.of("ready") if e.get("owner")), "")
        victim.signal(signal.SIGKILL)
        if victim.process is not None:
            await victim.process.wait()
        if not owner.startswith("k."):
            self.notes.append(f"kill-client: the victim has no Lease owner ({owner!r})")
            return
        if reaper == "gc":
            await self.wait_expired(owner[2:])
            await self.gc()

        async def reaped() -> bool:
            return (
                not await self.admin.owned_by(owner) and await self.admin.lease(owner[2:]) is None
            )

        deadline = time.monotonic() + REAP
        while not await reaped():
            if time.monotonic() > deadline:
                self.notes.append(
                    f"kill-client: {owner}'s pods or Lease still there after {REAP} s"
                )
                return
            await asyncio.sleep(0.5)
        self.notes.append(f"kill-client: {owner} reaped by {reaper}")

    async def wait_expired(self, lease: str) -> None:
        deadline = time.monotonic() + OWNER_LEASE * 4
        while time.monotonic() < deadline:
            body = await self.admin.lease(lease)
            if body is None:
                return
            renewed = datetime.fromisoformat(body["spec"]["renewTime"]).timestamp()
            if renewed + OWNER_LEASE < time.time():
                return
            await asyncio.sleep(0.2)

    async def gc(self) -> None:
        """``sandman gc --kubernetes``, as the operator who finds a dead process's pods."""
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", "from sandman.cli import main; main()", "gc", "--kubernetes",
             "--kubeconfig", str(self.cluster.kubeconfig), "--namespace", self.cluster.namespace],
            env=child_env(), capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
        )  # fmt: skip
        self.notes.append(f"sandman gc: {(done.stdout + done.stderr).strip()[-300:]}")

    # -- the inventory -------------------------------------------------------------------

    async def inventory(self) -> list[Item]:
        """The run's pods (by pool label or owner; a consistent list), its clients' Leases,
        its processes and whatever the host inventory finds under its scope."""
        owners = self.owners()
        answer = await self.admin.http.get(
            self.admin.pods, params={"labelSelector": "app.kubernetes.io/managed-by=sandman"}
        )
        answer.raise_for_status()
        found: list[Item] = []
        for pod in answer.json()["items"]:
            labels = pod["metadata"].get("labels") or {}
            if (
                labels.get("sandman.io/pool") in self.pools
                or labels.get("sandman.io/owner") in owners
            ):
                name = pod["metadata"]["name"]
                phase = (pod.get("status") or {}).get("phase", "?")
                found.append(
                    Item("pod", f"{name} {phase} pool={labels.get('sandman.io/pool')}", name)
                )
        leases = set(await self.admin.owner_leases())
        found += [Item("lease", o[2:]) for o in sorted(owners) if o[2:] in leases]
        prefix = self.scope.pool_prefix.encode()
        found += [Item("process", f"pid {pid} of the run") for pid in processes_with(prefix)]
        found += await asyncio.to_thread(inventory.take, self.scope, self.tracker)
        return sorted(found)

    async def settle(self, timeout: float) -> list[Item]:
        deadline = time.monotonic() + timeout
        while True:
            left = await self.inventory()
            if not left or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.5)

    async def scrub(self) -> list[Item]:
        for item in await self.inventory():
            if item.kind == "pod":
                await self.admin.delete(item.sandbox)
            elif item.kind == "lease":
                await self.admin.delete_lease(item.name)
        return await self.settle(10)


async def run_iteration(plan: Plan, cluster: KubeCluster, work: Path) -> Outcome:
    """Run one Kubernetes iteration of ``plan``; its logs stay under ``work`` if it fails."""
    started = time.monotonic()
    logs = work / f"s{plan.seed}-i{plan.iteration}-{plan.scenario}-{plan.fault}"
    logs.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(plan, logs=logs)
    token = uuid.uuid4().hex[:8]
    state = Path(tempfile.mkdtemp(prefix="smk-", dir="/tmp"))
    scope = Scope(state, f"/sandman-chaos/{token}", f"kchaos-{token}")
    admin = Admin(cluster)
    proxy = CutProxy(cluster.server) if plan.fault == "cut-api" else None
    try:
        if proxy is not None:
            await proxy.start()
        run = KubeIteration(plan, scope, logs, cluster, admin, proxy)
        try:
            await _play(run, outcome)
        finally:
            with contextlib.suppress(Exception):
                await run.close()
            outcome.leaked = await run.settle(SETTLE)
            run.untyped(outcome)
            outcome.notes += run.notes
            left = await run.scrub()
            if left:
                outcome.notes.append(f"scrub could not remove: {[str(i) for i in left]}")
    finally:
        if proxy is not None:
            await proxy.aclose()
        await admin.http.aclose()
        shutil.rmtree(state, ignore_errors=True)
    outcome.seconds = time.monotonic() - started
    if not outcome.failed:
        shutil.rmtree(logs, ignore_errors=True)
        outcome.logs = None
    return outcome
