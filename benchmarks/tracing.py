"""What tracing costs a no-op exec: ``sb.exec(["true"])`` against the same call on the
daemon's client directly (no span code at all), interleaved, in one sandbox; once in a
program that set up no tracing, once in one whose tracer provider records every span
(OpenTelemetry's SDK, an in-memory exporter).

Last line: ``noop_exec_ratio_tracing_off=<x> noop_exec_ratio_tracing_on=<x>
noop_exec_p50_ms=<ms>`` (the ratios: median through `AsyncSandbox.exec` over median
direct; 1.00 is free).

    .venv/bin/python benchmarks/tracing.py [-n 300]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

RUN = textwrap.dedent(
    """
    import asyncio, json, statistics, sys, time
    state, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "on":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
    from pathlib import Path
    import sandman
    from sandman.images.busybox import busybox_rootfs_tar
    from sandman.providers.local import LocalProvider
    from sandman.settings import LocalConfig

    async def main():
        config = LocalConfig(state_dir=state)
        provider = LocalProvider(config)
        await provider.images.import_archive(busybox_rootfs_tar(Path(state) / "bb.tar"), name="busybox")
        wrapped, direct = [], []
        async with sandman.local(config) as client, client.sandbox("busybox") as sb:
            for _ in range(20):
                await sb.exec(["true"])
            for _ in range(n):
                t = time.perf_counter(); await sb.exec(["true"]); wrapped.append(time.perf_counter() - t)
                t = time.perf_counter(); await sb._daemon.exec(["true"]); direct.append(time.perf_counter() - t)
        await provider.aclose()
        return statistics.median(wrapped), statistics.median(direct)

    wrapped, direct = asyncio.run(main())
    print(json.dumps({"wrapped": wrapped, "direct": direct}))
    """
)


def measure(mode: str, n: int) -> tuple[float, float]:
    state = tempfile.mkdtemp(prefix="smt-", dir="/tmp")
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUN, state, mode, str(n)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"the {mode} run failed:\n{done.stderr[-3000:]}")
    finally:
        shutil.rmtree(state, ignore_errors=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["wrapped"]), float(result["direct"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300)
    args = parser.parse_args()
    off_wrapped, off_direct = measure("off", args.n)
    on_wrapped, on_direct = measure("on", args.n)
    print(f"tracing off: exec {off_wrapped * 1000:.3f} ms, direct {off_direct * 1000:.3f} ms")
    print(f"tracing on:  exec {on_wrapped * 1000:.3f} ms, direct {on_direct * 1000:.3f} ms")
    print(
        f"noop_exec_ratio_tracing_off={off_wrapped / off_direct:.2f} "
        f"noop_exec_ratio_tracing_on={on_wrapped / on_direct:.2f} "
        f"noop_exec_p50_ms={off_wrapped * 1000:.2f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
