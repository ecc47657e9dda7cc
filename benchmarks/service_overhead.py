"""Per-request overhead of the service against the embedded pool: same machine, same run.

Two pools on the local provider (tiny busybox image), each keeping warm spares
so that an acquire costs only the hand-over, not a container start:

- embedded: a `Pool` in this process, reached through `AsyncClient`;
- service: the same kind of pool behind the HTTP service in a process of its
  own (uvicorn on 127.0.0.1), reached through ``sandman.connect``.

It times, interleaved so that both see the same machine:

- an acquire + release round trip (embedded vs service). Before each one
  both pools are settled: spares refilled, and nothing being created or
  deleted. Without that, the embedded pool's deletion of the sandbox it just
  released (crun delete, cgroup and overlay cleanup) runs on this process's
  event loop during the service's round trip: measured +0.5-1.5 ms on the
  median on a quiet machine, +24 ms (31 vs 7 ms) with the load at 6 on 2 cores;
- a no-op exec (``true``) in one sandbox: straight to its daemon's unix socket
  vs through the service's proxy route (``/v1/sandboxes/{id}/daemon/``).

Last line: ``acquire_release_embedded_ms=.. acquire_release_service_ms=..
exec_direct_ms=.. exec_proxy_ms=.. overhead_ms=.. proxy_overhead_ms=..`` (medians;
``overhead_ms`` is the service's acquire + release minus the embedded one).

Run as root: ``.venv/bin/python benchmarks/service_overhead.py [-n 50] [--exec-n 300]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from _common import progress, quantile, timed
from _service import free_port, stop, wait_healthy

import sandman
from sandman.client import AsyncClient, InProcessBackend
from sandman.client.remote import RemoteBackend
from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

TENANT = "bench"
SPEC = {"image": "busybox", "memory": "64Mi", "pids": 64}
WARM = 3
# States of a sandbox being made or removed: background work of the pool.
_BUSY = ("queued", "creating", "starting", "releasing", "failed")


def _line(name: str, samples: list[float]) -> str:
    return (
        f"{name:<26} median_ms={statistics.median(samples) * 1e3:.2f} "
        f"p90_ms={quantile(samples, 0.9) * 1e3:.2f} n={len(samples)}"
    )


async def _until(condition: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the warm spares were not refilled in time")
        await asyncio.sleep(0.02)


# -- the service's process -------------------------------------------------------------


async def serve_child(port: int, config_json: str, key: str, pool_name: str) -> None:
    """The service with warm spares of the benchmark's spec (for the tenant's label)."""
    import uvicorn

    from sandman.server import LABEL_TENANT, ApiKey, ServerSettings, create_app

    provider = LocalProvider(LocalConfig.model_validate_json(config_json))
    pool = Pool(provider, PoolConfig(name=pool_name))
    app = create_app(pool, ServerSettings(api_keys=[ApiKey(tenant=TENANT, key=key)]))
    await pool.start()
    # The service labels every spec with its tenant: the spares must carry it too.
    spec = SandboxSpec.model_validate(SPEC)  # labelled as the service labels a tenant's spec
    pool.warm(spec.model_copy(update={"labels": {LABEL_TENANT: TENANT}}), WARM)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none")
    await uvicorn.Server(config).serve()


@contextlib.asynccontextmanager
async def service_process(config: LocalConfig) -> AsyncIterator[tuple[str, str, str]]:
    """Start the service's process; yield (url, api key, pool name) once healthy."""
    port = free_port()
    key = secrets.token_urlsafe(24)
    pool_name = f"overhead-svc-{uuid.uuid4().hex[:6]}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-child", str(port), config.model_dump_json(), key,
        pool_name,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, process, None, 60)
        yield url, key, pool_name
    finally:
        await stop(process)


async def _service_states(http: httpx.AsyncClient, pool_name: str) -> dict[str, int]:
    """The service pool's sandboxes per state (from its metrics)."""
    states: dict[str, int] = {}
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith("sandman_sandboxes{") and f'pool="{pool_name}"' in line:
            state = line.split('state="', 1)[1].split('"', 1)[0]
            states[state] = int(float(line.rsplit(" ", 1)[1]))
    return states


def _settled(states: dict[str, float]) -> bool:
    """Spares refilled and no creation or deletion running."""
    return states.get("ready", 0) >= WARM and not any(states.get(s, 0) for s in _BUSY)


# -- the measurement ---------------------------------------------------------------------


async def measure(config: LocalConfig, n: int, exec_n: int) -> str:
    provider = LocalProvider(config)
    embedded_pool = Pool(provider, PoolConfig(name=f"overhead-emb-{uuid.uuid4().hex[:6]}"))
    await embedded_pool.start()
    embedded_pool.warm(SandboxSpec.model_validate(SPEC), WARM)
    lines: list[str] = []
    async with (
        service_process(config) as (url, key, pool_name),
        AsyncClient(InProcessBackend(embedded_pool, own_pool=False)) as embedded,
        sandman.connect(url, api_key=key) as service,
        httpx.AsyncClient(base_url=url) as http,
    ):

        async def settled() -> bool:
            if not _settled(embedded_pool.stats()):
                return False
            return _settled(dict(await _service_states(http, pool_name)))

        parts: dict[str, list[float]] = {"acquire": [], "release": []}

        async def round_trip(client: AsyncClient) -> None:
            started = time.perf_counter()
            sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=120)
            acquired = time.perf_counter()
            await sb.release()
            if client is service:
                parts["acquire"].append(acquired - started)
                parts["release"].append(time.perf_counter() - acquired)

        # Warm-up: a session each, and one round each (connections, imports).
        await _until(settled, 120)
        await round_trip(embedded)
        await round_trip(service)
        parts = {"acquire": [], "release": []}
        embedded_times: list[float] = []
        service_times: list[float] = []
        for i in range(n):
            order = [(embedded, embedded_times), (service, service_times)]
            for client, times in order if i % 2 else reversed(order):
                await _until(settled, 120)
                times.append(await timed(lambda c=client: round_trip(c)))  # type: ignore[misc]
            progress(i + 1, n + exec_n)

        # A no-op exec in one sandbox: to its socket, and through the proxy route.
        sb = await service.acquire("busybox", memory="64Mi", pids=64, timeout=120)
        backend = RemoteBackend(url, api_key=key)
        direct = sb._lease.endpoint.client()
        proxied = backend.proxied(sb.id).client()
        try:
            for daemon in (direct, proxied):
                for _ in range(20):
                    await daemon.exec(["true"])
            direct_times: list[float] = []
            proxy_times: list[float] = []
            for i in range(exec_n):
                pairs = [(direct, direct_times), (proxied, proxy_times)]
                for daemon, times in pairs if i % 2 else reversed(pairs):
                    times.append(await timed(lambda d=daemon: d.exec(["true"])))  # type: ignore[misc]
                progress(n + i + 1, n + exec_n)
        finally:
            await direct.aclose()
            await proxied.aclose()
            await backend.aclose()
            await sb.release()
    await embedded_pool.aclose()
    await provider.aclose()

    lines += [
        _line("acquire_release_embedded", embedded_times),
        _line("acquire_release_service", service_times),
        _line("  of which acquire", parts["acquire"]),
        _line("  of which release", parts["release"]),
        _line("exec_direct", direct_times),
        _line("exec_proxy", proxy_times),
    ]
    med = {k: statistics.median(v) * 1e3 for k, v in (
        ("ae", embedded_times), ("as", service_times), ("ed", direct_times), ("ep", proxy_times),
    )}  # fmt: skip
    lines.append(
        f"acquire_release_embedded_ms={med['ae']:.2f} acquire_release_service_ms={med['as']:.2f} "
        f"exec_direct_ms={med['ed']:.2f} exec_proxy_ms={med['ep']:.2f} "
        f"overhead_ms={med['as'] - med['ae']:.2f} proxy_overhead_ms={med['ep'] - med['ed']:.2f}"
    )
    return "\n".join(lines)


async def run(n: int, exec_n: int) -> str:
    state = Path(tempfile.mkdtemp(prefix="smo-", dir="/tmp"))
    config = LocalConfig(state_dir=state, cgroup_parent=f"/sandman-bench/{uuid.uuid4().hex[:8]}")
    provider = LocalProvider(config)
    try:
        tar = busybox_rootfs_tar(state / "busybox.tar")
        await provider.images.import_archive(tar, name="busybox")
        result = await measure(config, n, exec_n)
        leftover = len(await provider.list())
        return f"{result}\nleftover={leftover}" if leftover else result
    finally:
        for info in await provider.list():
            await provider.delete(info.id)
        await provider.aclose()
        remove_cgroup_parent(config.cgroup_parent)
        shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--serve-child":
        _, _, port, config_json, key, pool_name = sys.argv
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_child(int(port), config_json, key, pool_name))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=50, help="acquire + release rounds per side")
    parser.add_argument("--exec-n", type=int, default=300, help="no-op execs per side")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("the local provider needs root")
    print(asyncio.run(run(args.n, args.exec_n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
