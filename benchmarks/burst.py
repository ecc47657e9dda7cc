"""A burst of sandbox requests from many client sessions sharing one pool.

M client sessions ask for N sandboxes in total at the same moment (tiny
busybox image). Each sandbox runs one command and is released. Prints when
50% and 100% of the sandboxes were usable (counted from the burst's start),
the failures, and, after the clients have closed, how many sandboxes are left
(must be 0). Writes a PNG of the cumulative time-to-usable curve.

Two modes:

- embedded (default): the clients are sessions of one pool in this process;
- through the service (``--url URL`` with ``--api-key``/``SANDMAN_API_KEY``,
  or ``--serve`` to start a local ``sandman serve`` for the run): each client
  is a separate OS process with its own session. By default one of them is
  SIGKILLed mid-burst (``--no-kill`` to keep them all): its requests are not
  counted, and the run waits until every sandbox it held is gone (its session
  lease passes). Failures are those of the surviving clients; ``leftover``
  counts what the backend holds once every client exited and the leases
  passed (the provider's own list with ``--serve``; the tenant's live
  sandboxes as the service lists them with ``--url``).

Last line: ``failures=<n> leftover=<n> t50=<s> t100=<s>``

Run as root: ``.venv/bin/python benchmarks/burst.py --requests 2000 --clients 8``
or ``.venv/bin/python benchmarks/burst.py --requests 500 --clients 8 --serve``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from _common import new_cgroup_parent, progress

import sandman
from sandman.client import AsyncClient, InProcessBackend
from sandman.errors import SandboxError
from sandman.images.busybox import busybox_rootfs_tar
from sandman.pool import PacingConfig, Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
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


def _shares(requests: int, clients: int) -> list[int]:
    """``requests`` split over ``clients`` as evenly as whole numbers go."""
    return [requests // clients + (i < requests % clients) for i in range(clients)]


def _report(
    usable: list[float], expected: int, failures: list[str], leftover: int,
    png: Path, title: str, fields: str,
) -> list[str]:  # fmt: skip
    """The run's closing lines (and its plot) from the sorted times to usable.

    ``expected`` is how many should have become usable (t100 is inf short of
    that); ``fields`` opens the summary line with what the mode ran.
    """
    t50 = usable[len(usable) // 2 - 1] if len(usable) >= 2 else float("nan")
    t100 = usable[-1] if usable and len(usable) == expected else float("inf")
    _plot(usable, png, title)
    median = statistics.median(usable) if usable else float("nan")
    rate = len(usable) / max(usable or [1])
    summary = f"{fields} usable={len(usable)} rate_per_s={rate:.1f}"
    lines = [f"{summary} median_time_to_usable_s={median:.2f}", f"plot={png}"]
    if failures:
        lines.append(f"first failure: {failures[0]}")
    lines.append(f"failures={len(failures)} leftover={leftover} t50={t50:.2f} t100={t100:.2f}")
    return lines


async def run(requests: int, clients: int, state: Path, png: Path, pacing: PacingConfig) -> str:
    """The embedded burst. Closes all it opened, whatever happens: the clients, the
    pool, the provider (its disk filesystem, a btrfs mounted from an image file in
    ``state``, is unmounted: removing the directory alone would leave it mounted,
    its space kept) and the cgroup parent."""
    config = LocalConfig(state_dir=state, cgroup_parent=new_cgroup_parent())
    provider = LocalProvider(config)
    try:
        return await _burst(provider, requests, clients, png, pacing)
    finally:
        try:
            for info in await provider.list():  # counted as leftover already; not kept
                await provider.delete(info.id)
        finally:
            await provider.aclose()
            remove_cgroup_parent(config.cgroup_parent)


async def _burst(
    provider: LocalProvider, requests: int, clients: int, png: Path, pacing: PacingConfig
) -> str:
    state = provider.config.state_dir
    await provider.images.import_archive(busybox_rootfs_tar(state / "busybox.tar"), name="busybox")
    pool = Pool(provider, PoolConfig(name=f"burst-{uuid.uuid4().hex[:6]}", pacing=pacing))
    usable: list[float] = []
    failures: list[str] = []

    async def one(client: AsyncClient) -> None:
        try:
            async with client.sandbox("busybox", memory="64Mi", pids=64, timeout=600) as sb:
                await sb.exec(["true"], check=True)
                usable.append(time.monotonic() - started)
                progress(len(usable), requests)
        except SandboxError as exc:
            failures.append(repr(exc))

    share = _shares(requests, clients)
    async with pool:
        sessions = [AsyncClient(InProcessBackend(pool, own_pool=False)) for _ in range(clients)]
        try:
            started = time.monotonic()
            burst = (one(c) for c, n in zip(sessions, share, strict=True) for _ in range(n))
            await asyncio.gather(*burst)
        finally:
            for client in sessions:
                await client.aclose()
    leftover = len(await provider.list())

    usable.sort()
    title = f"{requests} sandboxes, {clients} clients, one embedded pool"
    fields = f"requests={requests} clients={clients}"
    return "\n".join(_report(usable, requests, failures, leftover, png, title, fields))


# -- through the service: clients are processes ------------------------------------------


async def client_process(
    url: str, api_key: str, requests: int, via_proxy: bool, hold: bool
) -> None:
    """One client process: a session, ready; on ``go`` (stdin), its share of the burst.

    With ``hold`` (the client that is killed) it keeps its sandboxes once usable,
    as a trainer mid-rollout does, so that the kill leaves them leased.

    Reports on stdout as it goes: ``ready``, ``acquired <id>``, ``usable <monotonic
    time> <id>`` (CLOCK_MONOTONIC is one clock for every process of the machine),
    ``failed <error>``, and ``done``.
    """

    def say(*words: object) -> None:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()

    async with sandman.connect(url, api_key=api_key, via_proxy=via_proxy or None) as client:
        # Open the session before the burst, as a trainer does at start.
        await client._ensure_session()
        say("ready")
        await asyncio.to_thread(sys.stdin.readline)

        async def one() -> None:
            try:
                sb = await client.acquire("busybox", memory="64Mi", pids=64, timeout=600)
                say("acquired", sb.id)
                async with sb:
                    await sb.exec(["true"], check=True)
                    say("usable", time.monotonic(), sb.id)
                    if hold:
                        await asyncio.Event().wait()  # until SIGKILL
            except SandboxError as exc:
                say("failed", repr(exc).replace("\n", " "))

        await asyncio.gather(*(one() for _ in range(requests)))
    say("done")


class Client:
    """The parent's view of one client process."""

    def __init__(self, index: int, process: asyncio.subprocess.Process, share: int) -> None:
        self.index = index
        self.process = process
        self.share = share
        self.acquired: list[str] = []
        self.usable: list[tuple[float, str]] = []
        self.failures: list[str] = []
        self.ready = asyncio.Event()
        self.done = False
        self.killed = False

    async def read(self, on_line: Callable[[Client], None]) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            word, _, rest = raw.decode().strip().partition(" ")
            if word == "ready":
                self.ready.set()
            elif word == "acquired":
                self.acquired.append(rest)
            elif word == "usable":
                at, _, sid = rest.partition(" ")
                self.usable.append((float(at), sid))
            elif word == "failed":
                self.failures.append(rest)
            elif word == "done":
                self.done = True
            on_line(self)


async def _sandbox_gone(api: httpx.AsyncClient, sandbox_id: str) -> bool:
    response = await api.get(f"/v1/sandboxes/{sandbox_id}")
    return response.status_code == 404 or response.json().get("state") == "gone"


async def _live(api: httpx.AsyncClient) -> int:
    listed = (await api.get("/v1/sandboxes")).json()["sandboxes"]
    return sum(1 for s in listed if s["state"] != "gone")


async def run_processes(
    url: str, api_key: str, requests: int, clients: int, png: Path, *,
    kill: bool, via_proxy: bool, lease: float, provider: LocalProvider | None,
) -> str:  # fmt: skip
    share = _shares(requests, clients)
    victim_index = 0 if kill else None
    command = [sys.executable, __file__, "--client", "--url", url]
    if via_proxy:
        command.append("--via-proxy")
    env = {**os.environ, "SANDMAN_API_KEY": api_key}
    procs: list[Client] = []
    try:
        for i, n in enumerate(share):
            process = await asyncio.create_subprocess_exec(
                *command, "--requests", str(n), *(["--hold"] if i == victim_index else []),
                env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(Client(i, process, n))
        return await _watch(procs, url, api_key, requests, clients, png, victim_index,
                            via_proxy=via_proxy, lease=lease, provider=provider)  # fmt: skip
    finally:
        # Cut short (an error, ^C): no client process outlives the run. Each would read
        # EOF as its "go" and start a burst of its own.
        for c in procs:
            if c.process.returncode is None:
                c.process.kill()
                await c.process.wait()


async def _watch(
    procs: list[Client], url: str, api_key: str, requests: int, clients: int, png: Path,
    victim_index: int | None, *, via_proxy: bool, lease: float, provider: LocalProvider | None,
) -> str:  # fmt: skip
    """Start the client processes' burst, follow it (killing the victim mid-burst), and
    report once all of them exited and the victim's lease passed."""
    kill = victim_index is not None
    killed_at: float | None = None
    held_at_kill: list[str] = []

    def on_line(client: Client) -> None:
        nonlocal killed_at
        progress(sum(len(c.usable) for c in procs), requests)
        # Mid-burst: once the victim has half its share usable, with the rest in flight.
        half = len(client.usable) >= max(1, client.share // 2)
        if client.index == victim_index and not client.killed and half:
            client.process.send_signal(signal.SIGKILL)
            client.killed = True
            killed_at = time.monotonic()
            held_at_kill.extend(client.acquired)

    readers = [asyncio.create_task(c.read(on_line)) for c in procs]
    try:
        await asyncio.gather(*(c.ready.wait() for c in procs))
        started = time.monotonic()
        for c in procs:
            assert c.process.stdin is not None
            c.process.stdin.write(b"go\n")
            await c.process.stdin.drain()
        await asyncio.gather(*(c.process.wait() for c in procs))
        await asyncio.gather(*readers)
    finally:
        for reader in readers:
            reader.cancel()

    survivors = [c for c in procs if not c.killed]
    failures = [f for c in survivors for f in c.failures]
    failures += [f"client {c.index} exited {c.process.returncode}" for c in survivors
                 if c.process.returncode != 0 or not c.done]  # fmt: skip
    usable = sorted(at - started for c in survivors for at, _ in c.usable)
    expected = sum(c.share for c in survivors)
    lines = []
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ) as api:
        if kill:
            victim = procs[victim_index or 0]
            deadline = time.monotonic() + lease + 60
            pending = set(victim.acquired)
            while pending and time.monotonic() < deadline:
                pending = {s for s in pending if not await _sandbox_gone(api, s)}
                await asyncio.sleep(0.2)
            gone_after = time.monotonic() - (killed_at or started)
            lines.append(
                f"killed client {victim.index} (SIGKILL) after {len(victim.usable)}/{victim.share}"
                f" usable, holding {len(held_at_kill)} leased; all its sandboxes gone "
                f"{gone_after:.1f}s after the kill (lease {lease:.0f}s), still there: {len(pending)}"
            )
        # Every client exited and the victim's lease passed: what is left now is a leak.
        deadline = time.monotonic() + 30
        while True:
            leftover = len(await provider.list()) if provider is not None else await _live(api)
            if not leftover or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

    where = "a local service (--serve)" if provider is not None else url
    title = f"{requests} sandboxes, {clients} client processes, {where}"
    fields = (
        f"requests={requests} clients={clients} processes=yes via_proxy={via_proxy} "
        f"surviving_requests={expected}"
    )
    lines += _report(usable, expected, failures, leftover, png, title, fields)
    return "\n".join(lines)


async def run_served(args: argparse.Namespace) -> str:
    from _service import local_service

    async with local_service(lease=args.lease) as service:
        return await run_processes(
            service.url, service.api_key, args.requests, args.clients, args.png.resolve(),
            kill=args.kill, via_proxy=args.via_proxy, lease=args.lease, provider=service.provider,
        )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--png", type=Path, default=Path("burst.png"))
    parser.add_argument("--rate", type=float, default=PacingConfig.rate)
    parser.add_argument("--window", type=int, default=PacingConfig.window)
    parser.add_argument("--url", help="a Sandman service: clients are processes going through it")
    parser.add_argument("--api-key", default=os.environ.get("SANDMAN_API_KEY", ""))
    parser.add_argument("--serve", action="store_true", help="start a local service for the run")
    parser.add_argument("--no-kill", dest="kill", action="store_false",
                        help="(service mode) do not SIGKILL a client mid-burst")  # fmt: skip
    parser.add_argument("--via-proxy", action="store_true",
                        help="(service mode) commands go through the service's proxy route")  # fmt: skip
    parser.add_argument("--lease", type=float, default=10.0,
                        help="(--serve) the session lease: how long a killed client's sandboxes stay")  # fmt: skip
    parser.add_argument("--state-dir", type=Path,
                        help="(embedded) the provider's state dir, kept after the run "
                             "(default: a fresh one under /tmp, removed)")  # fmt: skip
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(
            client_process(args.url, args.api_key, args.requests, args.via_proxy, args.hold)
        )
        return 0
    if args.serve and args.url:
        parser.error("--serve starts its own service: leave out --url")
    if args.serve:
        print(asyncio.run(run_served(args)))
        return 0
    if args.url:
        if not args.api_key:
            parser.error("--url needs --api-key (or SANDMAN_API_KEY)")
        print(asyncio.run(run_processes(
            args.url, args.api_key, args.requests, args.clients, args.png.resolve(),
            kill=args.kill, via_proxy=args.via_proxy, lease=args.lease, provider=None,
        )))  # fmt: skip
        return 0
    # A directory given is the caller's to remove (a test looks at the mounts under it).
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="smb-", dir="/tmp"))
    pacing = PacingConfig(rate=args.rate, window=args.window)
    try:
        print(asyncio.run(run(args.requests, args.clients, state, args.png.resolve(), pacing)))
    finally:
        if args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
