"""One pool holding many sandboxes on Kubernetes: what holding them costs.

All pods go to KWOK nodes of a real API server (``readiness="pod"``, as in
``k8s_burst.py``); with ``--admin-kubeconfig`` KWOK nodes are added for the
run (250 pods each) and removed afterwards.

``--via pool`` (default): ``--clients`` sessions of one `Pool` in this
process. ``--via service``: a ``sandman serve --provider kubernetes`` started
for the run, and ``--service-clients`` remote clients in this process, each
heartbeating its session and acquiring as the SDK does (a 30 s long poll, then
by ticket; ``--open-requests``: each acquire's request held open until
answered, as before tickets). ``--via both`` runs one, then the other.

Phases: acquire ``--sandboxes`` at once (the pool paces them); hold them for
``--hold`` seconds and measure; release them all (the clients close); count
what is left by a consistent list. Printed per run:

- ``acquired``: time until all were held, failures, 429s;
- ``memory``: the pool's process RSS growth per 1,000 held (this process
  for ``pool``, the service's for ``service``), against a warm baseline: by
  slope (half to all held) and overall; and its peak RSS (VmHWM) over the run,
  overall (``peak_mib_per_1k``: the issue's measure), with the reconcile
  passes' own peak;
- ``cpu``: the pool process's CPU per sandbox acquired, and per second
  of holding (the idle cost of the count held);
- ``reconcile``: one reconcile pass (``pool``: `Pool.reconcile`;
  ``service``: the provider's list by pool label, what a pass costs the
  API server); ``watch_lag``: from a label PATCH on a held pod to the
  pool's watch delivering it (``pool`` only), median and max of 20;
- ``service`` only: ``/v1/dashboard`` and ``/metrics`` answer time and size;
- ``released``: time until all were gone, and ``leftover``.

Last line: ``held=<n>/<N> t_all=<s> failures=<n> mib_per_1k=<x> peak_mib_per_1k=<x>
leftover=<n>``
(for ``--via both``, the worst of the two).

    KUBECONFIG=/var/lib/sandman-kube/sandman.kubeconfig \\
        .venv/bin/python benchmarks/k8s_scale.py --sandboxes 5000 --via both \\
        --admin-kubeconfig /var/lib/sandman-kube/admin.kubeconfig

At 50,000 (``--via pool``) the harness needed no flag beyond its own (etcd's
``--quota-backend-bytes`` is 8 GiB there; ``--max-requests-inflight`` stayed at
its default, with no 429): the API server grew to about 5 GiB RSS, etcd to
about 1.8 GiB, and KWOK's 191 added nodes kept up at about 23 pods/s. Through the
service (``--via service``, 64 clients of at most 250 acquires in flight each) the
same 50,000 were held in 2,447 s with no failure and released in 365 s, none left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _service import free_port, stop, wait_healthy
from k8s_burst import (
    KWOK,
    RUN_LABEL,
    count_left,
    delete_all,
    kwok_capacity,
    log,
)

from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes import pods as pod_specs
from sandman.settings import KubernetesConfig

SPEC = SandboxSpec(image="sandman.local/busybox:1.35", cpu=0.1, memory="64Mi", kubernetes=KWOK)
PROBE_LABEL = "bench-probe"
POLL = 30.0  # an acquire's long poll, as the SDK's (`sandman.client.remote`)
TENANT = "scale"


@dataclass
class Run:
    """What one run measured."""

    via: str
    requested: int
    held: int = 0
    failures: int = 0
    throttled: int = 0
    t_all: float = 0.0
    t_release: float = 0.0
    leftover: int = 0
    mib_per_1k: float = 0.0
    rss_before: float = 0.0
    peak_per_1k: float = 0.0
    """The process's peak RSS over the run (acquiring, holding, reconciling) above its
    warm baseline, per 1,000 held: counted overall, as ``overall`` is, not by slope."""
    errors: dict[str, int] = field(default_factory=dict)

    def fail(self, exc: BaseException) -> None:
        self.failures += 1
        kind = type(exc).__name__
        if kind not in self.errors or self.errors[kind] < 5:
            cause = f" (from {exc.__cause__!r})" if exc.__cause__ else ""
            log(f"  {self.via}: {time.strftime('%H:%M:%S')} {kind}: {exc}{cause}")
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def say(self, line: str) -> None:
        print(f"{self.via}: {line}", flush=True)


# -- a process's resources ---------------------------------------------------------


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def peak_mib(pid: int | str = "self") -> float:
    """The process's peak RSS (VmHWM) since it started or since `reset_peak`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def reset_peak(pid: int | str = "self") -> None:
    """Start the process's peak RSS again from its RSS now (Linux 4.0+)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int | str = "self") -> float:
    """RSS after a collection (in this process; another's is read as it is)."""
    if pid == "self":
        gc.collect()
    return rss_mib(pid)


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.monotonic()
    result = await call()
    return time.monotonic() - started, result


def config_for(kubeconfig: Path, run: str) -> KubernetesConfig:
    return KubernetesConfig(
        kubeconfig=kubeconfig,
        readiness="pod",
        annotations=pod_specs.KWOK_NO_DELAY,
        labels={RUN_LABEL: run},
    )


# -- acquiring from many sessions --------------------------------------------------


async def measure_acquire(
    run: Run,
    acquire: Callable[[int], Awaitable[object]],
    count: int,
    *,
    rss: Callable[[], float],
    cpu: Callable[[], float],
    peak: Callable[[], float],
    hold: float,
    what: str,
) -> list[object]:
    """Acquire ``count`` at once, then hold them ``hold`` seconds; prints what it cost.

    Memory per 1,000 held is the RSS slope between half and all held, so what is
    set up once (connections, buffers, the pacer) does not count as per sandbox; and
    the peak RSS so far per 1,000 held, counted overall (the goal's measure).
    """
    held: list[object] = []
    half_rss: list[float] = []
    cpu_before, rss_before = cpu(), rss()
    run.rss_before = rss_before
    started = time.monotonic()

    async def one(i: int) -> None:
        try:
            held.append(await acquire(i))
        except errors.SandboxError as exc:
            run.fail(exc)
        if len(held) == max(1, count // 2) and not half_rss:
            half_rss.append(rss())

    async def progress() -> None:
        while True:
            await asyncio.sleep(15)
            log(f"  {run.via}: {len(held)}/{count} held, {run.failures} failed")

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        reporter.cancel()
    run.t_all = time.monotonic() - started
    run.held = len(held)
    cpu_acquire = cpu() - cpu_before
    full_rss = rss()
    grown = run.held - max(1, count // 2)
    run.mib_per_1k = (full_rss - half_rss[0]) / grown * 1000 if half_rss and grown > 0 else 0.0
    run.say(
        f"acquired {run.held}/{count} in {run.t_all:.1f}s ({run.held / run.t_all:.1f}/s) "
        f"failures={run.failures} 429s={run.throttled}"
        + (f" errors={run.errors}" if run.errors else "")
    )
    run.say(
        f"memory rss {rss_before:.0f} MiB before, {half_rss[0] if half_rss else 0:.0f} MiB at "
        f"half, {full_rss:.0f} MiB at all: {run.mib_per_1k:.2f} MiB per 1,000 held "
        f"(the slope), {(full_rss - rss_before) / max(1, run.held) * 1000:.2f} overall"
    )
    top = peak()
    run.peak_per_1k = (top - rss_before) / max(1, run.held) * 1000
    run.say(
        f"peak rss {top:.0f} MiB so far: {run.peak_per_1k:.2f} MiB per 1,000 held overall "
        f"({top / max(1, run.held) * 1000:.2f} counting the baseline)"
    )
    idle = cpu()
    await asyncio.sleep(hold)
    idle = cpu() - idle
    run.say(
        f"cpu {cpu_acquire / max(1, run.held) * 1000:.2f} ms per acquire; holding "
        f"{idle / max(hold, 1e-9) * 1000:.1f} ms/s for {run.held} held ({what})"
    )
    return held


async def watch_lag(provider: KubernetesProvider, names: list[str]) -> list[float]:
    """Seconds from a label PATCH on each pod to the provider's watch delivering it."""
    seen: dict[str, asyncio.Future[float]] = {}
    loop = asyncio.get_running_loop()
    others = provider.watch.others

    def on_pod(kind: str, pod: dict[str, Any]) -> None:
        value = (pod.get("metadata") or {}).get("labels", {}).get(PROBE_LABEL)
        waiter = seen.get(value or "")
        if waiter is not None and not waiter.done():
            waiter.set_result(time.monotonic())
        if others is not None:
            others(kind, pod)

    provider.watch.others = on_pod
    lags = []
    try:
        for i, name in enumerate(names):
            value = f"p{i}-{secrets.token_hex(3)}"
            seen[value] = loop.create_future()
            sent = time.monotonic()
            await provider.api.patch_pod_labels(name, {PROBE_LABEL: value})
            async with asyncio.timeout(60):
                lags.append(await seen[value] - sent)
    finally:
        provider.watch.others = others
    return lags


# -- through an embedded pool ------------------------------------------------------


async def via_pool(kubeconfig: Path, count: int, clients: int, hold: float) -> Run:
    run = Run("pool", count)
    name = f"scale-{secrets.token_hex(3)}"
    provider = KubernetesProvider(config_for(kubeconfig, name))

    def on_event(event: PoolEvent) -> None:
        if event.name == "create.failed" and event.detail.get("kind") == "throttled":
            run.throttled += 1

    pool = Pool(provider, PoolConfig(name=name, lease=30.0), hook=on_event)
    try:
        await pool.start()
        sessions = [pool.open_session(lease=7200) for _ in range(clients)]
        # Warm: the first acquire sets up connections, the watch and the pacer.
        warm = await pool.acquire(SPEC, session=sessions[0])
        pool.release(warm.id)
        leases = await measure_acquire(
            run,
            lambda i: pool.acquire(SPEC, session=sessions[i % clients]),
            count,
            rss=settle,
            cpu=cpu_seconds,
            peak=peak_mib,
            hold=hold,
            what=f"{clients} sessions",
        )
        before = peak_mib()
        reset_peak()
        cpu_before = cpu_seconds()
        passes = [(await timed(pool.reconcile))[0] for _ in range(3)]
        cpu_pass = (cpu_seconds() - cpu_before) / 3
        top = peak_mib()
        highest = max(before, top)
        run.peak_per_1k = (highest - run.rss_before) / max(1, run.held) * 1000
        stats = [(await timed(lambda: asyncio.sleep(0, pool.stats())))[0] for _ in range(3)]
        run.say(
            f"reconcile pass {statistics.median(passes):.2f}s (median of 3), cpu "
            f"{cpu_pass:.2f}s each, peak rss {top:.0f} MiB during them; stats() "
            f"{statistics.median(stats) * 1000:.1f} ms"
        )
        run.say(
            f"peak rss {highest:.0f} MiB over the run: {run.peak_per_1k:.2f} MiB per 1,000 "
            f"held overall ({highest / max(1, run.held) * 1000:.2f} counting the baseline)"
        )
        names = [record.id for record in leases[:20]]  # type: ignore[attr-defined]
        if names:
            lags = await watch_lag(provider, names)
            run.say(
                f"watch_lag median {statistics.median(lags) * 1000:.0f} ms "
                f"max {max(lags) * 1000:.0f} ms (PATCH to event, {len(lags)} pods)"
            )
        started = time.monotonic()
        for session in sessions:
            pool.close_session(session)  # its sandboxes are deleted in the background
        async with asyncio.timeout(1800):
            while pool.list():  # noqa: ASYNC110 - the pool has no "empty" event to wait on
                await asyncio.sleep(0.5)
        run.t_release = time.monotonic() - started
    finally:
        await pool.aclose(timeout=1800)
        run.leftover = await count_left(provider.api, name)
        run.say(f"released in {run.t_release:.1f}s leftover={run.leftover}")
        await delete_all(provider.api, name)
        await provider.aclose()
    return run


# -- through the service -----------------------------------------------------------


@contextlib.asynccontextmanager
async def service(kubeconfig: Path, run: str) -> AsyncIterator[tuple[str, str, int]]:
    """``sandman serve --provider kubernetes`` for the run: (url, key, pid)."""
    key = secrets.token_urlsafe(24)
    port = free_port()
    settings = config_for(kubeconfig, run).model_dump(mode="json", exclude_defaults=True)
    env = {
        **os.environ,
        "SANDMAN_KUBERNETES": json.dumps(settings),
        "SANDMAN_API_KEYS": f"{TENANT}:{key}",
        # The spec puts its pods on KWOK nodes: placement is the operator's to grant.
        "SANDMAN_DEFAULT_LIMITS": json.dumps({"pod_placement": True}),
        # A burst of thousands outlasts the default cap on one acquire's wait (600 s).
        "SANDMAN_MAX_ACQUIRE_TIMEOUT": "7200",
    }
    log_file = Path(tempfile.mkdtemp(prefix="k8s-scale-")) / "serve.log"
    with log_file.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from sandman.cli import main; main()", "serve",
            "--provider", "kubernetes", "--port", str(port), "--pool-name", run,
            "--lease", "60", "--log-level", "warning",
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, process, log_file, 60)
        yield url, key, process.pid
    except BaseException:
        log(f"  the service's log ends with:\n{log_file.read_text()[-3000:]}")
        raise
    finally:
        await stop(process, 1800)  # it releases everything it holds
        shutil.rmtree(log_file.parent, ignore_errors=True)


class ServiceClient:
    """One client of the service as a trainer's worker is: a session heartbeated every
    5 s on a connection of its own, acquires over HTTP on at most ``connections`` at
    once (the rest wait their turn here: httpcore's pool looks through every waiting
    request for each connection it frees, which at 780 waiting per client took a core
    and sent nothing). Raw HTTP: sandboxes on KWOK nodes have no daemon, which the
    SDK's acquire requires."""

    def __init__(self, url: str, key: str, connections: int, *, poll: bool = True) -> None:
        # An idle connection is dropped before uvicorn's 5 s keep-alive ends it under a
        # reused request.
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=connections, keepalive_expiry=2.0)
        self.http = httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120)
        # Never behind a full pool of acquires: a session not heartbeated for its lease
        # (60 s) is closed, and its sandboxes with it.
        self.control = httpx.AsyncClient(
            base_url=url, headers=headers, limits=httpx.Limits(max_connections=2), timeout=30
        )
        self._turns = asyncio.Semaphore(connections)
        self._poll = poll
        self.session = ""
        self._beats: asyncio.Task[None] | None = None

    async def open(self) -> None:
        response = await self.control.post("/v1/sessions", json={"lease_seconds": 60})
        response.raise_for_status()
        self.session = response.json()["id"]
        self._beats = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(5)
            with contextlib.suppress(httpx.HTTPError):
                await self.control.post(f"/v1/sessions/{self.session}/heartbeat")

    async def acquire(self) -> str:
        """As the SDK acquires: a long poll (``wait``), then asking again with the ticket
        after the ``retry_after`` the service says; no request held open meanwhile."""
        body: dict[str, Any] = {"spec": SPEC.model_dump(mode="json"), "session": self.session,
                                "timeout": 7200}  # fmt: skip
        if self._poll:
            body["wait"] = POLL
        while True:
            try:
                async with self._turns:
                    response = await self.http.post("/v1/sandboxes", json=body, timeout=7300)
            except httpx.HTTPError as exc:
                raise errors.ProviderError(f"acquire: {exc!r}") from exc
            if response.status_code != 202:
                break
            pending = response.json()
            body["ticket"] = pending["ticket"]
            await asyncio.sleep(pending["retry_after"])
        if response.status_code != 201:
            raise errors.ProviderError(f"acquire: {response.status_code} {response.text[:200]}")
        return str(response.json()["id"])

    async def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
        if self.session:
            await self.control.delete(f"/v1/sessions/{self.session}")
            self.session = ""
        await self.http.aclose()
        await self.control.aclose()


def connections_each(count: int, clients: int) -> int:
    """Acquire connections per client: one per acquire, within the open-files limit.
    50,000 at once would need 50,000 sockets here and in the service (and as many of
    loopback's 28,000 ephemeral ports); the rest of a client's acquires wait their
    turn, which keeps thousands waiting in the service, more than its pacer needs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = max(clients, soft - 4000, soft // 2)  # the service's and the provider's own
    return max(1, min(-(-count // clients), budget // clients))


async def any_left(provider: KubernetesProvider, run: str) -> bool:
    """Whether a pod of the run is left: one page of one, not a list of 50,000 every
    second while they are being deleted (that slowed the deletes down)."""
    pages = provider.api.pod_pages(f"{RUN_LABEL}={run}", page=1)
    async with contextlib.aclosing(pages):
        async for chunk, _ in pages:
            return bool(chunk)
    return False


async def via_service(
    kubeconfig: Path, count: int, clients: int, hold: float, *, poll: bool = True
) -> Run:
    run = Run("service", count)
    name = f"scale-{secrets.token_hex(3)}"
    provider = KubernetesProvider(config_for(kubeconfig, name))  # to list and count
    try:
        async with service(kubeconfig, name) as (url, key, pid):
            each = connections_each(count, clients)
            log(f"  service: {clients} clients, at most {each} acquires in flight each")
            sessions = [ServiceClient(url, key, each, poll=poll) for _ in range(clients)]
            try:
                await asyncio.gather(*(client.open() for client in sessions))
                await sessions[0].acquire()  # warm; released with its session
                await measure_acquire(
                    run,
                    lambda i: sessions[i % clients].acquire(),
                    count,
                    rss=lambda: rss_mib(pid),
                    cpu=lambda: cpu_seconds(pid),
                    peak=lambda: peak_mib(pid),
                    hold=hold,
                    what=f"{clients} sessions heartbeating",
                )
                labels = {"sandman.io/pool": name}
                # As the service's provider lists: with its watch running (names only).
                await provider.watch.ensure_started()
                passes = [(await timed(lambda: provider.list(labels=labels)))[0] for _ in range(3)]
                run.say(f"reconcile list {statistics.median(passes):.2f}s (median of 3)")
                http = sessions[0].http
                for path in ("/v1/dashboard", "/metrics"):
                    took, response = await timed(lambda p=path: http.get(p))  # type: ignore[misc]
                    response.raise_for_status()
                    run.say(f"GET {path} {took * 1000:.0f} ms, {len(response.content)} bytes")
                started = time.monotonic()
                await asyncio.gather(*(client.close() for client in sessions))
                async with asyncio.timeout(1800):
                    while await any_left(provider, name):  # noqa: ASYNC110 - the API's list
                        await asyncio.sleep(1)
                run.t_release = time.monotonic() - started
            finally:
                await asyncio.gather(
                    *(client.close() for client in sessions), return_exceptions=True
                )
        run.leftover = await count_left(provider.api, name)
        run.say(f"released in {run.t_release:.1f}s leftover={run.leftover}")
    finally:
        await delete_all(provider.api, name)
        await provider.aclose()
    return run


async def benchmark(args: argparse.Namespace) -> str:
    admin: Path | None = args.admin_kubeconfig
    runs: list[Run] = []
    async with kwok_capacity(admin, args.sandboxes + 1):
        if args.via in ("pool", "both"):
            log(f"pool: {args.sandboxes} sandboxes from {args.clients} sessions")
            runs.append(await via_pool(args.kubeconfig, args.sandboxes, args.clients, args.hold))
        if args.via in ("service", "both"):
            log(f"service: {args.sandboxes} sandboxes from {args.service_clients} clients")
            poll = not args.open_requests
            service_run = via_service(
                args.kubeconfig, args.sandboxes, args.service_clients, args.hold, poll=poll
            )
            runs.append(await service_run)
    worst = min(runs, key=lambda r: (r.held, -r.failures, -r.leftover))
    return (
        f"held={worst.held}/{args.sandboxes} t_all={max(r.t_all for r in runs):.1f} "
        f"failures={sum(r.failures for r in runs)} "
        f"mib_per_1k={max(r.mib_per_1k for r in runs):.2f} "
        f"peak_mib_per_1k={max(r.peak_per_1k for r in runs):.2f} "
        f"leftover={sum(r.leftover for r in runs)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--via", choices=("pool", "service", "both"), default="pool")
    parser.add_argument("--clients", type=int, default=8, help="pool sessions (--via pool)")
    parser.add_argument("--service-clients", type=int, default=64,
                        help="remote clients, each a heartbeating session (--via service)")  # fmt: skip
    parser.add_argument("--hold", type=float, default=30.0,
                        help="seconds to hold them all while measuring the idle cost")  # fmt: skip
    parser.add_argument("--open-requests", action="store_true",
                        help="each acquire holds its request open until answered (no wait "
                        "and ticket: the protocol before them)")  # fmt: skip
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--admin-kubeconfig", type=Path,
                        help="adds KWOK nodes when the sandboxes do not fit (and removes them)")  # fmt: skip
    args = parser.parse_args()
    if args.sandboxes < 1 or args.clients < 1 or args.service_clients < 1 or args.hold < 0:
        parser.error("--sandboxes, --clients and --service-clients must be >= 1, --hold >= 0")
    if args.kubeconfig is None:
        parser.error("needs a cluster: --kubeconfig or KUBECONFIG (hack/kube/up starts one)")
    signal.signal(signal.SIGTERM, interrupted)  # the clean-up runs then too
    try:
        print(asyncio.run(benchmark(args)))
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc or 'SIGINT'}): cleaned up")
        return 130
    return 0


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
