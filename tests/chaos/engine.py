"""One chaos iteration: a plan drawn from a seed, a burst, a fault, then the accounting.

An iteration has its own state directory, cgroup parent and pool names (see
`inventory.Scope`). Two client processes (`tests.chaos.worker`) run a burst,
each on an embedded pool (scenario ``embedded``) or against one ``sandman serve``
(scenario ``service``); the fault hits at a random point; survivors finish and
keep a sandbox each. After the lease and reconcile interval have passed:

- ``lost``: a sandbox a live holder counts as its own that its pool does not
  count as the holder's (or that is broken and not reported gone); one a live pool
  counts as leased that no live holder holds; one a live holder was told is gone
  that no fault doomed (`Iteration.doomed`);
- ``stuck``: a live client that cannot get a new sandbox any more;
- ``untyped``: an exception that reached a caller and is not a `sandman.SandboxError`
  (the worker's own cancellations and deadlines are not counted), or a client that
  died of one.

Then every client closes, the service stops (releasing), and the host inventory
must settle back to the baseline: what is left is ``leaked``. Whatever it is, the
iteration's resources are then scrubbed so the next one starts clean.

A plan is a pure function of (seed, iteration): the same seed and iteration replay
the same scenario, fault, timing and parameters (the interleaving of processes
differs from run to run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.chaos import inventory
from tests.chaos.inventory import Item, Scope, Tracker
from tests.chaos.processes import REPO, ServiceProcess, WorkerProcess, child_env, signal_pid
from tests.chaos.worker import WorkerConfig

_WORKER_PARAMS = ("tasks", "rounds", "hold", "cancel_rate")

LEASE = 3.0
HEARTBEAT = 0.5
RECONCILE = 1.0
SETTLE = 10.0

FAULTS: dict[str, tuple[str, ...]] = {
    "embedded": (
        "kill-client", "stop-client", "kill-watchdog", "stop-watchdog-kill-client",
        "kill-client-and-watchdog", "kill-daemon", "cancel-storm", "state-ro", "state-full",
    ),
    "service": (
        "kill-service", "term-service", "stop-service", "kill-service-slow-watchdog",
        "release-during-outage", "kill-client", "stop-client", "kill-daemon", "cancel-storm",
        "state-ro", "state-full",
    ),
}  # fmt: skip
"""Faults drawn at random per scenario; ``none`` (a control) is only run when asked for."""


@dataclass(frozen=True)
class Plan:
    """What one iteration does; drawn by `plan_for`."""

    seed: int
    iteration: int
    scenario: str
    fault: str
    at: float
    """Seconds after the burst starts (faults ``when="burst"``)."""
    params: dict[str, Any] = field(default_factory=dict)
    worker_seeds: tuple[int, ...] = ()

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return (
            f"seed={self.seed} iteration={self.iteration} scenario={self.scenario} "
            f"fault={self.fault} at={self.at:.2f}s {extra}".rstrip()
        )


def plan_for(
    seed: int,
    iteration: int,
    *,
    scenario: str | None = None,
    fault: str | None = None,
    at: float | None = None,
    **params: Any,
) -> Plan:
    """The plan of ``iteration`` of ``seed``; ``scenario``, ``fault``, ``at`` and ``params``
    (``duration``, ``when``, ``adopt``, ``on_shutdown``, ``restart_after``) force those;
    ``snapshots=True`` has the workers snapshot, fork, restore and pause as they go."""
    rng = random.Random(f"chaos:{seed}:{iteration}")
    drawn_scenario = rng.choice(sorted(FAULTS))
    scenario = scenario or drawn_scenario
    drawn_fault = rng.choice(FAULTS[scenario])
    fault = fault or drawn_fault
    drawn_at = round(rng.uniform(0.0, 1.5), 2)
    drawn: dict[str, Any] = {}
    if fault.startswith("stop-"):
        drawn["duration"] = round(rng.choice([0.3, 0.8, 1.5, 2.5]) * LEASE, 2)
    if fault.startswith("state-"):
        drawn["duration"] = round(rng.uniform(0.3, 3.0), 2)
    if fault == "kill-daemon":
        drawn["when"] = rng.choice(["burst", "hold"])
    if scenario == "service":
        drawn["on_shutdown"] = rng.choice(["release", "leave"])
        if fault in ("kill-service", "term-service"):
            drawn["adopt"] = rng.random() < 0.5
            drawn["restart_after"] = round(rng.uniform(0.0, 1.5), 2)
        if fault == "kill-service-slow-watchdog":
            drawn["on_shutdown"] = "release"  # only a releasing service has a watchdog
        if fault == "release-during-outage":
            # Clients release what they hold while the service is down; the next instance
            # adopts what the last one left.
            drawn |= {"on_shutdown": "leave", "adopt": True, "when": "hold"}
    seeds = tuple(rng.randrange(2**31) for _ in range(3))
    return Plan(seed, iteration, scenario, fault, drawn_at if at is None else at,
                drawn | params, seeds)  # fmt: skip


@dataclass
class Outcome:
    plan: Plan
    leaked: list[Item] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    logs: Path | None = None
    activity: dict[str, int] = field(default_factory=dict)
    """What the clients did: acquired, cancelled (by themselves), typed errors, told."""

    @property
    def leaked_count(self) -> int:
        return inventory.count(self.leaked)

    @property
    def failed(self) -> bool:
        return bool(self.leaked or self.lost or self.untyped or self.stuck)

    def summary(self) -> str:
        return (
            f"leaked={self.leaked_count} lost={len(self.lost)} "
            f"untyped_errors={len(self.untyped)} stuck={len(self.stuck)}"
        )

    def details(self) -> str:
        lines = [f"FAILED {self.plan.describe()}: {self.summary()}"]
        lines += [f"  leaked: {line}" for line in inventory.describe(self.leaked)]
        lines += [f"  lost: {text}" for text in self.lost]
        lines += [f"  untyped: {text}" for text in self.untyped]
        lines += [f"  stuck: {text}" for text in self.stuck]
        lines += [f"  note: {text}" for text in self.notes]
        if self.logs is not None:
            lines.append(f"  logs: {self.logs}")
        return "\n".join(lines)


class Iteration:
    """The state of one iteration while it runs."""

    def __init__(self, plan: Plan, scope: Scope, logs: Path) -> None:
        self.plan = plan
        self.scope = scope
        self.logs = logs
        self.rng = random.Random(f"chaos-fault:{plan.seed}:{plan.iteration}")
        self.tracker = Tracker()
        self.workers: list[WorkerProcess] = []
        self.service: ServiceProcess | None = None
        self.doomed: set[str] = set()
        """Sandboxes a fault may legitimately take from their holders..."""
        self.doomed_sessions: set[str] = set()
        """...and sessions it may end, with every sandbox acquired in them."""
        self.notes: list[str] = []
        self.api_key = secrets.token_urlsafe(24)

    # -- processes --------------------------------------------------------------------

    def worker_config(self, name: str, seed: int, **overrides: Any) -> WorkerConfig:
        plan = self.plan
        values: dict[str, Any] = {
            "name": name, "seed": seed, "heartbeat": HEARTBEAT,
            "cancel_rate": 0.9 if plan.fault == "cancel-storm" else 0.3,
        }  # fmt: skip
        # The burst's shape, when the plan says (tasks, rounds, hold, cancel_rate).
        values |= {k: v for k, v in plan.params.items() if k in _WORKER_PARAMS}
        if plan.params.get("snapshots"):
            values["snapshot_rate"] = 0.7
        if plan.scenario == "embedded":
            values |= {
                "mode": "embedded", "state_dir": str(self.scope.state_dir),
                "cgroup_parent": self.scope.cgroup_parent,
                "pool": f"{self.scope.pool_prefix}-{name}", "lease": LEASE,
                "reconcile_interval": RECONCILE,
            }  # fmt: skip
        else:
            assert self.service is not None
            values |= {"mode": "remote", "url": self.service.url, "api_key": self.api_key}
        return WorkerConfig(**(values | overrides))

    async def start_worker(self, name: str, seed: int, **overrides: Any) -> WorkerProcess:
        worker = WorkerProcess(self.worker_config(name, seed, **overrides), self.logs)
        self.workers.append(worker)
        await worker.start()
        if await worker.wait_for("ready", 60) is None:
            self.notes.append(f"worker {name} never became ready")
        return worker

    def live(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.alive]

    async def snapshot(self) -> set[str]:
        """The ids of every sandbox on the host now."""
        items = await asyncio.to_thread(inventory.take, self.scope, self.tracker)
        return {i.sandbox for i in items if i.sandbox}

    async def sample(self) -> None:
        """Keep learning sandbox ids (their networks are named after them)."""
        while True:
            await asyncio.to_thread(inventory.take, self.scope, self.tracker)
            for worker in self.workers:
                self.tracker.see(
                    e.get("sandbox") or "" for e in worker.events if e["event"] == "created"
                )
            await asyncio.sleep(0.5)

    async def start_service(self, *, on_shutdown: str, adopt: bool = True) -> None:
        assert self.service is not None
        self.service.start(on_shutdown=on_shutdown, adopt=adopt)
        if not await self.service.wait_healthy():
            self.notes.append(f"service life {self.service.lives} never became healthy")

    # -- the faults ----------------------------------------------------------------------

    async def inject(self) -> None:
        plan = self.plan
        victim = self.workers[0]
        fault = plan.fault
        when = plan.params.get("when", "burst")
        if when == "hold":
            for worker in self.workers:
                await worker.wait_for("holding", 120)
        elif when == "first-acquired":
            # The first sandbox is handed out: the others of the burst are being made.
            await asyncio.wait(
                [asyncio.ensure_future(w.wait_for("acquired", 60)) for w in self.workers],
                return_when=asyncio.FIRST_COMPLETED,
            )
            await asyncio.sleep(plan.at)
        else:
            await asyncio.sleep(plan.at)
        duration = float(plan.params.get("duration", 0.0))
        if fault in ("none", "cancel-storm"):
            return
        if fault == "kill-client":
            victim.signal(signal.SIGKILL)
        elif fault == "stop-client":
            if plan.scenario == "service" and duration > LEASE:
                # Its heartbeats stop: the service ends its session (rightly).
                self.doomed_sessions.add(victim.session() or "")
            victim.signal(signal.SIGSTOP)
            await asyncio.sleep(duration)
            victim.signal(signal.SIGCONT)
        elif fault == "kill-watchdog":
            for pid in victim.watchdogs():
                signal_pid(pid, signal.SIGKILL)
        elif fault == "stop-watchdog-kill-client":
            dogs = victim.watchdogs()
            for pid in dogs:
                signal_pid(pid, signal.SIGSTOP)
            victim.signal(signal.SIGKILL)
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))
            for pid in dogs:
                signal_pid(pid, signal.SIGCONT)
        elif fault == "kill-client-and-watchdog":
            dogs = victim.watchdogs()
            victim.signal(signal.SIGKILL)
            for pid in dogs:
                signal_pid(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            await self.gc()
        elif fault == "kill-daemon":
            await self.kill_daemon()
        elif fault == "state-ro":
            await self.read_only(duration)
        elif fault == "state-full":
            await self.full(duration)
        elif fault in ("kill-service", "term-service", "kill-service-slow-watchdog"):
            await self.restart_service()
        elif fault == "release-during-outage":
            await self.restart_service(meanwhile=self.release_all)
        elif fault == "stop-service":
            assert self.service is not None
            self.service.signal(signal.SIGSTOP)
            await asyncio.sleep(duration)
            self.service.signal(signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault {fault!r}")

    async def gc(self) -> None:
        """The successor of a pool that died with its watchdog: ``sandman gc``."""
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", "from sandman.cli import main; main()",
             "--state-dir", str(self.scope.state_dir), "gc"],
            env=child_env(SANDMAN_CGROUP_PARENT=self.scope.cgroup_parent),
            capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
        )  # fmt: skip
        self.notes.append(f"sandman gc: {(done.stdout + done.stderr).strip()[-300:]}")

    async def kill_daemon(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = sorted(set().union(*(w.held() for w in self.live())))
            for sandbox in self.rng.sample(held, len(held)):
                try:
                    pid = int((self.scope.sandboxes / sandbox / "pid").read_text())
                except (OSError, ValueError):
                    continue
                self.doomed.add(sandbox)
                if signal_pid(pid, signal.SIGKILL):
                    self.notes.append(f"killed the daemon (pid {pid}) of {sandbox}")
                    return
            await asyncio.sleep(0.1)
        self.notes.append("kill-daemon: no sandbox was held to kill the daemon of")

    async def read_only(self, duration: float) -> None:
        """The state directory read-only for ``duration`` seconds: a read-only bind of it
        over itself (its submounts, the disk filesystem, stay writable)."""
        state = str(self.scope.state_dir)
        await _run("mount", "--rbind", state, state)
        try:
            await _run("mount", "-o", "remount,bind,ro", state)
            await asyncio.sleep(duration)
        finally:
            await _run("umount", "-l", state)

    async def full(self, duration: float) -> None:
        """The state directory's filesystem (a small tmpfs) full for ``duration`` seconds."""
        filler = self.scope.state_dir / "filler"
        await asyncio.to_thread(_fill, filler)
        try:
            await asyncio.sleep(duration)
        finally:
            filler.unlink(missing_ok=True)

    async def release_all(self) -> None:
        """Every live client gives back what it holds (it cannot reach the service)."""
        await asyncio.gather(*(w.command("release", "released-all", 60) for w in self.live()))

    async def restart_service(
        self, meanwhile: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> None:
        """Stop the service (SIGKILL or SIGTERM), run ``meanwhile``, start it again."""
        service = self.service
        assert service is not None
        plan = self.plan
        mode = str(plan.params["on_shutdown"])
        adopt = bool(plan.params.get("adopt", True))
        dogs = service.watchdogs() if plan.fault == "kill-service-slow-watchdog" else []
        for pid in dogs:
            signal_pid(pid, signal.SIGSTOP)
        before = await self.snapshot()
        if mode == "release" or not adopt:
            # The old instance's watchdog, its shutdown, or the new one's reconciler deletes
            # them, and its sessions end with it.
            self.doomed |= before
            self.doomed_sessions |= {w.session() or "" for w in self.workers}
        if plan.fault == "term-service":
            code = await service.terminate()
            if code != 0:
                self.notes.append(f"the service exited {code} on SIGTERM")
        else:
            await service.kill()
        if meanwhile is not None:
            await meanwhile()
        await asyncio.sleep(float(plan.params.get("restart_after", 0.0)))
        await self.start_service(on_shutdown=mode, adopt=adopt)
        # A client that comes after the restart: the new instance must serve it, and keep
        # what it made for it.
        successor = await self.start_worker("c", self.plan.worker_seeds[2], tasks=2, rounds=1)
        if dogs:
            await successor.wait_for("holding", 60)
            for pid in dogs:
                signal_pid(pid, signal.SIGCONT)

    # -- accounting ----------------------------------------------------------------------

    async def check(self, outcome: Outcome) -> None:
        """Ask every live client what it holds, and its pool what it leases; compare."""
        reports: dict[str, dict[str, Any]] = {}
        for worker in self.live():
            report = await worker.command("check", "check", 120)
            if report is None:
                if worker.alive:
                    outcome.notes.append(f"{worker.name} did not answer the check")
                continue
            reports[worker.name] = report
            if report["can_acquire"]:
                outcome.stuck.append(
                    f"{worker.name} cannot get a sandbox any more: {report['can_acquire']}"
                )
        records: list[dict[str, Any]] = []
        if self.service is not None:
            listed = await self.service.sandboxes()
            if listed is None:
                outcome.notes.append("the service did not list its sandboxes")
            else:
                records = [r for r in listed if r["state"] != "gone"]
        for report in reports.values():
            records += report.get("records") or []
        leased = {r["id"]: r.get("session") for r in records if r["state"] == "leased"}
        sessions = {name: report["session"] for name, report in reports.items()}
        holders = {sandbox: name for name, r in reports.items() for sandbox in r["held"]}
        for name, report in reports.items():
            for sandbox in report["broken"]:
                outcome.lost.append(f"{name} holds {sandbox}, which no longer works")
            for sandbox in report["held"]:
                if sandbox not in report["broken"] and leased.get(sandbox) != sessions[name]:
                    outcome.lost.append(
                        f"{name} holds {sandbox}, which its pool does not count as its "
                        f"(leased to {leased.get(sandbox, 'no one')})"
                    )
        for sandbox, session in leased.items():
            if sandbox not in holders:
                owner = next((n for n, s in sessions.items() if s == session), "a session gone")
                outcome.lost.append(
                    f"{sandbox} is leased to {session} ({owner}), and no live holder holds it "
                    f"({self.history(sandbox)})"
                )
        for record in records:
            if record["state"] in ("queued", "creating", "starting", "ready"):
                outcome.lost.append(
                    f"{record['id']} stays {record['state']} long after the burst, held by no one"
                )
        for worker in self.workers:
            sessions_of = worker.acquired_in()
            for event in worker.of("told"):
                explained = sessions_of.get(event["sandbox"]) in self.doomed_sessions
                if event["sandbox"] not in self.doomed and not explained:
                    outcome.lost.append(
                        f"{worker.name} was told {event['sandbox']} is gone ({event['type']}), "
                        "and no fault explains it"
                    )

    def history(self, sandbox: str) -> str:
        """What the clients saw of ``sandbox``: how a lost one came to be lost."""
        seen = []
        for worker in self.workers:
            for event in worker.events:
                if event.get("sandbox") != sandbox:
                    continue
                if event["event"] == "error":
                    seen.append(f"{worker.name}: {event['op']} failed, {event['type']}")
                elif event["event"] in ("acquired", "released", "told"):
                    seen.append(f"{worker.name}: {event['event']}")
        return "; ".join(seen) or "never handed to a client"

    def untyped(self, outcome: Outcome) -> None:
        for worker in self.workers:
            for kind in ("acquired", "cancelled", "told"):
                outcome.activity[kind] = outcome.activity.get(kind, 0) + len(worker.of(kind))
            typed = sum(1 for e in worker.of("error") if e["typed"])
            outcome.activity["typed_errors"] = outcome.activity.get("typed_errors", 0) + typed
            for event in worker.of("error"):
                if not event["typed"]:
                    tail = event["traceback"].strip().splitlines()[-4:]
                    outcome.untyped.append(
                        f"{worker.name} {event['op']}: {event['type']}: {event['message']} "
                        f"| {' / '.join(line.strip() for line in tail)}"
                    )
            crash = worker.crashed()
            if crash:
                outcome.untyped.append(f"{worker.name} died: {crash.strip().splitlines()[-1]}")
        if self.service is not None:
            text = self.service.logs()
            if "Traceback" in text:
                outcome.notes.append(
                    "the service logged a traceback: "
                    + " / ".join(text[text.index("Traceback") :].splitlines()[-3:])
                )

    async def close(self) -> None:
        problems = await asyncio.gather(*(worker.stop() for worker in self.workers))
        self.notes += [problem for problem in problems if problem]
        service = self.service
        if service is None:
            return
        if service.alive:
            service.signal(signal.SIGCONT)
            code = await service.terminate()
            if code != 0:
                self.notes.append(f"the service exited {code} on SIGTERM at the end")
        if service.mode == "leave":
            # What it left goes with one more instance that deletes orphans and releases.
            await self.start_service(on_shutdown="release", adopt=False)
            await asyncio.sleep(RECONCILE * 2)
            await service.terminate()
        for pid in service.watchdogs():
            signal_pid(pid, signal.SIGCONT)


async def _run(*argv: str) -> None:
    done = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _fill(path: Path) -> None:
    block = b"\0" * 2**20
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError:
                try:
                    os.write(fd, block[:4096])
                except OSError:
                    return
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _scope(plan: Plan) -> AsyncIterator[Scope]:
    # Short on purpose: sockets live under it (108 bytes at most).
    state = Path(tempfile.mkdtemp(prefix="smc-", dir="/tmp"))
    tmpfs = plan.fault == "state-full"
    if tmpfs:
        await _run("mount", "-t", "tmpfs", "-o", "size=320m,mode=0700", "tmpfs", str(state))
    token = uuid.uuid4().hex[:8]
    scope = Scope(state, f"/sandman-chaos/{token}", f"chaos-{token}")
    try:
        yield scope
    finally:
        if tmpfs:
            await _run("umount", "-l", str(state))
        shutil.rmtree(state, ignore_errors=True)


async def run_iteration(plan: Plan, busybox_tar: Path, work: Path) -> Outcome:
    """Run one iteration of ``plan``; its logs stay under ``work`` if it fails."""
    started = time.monotonic()
    logs = work / f"s{plan.seed}-i{plan.iteration}-{plan.scenario}-{plan.fault}"
    logs.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(plan, logs=logs)
    async with _scope(plan) as scope:
        run = Iteration(plan, scope, logs)
        provider = LocalProvider(
            LocalConfig(state_dir=scope.state_dir, cgroup_parent=scope.cgroup_parent)
        )
        await provider.images.import_archive(busybox_tar, name="busybox")
        baseline = await asyncio.to_thread(inventory.take, scope, run.tracker)
        unexpected = [str(i) for i in baseline if i.name != f"{scope.state_dir} (tmpfs)"]
        if unexpected:
            outcome.notes.append(f"not clean at the start: {unexpected}")
        sampler = asyncio.ensure_future(run.sample())
        try:
            await _play(run, outcome)
        finally:
            with contextlib.suppress(Exception):
                await run.close()
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            outcome.leaked = await asyncio.to_thread(
                inventory.settle, scope, run.tracker, baseline=baseline, timeout=SETTLE
            )
            run.untyped(outcome)
            outcome.notes += run.notes
            left = await asyncio.to_thread(inventory.scrub, scope, run.tracker, baseline)
            if left:
                outcome.notes.append(f"scrub could not remove: {[str(i) for i in left]}")
    outcome.seconds = time.monotonic() - started
    if not outcome.failed:
        shutil.rmtree(logs, ignore_errors=True)
        outcome.logs = None
    return outcome


async def _play(run: Iteration, outcome: Outcome) -> None:
    plan = run.plan
    if plan.scenario == "service":
        run.service = ServiceProcess(
            state_dir=run.scope.state_dir, cgroup_parent=run.scope.cgroup_parent,
            pool=f"{run.scope.pool_prefix}-svc", api_key=run.api_key, lease=LEASE,
            log_dir=run.logs,
        )  # fmt: skip
        await run.start_service(on_shutdown=str(plan.params["on_shutdown"]))
    await asyncio.gather(
        run.start_worker("a", plan.worker_seeds[0]), run.start_worker("b", plan.worker_seeds[1])
    )
    fault = asyncio.ensure_future(run.inject())
    try:
        async with asyncio.timeout(180):
            await fault
    except TimeoutError:
        outcome.notes.append("the fault did not finish within 180 s")
    except Exception as exc:  # noqa: BLE001 - the harness's own failure, reported
        outcome.notes.append(f"injecting the fault failed: {exc!r}")
    for worker in run.live():
        if await worker.wait_for("holding", 120) is None and worker.alive:
            outcome.notes.append(f"{worker.name} did not finish its burst")
    await asyncio.sleep(LEASE + RECONCILE + 1.5)
    await run.check(outcome)
