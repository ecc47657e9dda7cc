"""``POST /run_code`` (SandboxFusion's API) on a throwaway ``sandman serve``, and optionally the
same load on a SandboxFusion server, side by side.

Starts ``sandman serve`` on the local provider (its own state directory, cgroup
parent, pool name and API key; ``fusion-python`` imported from the Debian image the
tests build, ``fusion-polyglot`` too with the ``cpp`` workload), then drives
``--requests`` requests per workload from ``-c`` concurrent clients, each request a
fresh sandbox. Workloads (``--workloads``):

- ``print1``: ``print(1)`` in python (stdout ``1``);
- ``cpp``: a 200-line C++ program compiled and run (its checksum on stdout);
- ``timeout``: a python loop past ``run_timeout`` 1 s (``TimeLimitExceeded``);
- ``oom``: python allocating 512 MiB under ``memory_limit_MB`` 128 (non-zero exit).

A request counts as a failure when its answer is not the verdict expected. One
line per workload and server (``rps``, ``p50_ms``, ``p99_ms``, ``failures``); then
what is left: sandboxes still leased once the load ends, and after the service's
SIGTERM whatever the provider still holds (sandbox dirs, containers, cgroups).

``--fusion-url http://host:port`` drives a SandboxFusion server started apart
(``make run-online`` in its checkout) with the same load; without it the last
line says ``fusion_rps=na``. Last line:
``sandman_rps=<r> fusion_rps=<r> ratio=<x> sandman_p99_ms=<ms> fusion_p99_ms=<ms>
failures=<n> leftover=<n>`` (for the first workload).

Run as root: ``.venv/bin/python benchmarks/run_code.py [-c 8] [--requests 200]
[--warm 16] [--workloads print1,cpp,timeout,oom] [--fusion-url URL]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import leftover as count_leftover
from _common import new_cgroup_parent, quantile
from _service import free_port, stop, wait_healthy

from sandman.images.debootstrap import DEFAULT_CACHE, build_debian_rootfs
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig

TENANT = "bench"
PYTHON_IMAGE = ("python3", "git")  # tests/images/debian.py: the same cached tarball
POLYGLOT_IMAGE = ("python3", "g++", "golang-go", "nodejs", "default-jdk-headless")


def cpp_program(lines: int = 200) -> tuple[str, str]:
    """A C++ program of ``lines`` lines (functions folded into a checksum) and its output."""
    body = ["#include <cstdio>", "#include <cstdint>", "static uint64_t mix(uint64_t x) {",
            "  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; return x;", "}"]  # fmt: skip
    count = (lines - len(body) - 7) // 3
    total = 0
    for i in range(count):
        body += [f"static uint64_t f{i}(uint64_t x) {{", f"  return mix(x + {i}ULL);", "}"]
    body += ["int main() {", "  uint64_t s = 0;"]
    body += ["  uint64_t (*fs[])(uint64_t) = {" + ", ".join(f"f{i}" for i in range(count)) + "};"]
    body += [f"  for (int i = 0; i < {count}; i++) s ^= fs[i](i);",
             '  printf("%llu\\n", (unsigned long long)s);', "  return 0;", "}"]  # fmt: skip
    body += [f"// {i}" for i in range(lines - len(body))]
    mask = 2**64 - 1

    def mix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        return x ^ (x >> 33)

    for i in range(count):
        total ^= mix((i + i) & mask)
    return "\n".join(body) + "\n", f"{total}\n"


@dataclass
class Workload:
    name: str
    body: dict[str, Any]
    ok: Callable[[dict[str, Any]], bool]


def workloads() -> dict[str, Workload]:
    source, expected = cpp_program()
    return {
        "print1": Workload(
            "print1",
            {"language": "python", "code": "print(1)"},
            lambda a: a["status"] == "Success" and a["run_result"]["stdout"] == "1\n",
        ),
        "cpp": Workload(
            "cpp",
            {"language": "cpp", "code": source, "compile_timeout": 30},
            lambda a: a["status"] == "Success" and a["run_result"]["stdout"] == expected,
        ),
        "timeout": Workload(
            "timeout",
            {"language": "python", "code": "while True: pass", "run_timeout": 1},
            lambda a: a["status"] == "Failed" and a["run_result"]["status"] == "TimeLimitExceeded",
        ),
        "oom": Workload(
            "oom",
            {"language": "python", "code": "x = b'x' * (512 * 2**20)", "memory_limit_MB": 128},
            lambda a: a["status"] == "Failed" and a["run_result"]["return_code"] not in (0, None),
        ),
    }


@dataclass
class Outcome:
    rps: float
    p50_ms: float
    p99_ms: float
    failures: int
    said: str


async def drive(
    url: str, auth: tuple[str, str] | None, work: Workload, requests: int, concurrency: int
) -> Outcome:
    """``requests`` requests of ``work`` from ``concurrency`` clients; throughput, latency."""
    latencies: list[float] = []
    failures = 0
    said = ""
    todo = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(auth=auth, timeout=120, limits=limits) as http:

        async def client() -> None:
            nonlocal failures, said
            for _ in todo:
                started = time.perf_counter()
                try:
                    response = await http.post(url, json=work.body)
                    answer = response.json()
                    good = response.status_code == 200 and work.ok(answer)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                    good, answer = False, {"exception": repr(exc)}
                latencies.append(time.perf_counter() - started)
                if not good:
                    failures += 1
                    said = said or json.dumps(answer)[:300]

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Outcome(
        requests / elapsed,
        quantile(latencies, 0.5) * 1000,
        quantile(latencies, 0.99) * 1000,
        failures,
        said,
    )


@dataclass
class Served:
    url: str
    key: str
    provider: LocalProvider
    left: int = 0
    """After the service stopped: what the provider still holds (sandboxes, their dirs,
    containers, cgroups, processes)."""


@contextlib.asynccontextmanager
async def sandman_serve(warm: int, polyglot: bool) -> AsyncIterator[Served]:
    state = Path(tempfile.mkdtemp(prefix="smr-", dir="/tmp"))
    config = LocalConfig(state_dir=state, cgroup_parent=new_cgroup_parent())
    provider = LocalProvider(config)
    key = secrets.token_urlsafe(24)
    port = free_port()
    log = state / "serve.log"
    process: asyncio.subprocess.Process | None = None
    served: Served | None = None
    cache = Path(os.environ.get("SANDMAN_TEST_CACHE", DEFAULT_CACHE))
    try:
        tar = await asyncio.to_thread(build_debian_rootfs, PYTHON_IMAGE, cache_dir=cache)
        await provider.images.import_archive(tar, name="fusion-python")
        if polyglot:
            tar = await asyncio.to_thread(build_debian_rootfs, POLYGLOT_IMAGE, cache_dir=cache)
            await provider.images.import_archive(tar, name="fusion-polyglot")
        env = {
            **os.environ,
            "SANDMAN_STATE_DIR": str(state),
            "SANDMAN_CGROUP_PARENT": config.cgroup_parent,
            "SANDMAN_API_KEYS": f"{TENANT}:{key}",
            "SANDMAN_RUN_CODE": json.dumps({"warm": warm}),
        }
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "from sandman.cli import main; main()", "serve",
                "--port", str(port), "--pool-name", f"bench-{uuid.uuid4().hex[:6]}",
                "--log-level", "warning",
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, process, log, 60)
        served = Served(url, key, provider)
        yield served
    finally:
        if process is not None:
            await stop(process)
        if served is not None:
            served.left = len(await provider.list()) + count_leftover(provider)
        for info in await provider.list():  # only if the service failed to release them
            await provider.delete(info.id)
        await provider.aclose()
        remove_cgroup_parent(config.cgroup_parent)
        shutil.rmtree(state, ignore_errors=True)


async def leased(served: Served) -> int:
    async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        response = await http.get(
            "/v1/sandboxes",
            params={"state": "leased"},
            headers={"Authorization": f"Bearer {served.key}"},
        )
        return len(response.json()["sandboxes"])


async def run(args: argparse.Namespace) -> int:
    chosen = [workloads()[name] for name in args.workloads.split(",")]
    polyglot = any(w.name == "cpp" for w in chosen)
    results: dict[str, dict[str, Outcome]] = {}
    left = 0
    async with sandman_serve(args.warm, polyglot) as served:
        auth = (TENANT, served.key)
        url = f"{served.url}/run_code"
        for work in chosen:  # warm-up: the first requests start the tenant's warm spares
            await drive(url, auth, work, min(args.concurrency, 4), min(args.concurrency, 4))
        await asyncio.sleep(args.settle)
        for work in chosen:
            outcome = await drive(url, auth, work, args.requests, args.concurrency)
            results.setdefault(work.name, {})["sandman"] = outcome
            print(f"sandman {work.name}: rps={outcome.rps:.1f} p50_ms={outcome.p50_ms:.0f} "
                  f"p99_ms={outcome.p99_ms:.0f} failures={outcome.failures} {outcome.said}",
                  flush=True)  # fmt: skip
            await asyncio.sleep(args.settle)
        for _ in range(100):
            left = await leased(served)
            if not left:
                break
            await asyncio.sleep(0.1)
    left += served.left
    if args.fusion_url:
        url = f"{args.fusion_url.rstrip('/')}/run_code"
        for work in chosen:
            await drive(url, None, work, min(args.concurrency, 4), min(args.concurrency, 4))
            outcome = await drive(url, None, work, args.requests, args.concurrency)
            results[work.name]["fusion"] = outcome
            print(f"fusion {work.name}: rps={outcome.rps:.1f} p50_ms={outcome.p50_ms:.0f} "
                  f"p99_ms={outcome.p99_ms:.0f} failures={outcome.failures} {outcome.said}",
                  flush=True)  # fmt: skip
    first = results[chosen[0].name]
    ours, theirs = first["sandman"], first.get("fusion")
    failures = sum(o.failures for r in results.values() for o in r.values())
    if theirs is None:
        fusion = "fusion_rps=na ratio=na"
        fusion_p99 = "fusion_p99_ms=na"
    else:
        fusion = f"fusion_rps={theirs.rps:.1f} ratio={ours.rps / theirs.rps:.2f}"
        fusion_p99 = f"fusion_p99_ms={theirs.p99_ms:.0f}"
    print(f"sandman_rps={ours.rps:.1f} {fusion} sandman_p99_ms={ours.p99_ms:.0f} {fusion_p99} "
          f"failures={failures} leftover={left}")  # fmt: skip
    return 1 if failures or left else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200, help="per workload and server")
    parser.add_argument("--warm", type=int, default=16, help="ready spares per language")
    parser.add_argument("--workloads", default="print1")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between workloads")
    parser.add_argument("--fusion-url", help="a SandboxFusion server to drive as well")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the local provider needs it", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
