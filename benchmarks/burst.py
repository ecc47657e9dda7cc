"""A burst of sandbox requests from many client sessions sharing one embedded pool.

M client sessions ask for N sandboxes in total at the same moment from one
pool on the local provider (tiny busybox image). Each sandbox runs one
command and is released. Prints when 50% and 100% of the sandboxes were
usable (counted from the burst's start), the failures, and, after the
clients have closed, how many sandboxes are left (must be 0). Writes a PNG
of the cumulative time-to-usable curve.

Last line: ``failures=<n> leftover=<n> t50=<s> t100=<s>``

Run as root: ``.venv/bin/python benchmarks/burst.py --requests 2000 --clients 8``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sandman.client import AsyncClient, InProcessBackend
from sandman.errors import SandboxError
from sandman.images.busybox import busybox_rootfs_tar
from sandman.pool import PacingConfig, Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig


def _plot(usable: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = sorted(usable)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(times, range(1, len(times) + 1), where="post")
    ax.set_xlabel("seconds since the burst started")
    ax.set_ylabel("sandboxes usable")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(requests: int, clients: int, state: Path, png: Path, pacing: PacingConfig) -> str:
    config = LocalConfig(state_dir=state, cgroup_parent=f"/sandman-bench/{uuid.uuid4().hex[:8]}")
    provider = LocalProvider(config)
    await provider.images.import_archive(busybox_rootfs_tar(state / "busybox.tar"), name="busybox")
    pool = Pool(provider, PoolConfig(name=f"burst-{uuid.uuid4().hex[:6]}", pacing=pacing))
    await pool.start()
    sessions = [AsyncClient(InProcessBackend(pool, own_pool=False)) for _ in range(clients)]
    usable: list[float] = []
    failures: list[str] = []
    started = time.monotonic()

    async def one(client: AsyncClient) -> None:
        try:
            async with client.sandbox("busybox", memory="64Mi", pids=64, timeout=600) as sb:
                await sb.exec(["true"], check=True)
                usable.append(time.monotonic() - started)
        except SandboxError as exc:
            failures.append(repr(exc))

    share = [requests // clients + (i < requests % clients) for i in range(clients)]
    await asyncio.gather(*(one(c) for c, n in zip(sessions, share, strict=True) for _ in range(n)))
    for client in sessions:
        await client.aclose()
    await pool.aclose()
    leftover = len(await provider.list())
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        target = hierarchy / config.cgroup_parent.strip("/")
        if target.is_dir():
            target.rmdir()

    usable.sort()
    t50 = usable[len(usable) // 2 - 1] if len(usable) >= 2 else float("nan")
    t100 = usable[-1] if len(usable) == requests else float("inf")
    _plot(usable, png, f"{requests} sandboxes, {clients} clients, one embedded pool")
    median = statistics.median(usable) if usable else float("nan")
    rate = len(usable) / max(usable or [1])
    summary = f"requests={requests} clients={clients} usable={len(usable)} rate_per_s={rate:.1f}"
    lines = [f"{summary} median_time_to_usable_s={median:.2f}", f"plot={png}"]
    if failures:
        lines.append(f"first failure: {failures[0]}")
    lines.append(f"failures={len(failures)} leftover={leftover} t50={t50:.2f} t100={t100:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--png", type=Path, default=Path("burst.png"))
    parser.add_argument("--rate", type=float, default=PacingConfig.rate)
    parser.add_argument("--window", type=int, default=PacingConfig.window)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="smb-", dir="/tmp"))
    pacing = PacingConfig(rate=args.rate, window=args.window)
    try:
        print(asyncio.run(run(args.requests, args.clients, state, args.png.resolve(), pacing)))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
