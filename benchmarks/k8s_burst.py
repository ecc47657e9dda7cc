"""A burst of sandboxes on Kubernetes: paced by the pool, then unpaced, beside the API
server's sustainable create rate.

All pods go to KWOK nodes (simulated: no containers run), so the provider
runs in its benchmark-only ``readiness="pod"`` mode: a sandbox counts as
ready when its pod's Ready condition is True. Every create goes through
the ordinary, non-exempt identity, so API Priority and Fairness throttles
it as on a shared cluster.

Three phases, one after the other, each cleaned up before the next:

1. sustainable: a fixed number of workers (``--workers``) each create a
   sandbox, wait until it is ready, and go on; 429s are waited out. The rate
   is sandboxes ready per second: what the cluster sustains, all the writes a
   pod causes (scheduler, node status) included.
2. paced: ``--clients`` sessions of one `Pool` ask for ``--requests``
   sandboxes at once; the pool paces creation. Then the pool closes (it
   deletes everything) and the leftovers are counted by label.
3. unpaced: the same burst with every create sent at once, each retried at
   once on a retryable error up to the pool's retry limit (a naive client).

Printed for both bursts: t50, t100 (seconds from the start until half / all
are ready), failures, 429s seen, leftovers. Last line:
``paced_t100=<s> unpaced_t100=<s> paced_failures=<n> leftover=<n>``.

With ``KUBECONFIG`` set (or ``--kubeconfig``), it uses that cluster; with
``--admin-kubeconfig`` it adds KWOK nodes for the burst when there are too few
(250 pods each) and removes them afterwards. Without, it starts the
hack/kube harness itself (control plane and KWOK nodes only) and stops it.

``--client-cpu N`` instead measures the client CPU per pod create of this
provider's raw httpx client against ``kubernetes_asyncio`` (if installed).

    KUBECONFIG=/var/lib/sandman-kube/sandman.kubeconfig \\
        .venv/bin/python benchmarks/k8s_burst.py --requests 10000 --clients 8 \\
        --admin-kubeconfig /var/lib/sandman-kube/admin.kubeconfig
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandman import errors
from sandman.models import KubernetesOptions, SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes import pods as pod_specs
from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.credentials import load_credentials
from sandman.settings import KubernetesConfig

REPO = Path(__file__).resolve().parents[1]
HACK = REPO / "hack" / "kube"
PODS_PER_KWOK_NODE = 250
KWOK = KubernetesOptions(
    cpu_request=0.001,
    memory_request="1Mi",
    node_selector={"type": "kwok"},
    tolerations=[{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
)
SPEC = SandboxSpec(image="sandman.local/busybox:1.35", cpu=0.1, memory="64Mi", kubernetes=KWOK)
# Not under sandman.io/: those labels are reserved for Sandman (pods._check_reserved).
RUN_LABEL = "bench.sandman.io/run"


def log(*words: object) -> None:
    print(*words, file=sys.stderr, flush=True)


@dataclass
class Burst:
    """What one burst measured."""

    name: str
    ready_at: list[float] = field(default_factory=list)
    failures: int = 0
    throttled: int = 0
    leftover: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def t(self, fraction: float, total: int) -> float:
        """Seconds until ``fraction`` of ``total`` were ready (inf if they never were)."""
        need = math.ceil(fraction * total)
        times = sorted(self.ready_at)
        return times[need - 1] if need <= len(times) else math.inf

    def line(self, total: int) -> str:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"{self.name}: t50={self.t(0.5, total):.1f}s t100={self.t(1.0, total):.1f}s "
            f"ready={len(self.ready_at)}/{total} failures={self.failures} "
            f"429s={self.throttled} leftover={self.leftover} (errors: {kinds})"
        )


def config_for(kubeconfig: Path, **fields: Any) -> KubernetesConfig:
    return KubernetesConfig(
        kubeconfig=kubeconfig, readiness="pod", annotations=pod_specs.KWOK_NO_DELAY, **fields
    )


async def count_left(api: KubeAPI, run: str) -> int:
    items, _ = await api.list_pods(f"{RUN_LABEL}={run}")  # consistent: see KubeAPI._pages
    return len(items)


async def delete_all(api: KubeAPI, run: str, workers: int = 32) -> None:
    """Delete every pod of the run, 429s waited out, until the list is empty."""
    while True:
        items, _ = await api.list_pods(f"{RUN_LABEL}={run}")
        names = [p["metadata"]["name"] for p in items]
        if not names:
            return
        log(f"  deleting {len(names)} pods")
        await run_workers(names, workers, api.delete_pod)


async def run_workers(
    names: list[str], workers: int, call: Callable[[str], Awaitable[object]]
) -> int:
    """Call ``call`` for each name with ``workers`` at a time, waiting out 429s; returns 429s."""
    queue = list(reversed(names))
    throttled = 0

    async def worker() -> None:
        nonlocal throttled
        while queue:
            name = queue.pop()
            while True:
                try:
                    await call(name)
                    break
                except errors.ThrottledError as exc:
                    throttled += 1
                    await asyncio.sleep(exc.retry_after or 0.5)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return throttled


# -- phase 1: sustainable create rate -----------------------------------------------


async def sustainable_rate(kubeconfig: Path, count: int, workers: int) -> tuple[float, int]:
    """Sandboxes made ready per second by ``workers`` steady workers (create, wait for
    Ready, next), 429s waited out: everything a create costs the cluster (scheduling,
    the node's status writes) at a load it sustains. Also returns the 429s seen."""
    run = f"rate-{secrets.token_hex(3)}"
    provider = KubernetesProvider(
        config_for(kubeconfig, max_connections=workers, labels={RUN_LABEL: run})
    )
    labels = {"sandman.io/pool": run}
    try:

        async def create(name: str) -> None:
            await provider.create(SPEC, sandbox_id=name, labels=labels)

        names = [f"{run}-{i}" for i in range(count)]
        started = time.monotonic()
        throttled = await run_workers(names, workers, create)
        elapsed = time.monotonic() - started
        return count / elapsed, throttled
    finally:
        await delete_all(provider.api, run)
        await provider.aclose()


# -- phase 2: the paced burst ------------------------------------------------------


async def paced_burst(
    kubeconfig: Path,
    requests: int,
    clients: int,
    lease: float,
    namespace: str | None = None,
    all_ready: Callable[[], Awaitable[object]] | None = None,
) -> Burst:
    """The paced burst; ``all_ready`` is awaited once every request is answered, before
    the pool deletes everything."""
    burst = Burst("paced")
    run = f"paced-{secrets.token_hex(3)}"
    provider = KubernetesProvider(
        config_for(kubeconfig, labels={RUN_LABEL: run}, namespace=namespace)
    )

    def on_event(event: PoolEvent) -> None:
        if event.name == "create.failed" and event.detail.get("kind") == "throttled":
            burst.throttled += 1

    pool = Pool(provider, PoolConfig(name=run, lease=lease), hook=on_event)
    try:
        await pool.start()
        sessions = [pool.open_session(lease=3600) for _ in range(clients)]
        started = time.monotonic()

        async def one(session: str) -> None:
            try:
                await pool.acquire(SPEC, session=session)
                burst.ready_at.append(time.monotonic() - started)
            except errors.SandboxError as exc:
                burst.failures += 1
                if type(exc).__name__ not in burst.errors:
                    log(f"  {burst.name}: first {type(exc).__name__}: {exc}")
                burst.errors[type(exc).__name__] = burst.errors.get(type(exc).__name__, 0) + 1

        progress = asyncio.create_task(report(burst, requests))
        await asyncio.gather(*(one(sessions[i % clients]) for i in range(requests)))
        progress.cancel()
        log(f"  paced: pacer {pool.stats()}")
        if all_ready is not None:
            await all_ready()
    finally:
        # The clients exit: the pool deletes everything it made.
        await pool.aclose(timeout=900)
        burst.leftover = await count_left(provider.api, run)
        await delete_all(provider.api, run)
        await provider.aclose()
    return burst


async def report(burst: Burst, total: int) -> None:
    while True:
        await asyncio.sleep(10)
        log(f"  {burst.name}: {len(burst.ready_at)}/{total} ready, {burst.failures} failed")


# -- phase 3: the unpaced burst ----------------------------------------------------


async def unpaced_burst(kubeconfig: Path, requests: int, connections: int, retries: int) -> Burst:
    burst = Burst("unpaced")
    run = f"unpaced-{secrets.token_hex(3)}"
    provider = KubernetesProvider(
        config_for(kubeconfig, labels={RUN_LABEL: run}, max_connections=connections)
    )
    labels = {"sandman.io/pool": run}
    try:
        started = time.monotonic()

        async def one(i: int) -> None:
            for attempt in range(retries + 1):
                try:
                    await provider.create(SPEC, sandbox_id=f"{run}-{i}-{attempt}", labels=labels)
                    burst.ready_at.append(time.monotonic() - started)
                    return
                except errors.SandboxError as exc:
                    burst.throttled += isinstance(exc, errors.ThrottledError)
                    if not exc.retryable or attempt == retries:
                        burst.failures += 1
                        name = type(exc).__name__
                        burst.errors[name] = burst.errors.get(name, 0) + 1
                        return

        progress = asyncio.create_task(report(burst, requests))
        await asyncio.gather(*(one(i) for i in range(requests)))
        progress.cancel()
    finally:
        await delete_all(provider.api, run)
        burst.leftover = await count_left(provider.api, run)
        await provider.aclose()
    return burst


# -- client CPU per create ---------------------------------------------------------


async def client_cpu(kubeconfig: Path, count: int, workers: int) -> None:
    """Process CPU per pod create: this provider's httpx client vs kubernetes_asyncio."""
    config = config_for(kubeconfig, max_connections=workers)
    api = KubeAPI(load_credentials(config), max_connections=workers)
    run = f"cpu-{secrets.token_hex(3)}"
    labels = {RUN_LABEL: run, "sandman.io/pool": run}

    def body(name: str) -> dict[str, Any]:
        return pod_specs.pod_manifest(name=name, spec=SPEC, labels=labels, token="x", config=config)

    async def measure(label: str, create: Callable[[str], Awaitable[object]]) -> None:
        names = [f"{run}-{label}-{i}" for i in range(count)]
        await create(f"{run}-{label}-warm")  # connection set-up is not per create
        cpu, wall = time.process_time(), time.monotonic()
        throttled = await run_workers(names, workers, create)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        print(
            f"client_cpu {label}: {cpu / count * 1000:.2f} ms CPU per create "
            f"({count} creates, {workers} workers, {count / wall:.0f}/s, {throttled} x 429)"
        )

    try:
        await measure("httpx", lambda name: api.create_pod(body(name)))
        try:
            from kubernetes_asyncio import client as k8s_client  # type: ignore[import-not-found,unused-ignore]  # optional
            from kubernetes_asyncio import config as k8s_config  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            print("client_cpu kubernetes_asyncio: not installed (pip install kubernetes_asyncio)")
            return
        loaded = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=loaded)
        loaded.connection_pool_maxsize = workers
        async with k8s_client.ApiClient(loaded) as client:
            core = k8s_client.CoreV1Api(client)

            async def create(name: str) -> None:
                try:
                    await core.create_namespaced_pod(api.namespace, body(name))  # type: ignore[arg-type,unused-ignore]
                except k8s_client.ApiException as exc:
                    if exc.status == 429:
                        raise errors.ThrottledError(retry_after=1.0) from exc
                    raise

            await measure("kubernetes-asyncio", create)

        import aiohttp  # kubernetes_asyncio's transport: the same requests, raw

        credentials = load_credentials(config)
        connector = aiohttp.TCPConnector(ssl=credentials.ssl_context, limit=workers)
        headers = {"Authorization": f"Bearer {credentials.bearer()}"}
        url = f"{credentials.server}/api/v1/namespaces/{api.namespace}/pods"
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

            async def create_raw(name: str) -> None:
                async with session.post(url, json=body(name)) as response:
                    await response.read()
                    if response.status == 429:
                        raise errors.ThrottledError(retry_after=1.0)
                    response.raise_for_status()

            await measure("aiohttp", create_raw)
    finally:
        await delete_all(api, run)
        await api.aclose()


# -- the cluster -------------------------------------------------------------------


@contextmanager
def harness(kwok_nodes: int) -> Iterator[tuple[Path, Path]]:
    """Start hack/kube (control plane + KWOK only) for the run; yields the kubeconfigs."""
    state = Path(tempfile.mkdtemp(prefix="sandman-k8s-burst-"))
    env = {**os.environ, "SANDMAN_KUBE_DIR": str(state / "kube"), "GOTOOLCHAIN": "local",
           "SANDMAN_KUBE_KWOK_NODES": str(kwok_nodes), "SANDMAN_KUBE_REAL_NODE": "0"}  # fmt: skip
    subprocess.run([HACK / "build"], env=env, check=True)
    try:
        subprocess.run([HACK / "up"], env=env, check=True)
        yield state / "kube" / "sandman.kubeconfig", state / "kube" / "admin.kubeconfig"
    finally:
        subprocess.run([HACK / "down"], env=env, check=False)
        shutil.rmtree(state, ignore_errors=True)


async def ensure_kwok_capacity(admin_kubeconfig: Path, pods: int) -> list[str]:
    """Add KWOK nodes until ``pods`` fit; returns the names added (to remove afterwards)."""
    credentials = load_credentials(KubernetesConfig(kubeconfig=admin_kubeconfig))
    api = KubeAPI(credentials)
    added: list[str] = []
    try:
        nodes_url = f"{credentials.server}/api/v1/nodes"
        params = {"labelSelector": "type=kwok"}
        listed = await api.request("GET", nodes_url, "list nodes", params=params)
        have = sum(int(n["status"].get("allocatable", {}).get("pods", 0)) for n in listed["items"])
        missing = math.ceil(max(0, pods - have) / PODS_PER_KWOK_NODE)
        for _ in range(missing):
            name = f"k8s-burst-{secrets.token_hex(3)}"
            resources = {"cpu": "64", "memory": "256Gi", "pods": str(PODS_PER_KWOK_NODE)}
            node = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake",
                                    "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {"type": "kwok", "kubernetes.io/hostname": name,
                               "kubernetes.io/os": "linux", RUN_LABEL: "node"},
                },
                "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake",
                                     "effect": "NoSchedule"}]},
                "status": {"allocatable": resources, "capacity": resources},
            }  # fmt: skip
            await api.request("POST", nodes_url, f"create node {name}", body=node)
            added.append(name)
        log(f"KWOK capacity: {have} pods, added {len(added)} nodes")
        if added:
            await asyncio.sleep(5)  # KWOK marks new nodes Ready within its heartbeat
        return added
    finally:
        await api.aclose()


async def remove_nodes(admin_kubeconfig: Path, names: list[str]) -> None:
    credentials = load_credentials(KubernetesConfig(kubeconfig=admin_kubeconfig))
    api = KubeAPI(credentials)
    try:
        for name in names:
            url = f"{credentials.server}/api/v1/nodes/{name}"
            await api.request("DELETE", url, f"delete node {name}", missing_ok=True)
    finally:
        await api.aclose()


@contextlib.asynccontextmanager
async def kwok_capacity(admin_kubeconfig: Path | None, pods: int) -> AsyncIterator[None]:
    """KWOK nodes enough for ``pods`` for the length of the block (added as the admin,
    removed after); nothing without an admin kubeconfig."""
    added = await ensure_kwok_capacity(admin_kubeconfig, pods) if admin_kubeconfig else []
    try:
        yield
    finally:
        if admin_kubeconfig and added:
            await remove_nodes(admin_kubeconfig, added)


async def benchmark(args: argparse.Namespace, kubeconfig: Path, admin: Path | None) -> str:
    async with kwok_capacity(admin, args.requests):
        log(f"phase 1: sustainable create rate ({args.rate_pods} pods, {args.workers} workers)")
        rate, rate_429s = await sustainable_rate(kubeconfig, args.rate_pods, args.workers)
        ideal = args.requests / rate
        print(f"sustainable: {rate:.1f} creates/s ({rate_429s} x 429); "
              f"{args.requests} / rate = {ideal:.1f}s")  # fmt: skip
        log(f"phase 2: paced burst of {args.requests} from {args.clients} clients")
        paced = await paced_burst(kubeconfig, args.requests, args.clients, args.lease)
        print(paced.line(args.requests))
        print(f"paced t100 / (requests / sustainable rate) = "
              f"{paced.t(1.0, args.requests) / ideal:.2f}")  # fmt: skip
        if args.skip_unpaced:
            unpaced = Burst("unpaced")
        else:
            log(f"phase 3: unpaced burst of {args.requests}")
            unpaced = await unpaced_burst(
                kubeconfig, args.requests, args.unpaced_connections, PoolConfig.retry_limit
            )
        print(unpaced.line(args.requests))
    return (
        f"paced_t100={paced.t(1.0, args.requests):.1f} "
        f"unpaced_t100={unpaced.t(1.0, args.requests):.1f} "
        f"paced_failures={paced.failures} leftover={paced.leftover + unpaced.leftover}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--admin-kubeconfig", type=Path,
                        help="adds KWOK nodes when the burst does not fit (and removes them)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=32,
                        help="concurrent creates when measuring the sustainable rate")  # fmt: skip
    parser.add_argument("--rate-pods", type=int, default=None,
                        help="pods for the sustainable rate (default: min(requests, 2000))")  # fmt: skip
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--unpaced-connections", type=int, default=1000,
                        help="HTTP connections of the unpaced run (each create is sent at once)")  # fmt: skip
    parser.add_argument("--skip-unpaced", action="store_true")
    parser.add_argument("--client-cpu", type=int, metavar="N",
                        help="only measure client CPU per create over N creates")  # fmt: skip
    args = parser.parse_args()
    args.rate_pods = args.rate_pods or min(args.requests, 2000)
    if args.requests < 1 or args.clients < 1:
        parser.error("--requests and --clients must be >= 1")
    if args.kubeconfig is None:
        nodes = math.ceil(args.requests / PODS_PER_KWOK_NODE) + 1
        with harness(nodes) as (kubeconfig, admin):
            if args.client_cpu:
                asyncio.run(client_cpu(kubeconfig, args.client_cpu, args.workers))
                return 0
            print(asyncio.run(benchmark(args, kubeconfig, admin)))
        return 0
    if args.client_cpu:
        asyncio.run(client_cpu(args.kubeconfig, args.client_cpu, args.workers))
        return 0
    print(asyncio.run(benchmark(args, args.kubeconfig, args.admin_kubeconfig)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
