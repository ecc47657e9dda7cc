"""A pool's process SIGKILLed in the middle of a snapshot, a fork, a restore or a save as
an image, on the harness's real node; then ``sandman gc --kubernetes`` or the next pool
of its name must leave nothing of it: no pod, no Lease, no snapshot (whole or
half-made), no scratch directory, no process.

The pool runs in a process of its own (``python -m tests.kube.snapshot_kills
'<ChildConfig JSON>'``): it makes a sandbox, writes ``size_mb`` of random bytes in it
(so that each step takes a while), takes a snapshot first (but for ``snapshot``), says
``ready`` and, told ``go``, starts the step. The parent watches for the step under way
(``snapshot``: the stream arriving in the snapshot directory; ``fork``: the fork's
create started, as the pool process tells; ``restore``: the pod deleted or made again;
``save-image``: the scratch directory of the image), waits, if the plan says so, for the
step's new pod on the API server, then ``delay`` seconds (drawn up to 1.5 s: the pod
starting, then its files applied) and kills the process. The reaper then runs (``gc``: the
command, as the operator would, until it has nothing left to do; ``pool``: a pool of
the same name started, whose reconcile passes, one after another, adopt the dead
owner's snapshots and reap its pods and Lease, then closed), and the inventory must be
empty. `tests/kube/test_snapshot_kills.py` runs each step; ``benchmarks/chaos.py
--provider kubernetes --snapshots`` draws them.

``gc`` keeps its snapshots in the default ``snapshot_dir`` (the command knows no
other), so with that reaper the pool does too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

OPS = ("snapshot", "fork", "restore", "save-image")
REAPERS = ("gc", "pool")
OWNER_LEASE = 3
OWNER_GRACE = 2.0
READY_TIMEOUT = 240.0
STEP_TIMEOUT = 120.0
REAP_TIMEOUT = 90.0
REPO = Path(__file__).resolve().parents[2]


class ChildConfig(BaseModel):
    """What the pool process is told (one JSON argument)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: str
    pool: str
    kubeconfig: str
    namespace: str
    daemon_image: str
    real_node: str
    image: str
    """The sandbox's image; for ``save-image`` one in a registry (its layers are fetched)."""
    target: str = ""
    """``save-image``: the reference pushed to (a plain-HTTP registry)."""
    snapshot_dir: str = ""
    """Empty: the default one (which ``sandman gc`` reads)."""
    size_mb: int = 160


# -- the pool's process -----------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def kube_config(child: ChildConfig) -> Any:
    from sandman.settings import KubernetesConfig

    fields: dict[str, Any] = {
        "kubeconfig": Path(child.kubeconfig), "namespace": child.namespace,
        "daemon_image": child.daemon_image, "owner_lease": OWNER_LEASE,
        "owner_grace": OWNER_GRACE,
    }  # fmt: skip
    if child.snapshot_dir:
        fields["snapshot_dir"] = Path(child.snapshot_dir)
    return KubernetesConfig.model_validate(fields)


async def child_main(child: ChildConfig) -> None:
    from sandman.client import AsyncClient
    from sandman.client.backends import InProcessBackend
    from sandman.models import KubernetesOptions, SandboxSpec
    from sandman.pool import Pool, PoolConfig, PoolEvent
    from sandman.providers.kubernetes import KubernetesProvider

    config = kube_config(child)

    def hook(event: PoolEvent) -> None:
        if event.name == "create.started":  # the intent recorded, the pod asked for
            emit("creating", sandbox=event.sandbox_id)

    pool = Pool(KubernetesProvider(config), PoolConfig(name=child.pool), hook=hook)
    spec = SandboxSpec(
        image=child.image,
        cpu=0.5,
        memory="128Mi",
        kubernetes=KubernetesOptions(
            cpu_request=0.05,
            memory_request="32Mi",
            ephemeral_storage="1Gi",
            node_selector={"kubernetes.io/hostname": child.real_node},
        ),
    )
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with AsyncClient(InProcessBackend(pool, own_provider=True)) as client:
        sb = await client.acquire(spec, timeout=180)
        size = child.size_mb * 2**20
        written = await sb.exec(
            ["sh", "-c", f"mkdir -p /work && head -c {size} /dev/urandom > /work/big"],
            timeout=180,
        )
        assert written.exit_code == 0, written.stderr
        snap = None if child.op == "snapshot" else await sb.snapshot(ttl=600)
        emit("ready", owner=pool.owner, sandbox=sb.id, snapshot=snap.id if snap else None)
        await reader.readline()  # go
        emit("started")
        if child.op == "snapshot":
            await sb.snapshot(ttl=600)
        elif child.op == "fork":
            assert snap is not None
            await client.acquire(snapshot=snap, timeout=180)
        elif child.op == "restore":
            assert snap is not None
            await sb.restore(snap)
        elif child.op == "save-image":
            assert snap is not None
            maker = KubernetesProvider(config)
            try:
                await maker.save_image(snap.id, child.target, tls_verify=False)
            finally:
                await maker.aclose()
        emit("done")
        await reader.readline()  # killed before, or told to close


# -- the parent -------------------------------------------------------------------------


@dataclass(frozen=True)
class KillPlan:
    """One run: the step, who reaps, seconds between the step seen under way and the kill.

    ``pod_started``: wait first until the step's new pod is seen on the API server (a
    fork's, or the restored sandbox's made again), a point the step always passes with
    its files still to apply; a test's kill point is that condition, not a delay the step
    may outrun."""

    op: str
    reaper: str
    delay: float = 0.0
    pod_started: bool = False

    def describe(self) -> str:
        at = " at=pod-started" if self.pod_started else ""
        return f"kill-during-{self.op} reaper={self.reaper}{at} delay={self.delay:.2f}"


def plan_for(
    seed: int, iteration: int, *, op: str | None = None, ops: Sequence[str] = OPS
) -> KillPlan:
    """The plan of ``iteration`` of ``seed``: a step (of ``ops``), a reaper (``gc`` for
    ``save-image``: only it removes a dead maker's scratch directory) and a delay."""
    rng = random.Random(f"kube-snapshot-kills:{seed}:{iteration}")
    drawn = rng.choice(list(ops))
    drawn = op or drawn
    reaper = "gc" if drawn == "save-image" else rng.choice(REAPERS)
    return KillPlan(drawn, reaper, round(rng.uniform(0.0, 1.5), 2))


@dataclass
class KillOutcome:
    """What a run left (``leaked``, after the reaper) and what happened (``notes``)."""

    plan: KillPlan
    leaked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missed: bool = False
    """The step finished before it could be killed (nothing was tested)."""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.leaked)

    def summary(self) -> str:
        return f"leaked={len(self.leaked)}" + (" (step finished first)" if self.missed else "")

    def details(self) -> str:
        return f"{self.plan.describe()}: leaked {self.leaked}; notes: {self.notes}"


async def _events(process: asyncio.subprocess.Process) -> AsyncIterator[dict[str, Any]]:
    assert process.stdout is not None
    while line := await process.stdout.readline():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def _cwd_under(root: Path) -> list[str]:
    """The processes whose working directory is under ``root`` (skopeo works in a scratch
    directory of the store)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd.startswith(f"{root}/"):
                found.append(f"process {pid} in {cwd}")
    return found


async def run_kill(
    plan: KillPlan,
    cluster: Any,
    admin: Any,
    *,
    daemon_image: str,
    image: str,
    target: str = "",
    work: Path,
) -> KillOutcome:
    """Run ``plan`` on ``cluster`` (a `tests.kube.conftest.KubeCluster`; ``admin`` its
    `tests.kube.support.Admin`); what it left. Whatever it left is removed afterwards."""
    from sandman.providers.kubernetes import KubernetesProvider

    started = time.monotonic()
    outcome = KillOutcome(plan)
    pool = f"kill-{uuid.uuid4().hex[:8]}"
    own_dir = work / f"snapshots-{pool}"
    child = ChildConfig(
        op=plan.op, pool=pool, kubeconfig=str(cluster.kubeconfig), namespace=cluster.namespace,
        daemon_image=daemon_image, real_node=cluster.real_node, image=image, target=target,
        snapshot_dir="" if plan.reaper == "gc" else str(own_dir),
    )  # fmt: skip
    config = kube_config(child)
    probe = KubernetesProvider(config)
    root = probe.snapshot_store.root
    await probe.aclose()
    log = work / f"{pool}.log"
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.kube.snapshot_kills", child.model_dump_json(),
            cwd=REPO, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )  # fmt: skip
    owner = ""
    seen: set[str] = set()
    try:
        events = _events(process)
        ready: dict[str, Any] = {}
        async with asyncio.timeout(READY_TIMEOUT):
            async for event in events:
                if event["event"] == "ready":
                    ready = event
                    break
        if not ready:
            said = log.read_text(errors="replace").strip().splitlines()[-1:]
            outcome.leaked.append(f"the pool process never got ready: {said} (log: {log})")
            return outcome
        owner = str(ready["owner"])
        sandbox = str(ready["sandbox"])
        before = await admin.pod(sandbox)
        uid = before["metadata"]["uid"] if before else ""
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        creating: list[str] = []
        done = asyncio.ensure_future(_until_done(events, creating))
        under_way = await _wait_under_way(plan.op, sandbox, uid, root, admin, done, creating)
        if under_way is None:
            outcome.missed = True
            outcome.notes.append("the step finished before it was seen under way")
        else:
            outcome.notes.append(f"under way: {under_way}")
            if plan.pod_started:
                started_pod = await _wait_pod_started(plan.op, sandbox, uid, admin, done, creating)
                outcome.notes.append(f"pod started: {started_pod}")
            await asyncio.sleep(plan.delay)
        if done.done():
            outcome.missed = True
        done.cancel()
        seen = _store_entries(root)
        if process.returncode is not None:
            outcome.missed = True
            outcome.notes.append(f"the pool process ended by itself ({process.returncode})")
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        outcome.notes.append(f"killed; the store held {sorted(seen)}")
        await _reap(plan.reaper, child, cluster, admin, pool, owner, root, outcome)
        outcome.leaked = await _inventory(admin, pool, owner, root, seen, plan.reaper)
    except TimeoutError:
        outcome.leaked.append(f"timed out (log: {log})")
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        for name in await admin.sweep(pool):
            outcome.notes.append(f"scrubbed pod {name}")
        if owner.startswith("k.") and await admin.lease(owner[2:]) is not None:
            await admin.delete_lease(owner[2:])
        for name in seen | _pool_snapshots(root, pool):
            shutil.rmtree(root / name, ignore_errors=True)
        shutil.rmtree(own_dir, ignore_errors=True)
        outcome.seconds = time.monotonic() - started
    if not outcome.failed:
        log.unlink(missing_ok=True)
    return outcome


async def _until_done(events: AsyncIterator[dict[str, Any]], creating: list[str]) -> None:
    """Until the pool process says the step is done (or ends); the sandboxes whose
    creates it starts meanwhile go to ``creating``, as it tells of them."""
    async for event in events:
        if event["event"] == "creating":
            creating.append(str(event["sandbox"]))
        if event["event"] == "done":
            return


def _store_entries(root: Path) -> set[str]:
    try:
        return {name for name in os.listdir(root) if name.startswith(("sn-", ".image-", ".new-"))}
    except FileNotFoundError:
        return set()


def _pool_snapshots(root: Path, pool: str) -> set[str]:
    """The snapshots of ``pool`` in the store (by their record's labels)."""
    found = set()
    for name in _store_entries(root):
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads((root / name / "meta.json").read_text())
            if meta.get("labels", {}).get("sandman.io/pool") == pool:
                found.add(name)
    return found


async def _wait_under_way(
    op: str,
    sandbox: str,
    uid: str,
    root: Path,
    admin: Any,
    done: asyncio.Future[None],
    creating: list[str],
) -> str | None:
    """Until the step is seen under way (what was seen), or has finished (None). Each
    look is quick (a file, the pool process's word, one pod by name): a list of the
    namespace's pods can take seconds on a busy API server, longer than the step."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while not done.done():
        if time.monotonic() > deadline:
            raise TimeoutError
        if op == "snapshot":
            parts = list(root.glob("sn-*/.files.tar.part"))
            if parts and parts[0].stat().st_size > 0:
                return f"{parts[0].parent.name} arriving"
        elif op == "save-image":
            scratch = list(root.glob(".image-*"))
            if scratch:
                return f"scratch {scratch[0].name}"
        elif op == "fork":
            forks = [name for name in creating if name != sandbox]
            if forks:
                return f"fork {forks[0]} being created"
        elif op == "restore":
            pod = await admin.pod(sandbox)
            if pod is None:
                return f"pod {sandbox} deleted, to be made again"
            if pod["metadata"]["uid"] != uid:
                return f"pod {sandbox} made again ({(pod.get('status') or {}).get('phase')})"
        await asyncio.sleep(0.02)
    return None


async def _wait_pod_started(
    op: str,
    sandbox: str,
    uid: str,
    admin: Any,
    done: asyncio.Future[None],
    creating: list[str],
) -> str | None:
    """Until the step's new pod is on the API server (its name), or the step finished."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while not done.done():
        if time.monotonic() > deadline:
            raise TimeoutError
        names = [name for name in creating if name != sandbox] if op == "fork" else [sandbox]
        for name in names:
            pod = await admin.pod(name)
            if pod is not None and pod["metadata"]["uid"] != uid:
                return name
        await asyncio.sleep(0.02)
    return None


async def _reap(
    reaper: str, child: ChildConfig, cluster: Any, admin: Any, pool: str, owner: str,
    root: Path, outcome: KillOutcome,
) -> None:  # fmt: skip
    """``sandman gc --kubernetes`` until nothing of the run is left, or a pool of its name
    started, until it reaped the pods and the Lease and adopted the snapshots, and closed."""
    deadline = time.monotonic() + REAP_TIMEOUT
    if reaper == "gc":
        while time.monotonic() < deadline:
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", "from sandman.cli import main; main()", "gc",
                 "--kubernetes", "--kubeconfig", str(cluster.kubeconfig), "--namespace",
                 cluster.namespace],
                capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
            )  # fmt: skip
            reaped = [line for line in done.stdout.splitlines() if line.startswith("reaped ")]
            outcome.notes += reaped[:-1]
            if done.returncode != 0:
                outcome.notes.append(f"gc failed: {done.stderr.strip()[-300:]}")
            if not await _inventory(admin, pool, owner, root, set(), reaper):
                return
            await asyncio.sleep(2)
        return
    from sandman.pool import Pool, PoolConfig
    from sandman.providers.kubernetes import KubernetesProvider

    events: list[str] = []

    def hook(event: Any) -> None:
        if event.name.startswith(("reconcile.", "owners.", "snapshot.")):
            events.append(f"{event.name} {event.sandbox_id or ''} {event.detail}"[:300])

    successor = Pool(
        KubernetesProvider(kube_config(child)),
        PoolConfig(name=pool, reconcile_interval=1.0),
        hook=hook,
    )
    await successor.start()
    try:
        while time.monotonic() < deadline:
            # A pass now, as its loop makes them: on a busy API server the loop's passes
            # are spaced out (a pass may take a 20th of the time between them).
            await successor.reconcile()
            pods = await admin.names(pool)
            adopted = {info.id for info in successor.snapshots()}
            # A dead owner's Lease goes with its last pod, at a reconcile pass after it.
            lease = owner.startswith("k.") and await admin.lease(owner[2:]) is not None
            if not pods and not lease and _pool_snapshots(root, pool) <= adopted:
                outcome.notes.append(f"the next pool adopted {sorted(adopted)}")
                return
            await asyncio.sleep(0.5)
        outcome.notes.append(f"the next pool did not reap in time; its events: {events[-20:]}")
    finally:
        await successor.aclose()
        await successor.provider.aclose()


async def _inventory(
    admin: Any, pool: str, owner: str, root: Path, seen: set[str], reaper: str
) -> list[str]:
    """What is left of the run: its pods, its owner's Lease, its snapshots and scratch
    directories (those seen at the kill, or of its pool), processes working in the store."""
    left = [f"pod {name}" for name in await admin.names(pool)]
    if owner.startswith("k.") and await admin.lease(owner[2:]) is not None:
        left.append(f"lease {owner[2:]}")
    entries = _store_entries(root)
    ours = (seen & entries) | _pool_snapshots(root, pool)
    if reaper == "pool" and root.exists():  # the store is the run's own: all of it
        ours |= set(os.listdir(root))
    left += [f"store {name}" for name in sorted(ours)]
    left += _cwd_under(root)
    return left


if __name__ == "__main__":
    asyncio.run(child_main(ChildConfig.model_validate_json(sys.argv[1])))
