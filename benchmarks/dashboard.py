"""The dashboard's answer time with many sandboxes held: ``GET /v1/dashboard`` and a page
of ``GET /v1/dashboard/sandboxes``, for a tenant holding most of them.

A pool on the fake provider without daemons (`sandman.testing.FakeProvider`, no
processes: the figure is the service's own work, which is what grows with the count)
holds ``-n`` sandboxes, nine in ten of tenant ``a``, the rest of ``b``. Each route is
called through the ASGI app in this process; medians and p95 of ``--calls`` calls.

Last line: ``sandboxes=<n> dashboard_p50_ms=<ms> list_p50_ms=<ms> list_p95_ms=<ms>``.

    .venv/bin/python benchmarks/dashboard.py [-n 10000] [--calls 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, quantile

from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.pool.pacing import PacingConfig
from sandman.server import ApiKey, ServerSettings, create_app
from sandman.testing import FakeProvider

KEY_A = "dashboard-bench-key-a-0123456789"
KEY_B = "dashboard-bench-key-b-0123456789"


async def main(count: int, calls: int) -> str:
    async with FakeProvider(daemon=False, seed=1) as provider:
        config = PoolConfig(
            name="dashboard",
            record_hand_over=False,
            lease=1e9,
            pacing=PacingConfig(rate=500.0, burst=500, max_window=100_000),
        )
        async with Pool(provider, config) as pool:
            session = pool.open_session()
            for start in range(0, count, 500):
                batch = range(start, min(count, start + 500))
                await asyncio.gather(
                    *(
                        pool.acquire(
                            SandboxSpec(
                                image=f"task-{i % 50}",
                                labels={"n": str(i)},
                            ).model_copy(
                                update={"labels": {"sandman.io/tenant": "a" if i % 10 else "b"}}
                            ),
                            session=session,
                        )
                        for i in batch
                    )
                )
                progress(min(count, start + 500), count * 2)
            settings = ServerSettings(
                api_keys=[ApiKey(tenant="a", key=KEY_A), ApiKey(tenant="b", key=KEY_B)]
            )
            app = create_app(pool, settings)
            headers = {"Authorization": f"Bearer {KEY_A}"}
            transport = httpx.ASGITransport(app=app)
            board, listing = [], []
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as api:
                for i in range(calls):
                    started = time.perf_counter()
                    (await api.get("/v1/dashboard", headers=headers)).raise_for_status()
                    board.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    page = await api.get(f"/v1/dashboard/sandboxes?page={i % 10}", headers=headers)
                    page.raise_for_status()
                    listing.append(time.perf_counter() - started)
                    progress(count + (i + 1) * count // calls, count * 2)
            total = page.json()["total"]
            print(f"{count} sandboxes held, tenant a's {total}; {calls} calls each")
    return (
        f"sandboxes={count} dashboard_p50_ms={statistics.median(board) * 1000:.1f} "
        f"list_p50_ms={statistics.median(listing) * 1000:.1f} "
        f"list_p95_ms={quantile(listing, 0.95) * 1000:.1f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(asyncio.run(main(args.n, args.calls)))
