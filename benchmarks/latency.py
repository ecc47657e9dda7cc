"""Latency of the daemon protocol over a unix socket, through the Python client.

Starts the real sandmand on the host, then makes N sequential calls of each
kind: a no-op exec (``true``), a 1 KiB file write and a 1 KiB file read. In
the same run, interleaved with the exec calls so both see the same machine,
it times this process's own ``subprocess.run(["true"])``: the cost of
spawning a process at all, the floor for any exec. Then, in a phase of its
own (httpx's garbage would slow the calls timed beside it), N no-op execs
through httpx over the same socket (``httpx.AsyncHTTPTransport(uds=...)``
behind the client's transport seam) interleaved with N more through the
lean transport: what the hand-written transport saves. The last two lines
are

    noop_exec_httpx_ms=<z> httpx_vs_lean=<z/x>
    noop_exec_median_ms=<x> spawn_median_ms=<y> noop_exec_ratio=<x/y>

Run: ``.venv/bin/python benchmarks/latency.py [-n 2000]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import quantile, timed

from sandman._transport.bridge import HttpxTransport
from sandman.daemon import DaemonClient, daemon_path

TOKEN = "bench-token"


def _line(name: str, samples: list[float]) -> str:
    return (
        f"{name:<12} median_ms={statistics.median(samples) * 1e3:.3f} "
        f"p95_ms={quantile(samples, 0.95) * 1e3:.3f} n={len(samples)}"
    )


def _spawn() -> float:
    started = time.perf_counter()
    subprocess.run(["true"], check=True)
    return time.perf_counter() - started


async def measure(sock: str, n: int, warmup: int) -> str:
    payload = os.urandom(1024)
    over_httpx = HttpxTransport(
        httpx.AsyncHTTPTransport(uds=sock), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    async with (
        DaemonClient(uds=sock, token=TOKEN) as client,
        DaemonClient(transport=over_httpx) as httpx_client,
    ):
        await client.health()
        await httpx_client.health()
        target = "/tmp/sandman-bench-1k"

        async def noop() -> None:
            await client.exec(["true"])

        async def noop_httpx() -> None:
            await httpx_client.exec(["true"])

        async def write() -> None:
            await client.write_file(target, payload)

        async def read() -> None:
            await client.read_file(target)

        for _ in range(warmup):
            await noop()
            _spawn()
            await noop_httpx()
            await write()
            await read()

        exec_samples: list[float] = []
        spawn_samples: list[float] = []
        for _ in range(n):
            exec_samples.append(await timed(noop))
            spawn_samples.append(_spawn())
        write_samples = [await timed(write) for _ in range(n)]
        read_samples = [await timed(read) for _ in range(n)]
        httpx_samples: list[float] = []
        beside_samples: list[float] = []  # the lean transport's, in the same phase
        for _ in range(n):
            httpx_samples.append(await timed(noop_httpx))
            beside_samples.append(await timed(noop))
        await client.remove(target)

    lines = [
        _line("noop_exec", exec_samples),
        _line("noop_httpx", httpx_samples),
        _line("write_1k", write_samples),
        _line("read_1k", read_samples),
        _line("spawn", spawn_samples),
    ]
    exec_median = statistics.median(exec_samples) * 1e3
    spawn_median = statistics.median(spawn_samples) * 1e3
    httpx_median = statistics.median(httpx_samples) * 1e3
    beside_median = statistics.median(beside_samples) * 1e3
    lines.append(
        f"noop_exec_httpx_ms={httpx_median:.3f} httpx_vs_lean={httpx_median / beside_median:.2f}"
    )
    lines.append(
        f"noop_exec_median_ms={exec_median:.3f} spawn_median_ms={spawn_median:.3f} "
        f"noop_exec_ratio={exec_median / spawn_median:.2f}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="calls of each kind")
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandman-bench-") as tmp:
        sock = str(Path(tmp) / "sandmand.sock")
        log = open(Path(tmp) / "sandmand.log", "wb")  # noqa: SIM115 - closed below
        daemon = subprocess.Popen(
            [str(daemon_path()), "--listen", f"unix:{sock}"],
            env={**os.environ, "SANDMAND_TOKEN": TOKEN},
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 10
            while not Path(sock).exists():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print("sandmand did not start", file=sys.stderr)
                    return 1
                time.sleep(0.005)
            print(asyncio.run(measure(sock, args.n, args.warmup)))
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=15)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
