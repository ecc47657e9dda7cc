"""Port exposure: what ``expose`` adds to a TCP round trip, and its bulk throughput.

Three servers, busybox ``nc -ll -e`` (a process per connection, the same
programs on the host and in a sandbox): an echo (``cat``), a source (``dd``
of N MiB from /dev/zero) and a sink (``cat >/dev/null``, then ``done``).
Each path is driven from this process with blocking sockets, while the
tunnel runs in a child process's event loop, as it would in a user's
program; the servers and the daemons are processes of their own.

- ``direct``: the servers on this host's loopback, connected to directly
  (the floor);
- ``unix``: the same servers through a host sandmand's unix socket (the
  local provider's path);
- ``tcp``: through the host sandmand's TCP listener (a pod's path);
- with ``--service`` (root: ``sandman serve`` on the local provider):
  ``sandbox``, the servers inside a ``network="none"`` sandbox, through its
  daemon's socket (no direct path exists), and ``proxy``, the same ports
  through the service's proxy route (the full-duplex form).

Per path: ``rtt`` (one byte there and back on an open connection),
``connect`` (a new connection and its first round trip: the daemon's
handshake, nc's fork), ``download``/``upload`` (MB/s of N MiB, 1 MB = 10^6
bytes). Paths take turns within each round, so they share the machine's
state. The last line is ``key=value``: medians, and for each tunnelled path
the round trip it adds over ``direct``.

Run: ``.venv/bin/python benchmarks/expose.py [-n 2000] [--mib 256] [--service]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import quantile

from sandman.daemon import DaemonClient, daemon_path

TOKEN = "bench-token"
SERVERS = ("echo", "source", "sink")
Address = tuple[str, int]


def _scripts(root: Path, mib: int) -> dict[str, str]:
    """The servers' programs under ``root``: name -> path of what ``nc -e`` runs."""
    root.mkdir(parents=True, exist_ok=True)
    source = root / "source.sh"
    source.write_text(f"#!/bin/sh\nexec dd if=/dev/zero bs=65536 count={mib * 16} 2>/dev/null\n")
    sink = root / "sink.sh"
    sink.write_text("#!/bin/sh\ncat >/dev/null\necho done\n")
    for path in (source, sink):
        path.chmod(0o755)
    return {"echo": "/bin/cat", "source": str(source), "sink": str(sink)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- the driver: blocking sockets ------------------------------------------------------


def _connect(address: Address) -> socket.socket:
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _wait_echo(address: Address, timeout: float = 30.0) -> None:
    """Until the echo behind ``address`` answers (servers start in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _connect(address) as sock:
                sock.settimeout(5)
                sock.sendall(b"?")
                if sock.recv(1) == b"?":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no echo at {address} within {timeout} s")
        time.sleep(0.02)


def rtt(address: Address, n: int) -> list[float]:
    samples = []
    with _connect(address) as sock:
        for _ in range(20):  # warm-up
            sock.sendall(b"x")
            sock.recv(1)
        for _ in range(n):
            started = time.perf_counter()
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise RuntimeError("echo broke")
            samples.append(time.perf_counter() - started)
    return samples


def connect_rtt(address: Address, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        with _connect(address) as sock:
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise RuntimeError("echo broke")
        samples.append(time.perf_counter() - started)
    return samples


def download(address: Address, size: int) -> float:
    """MB/s of reading the source to its end."""
    buffer = bytearray(1024 * 1024)
    received = 0
    started = time.perf_counter()
    with _connect(address) as sock:
        while n := sock.recv_into(buffer):
            received += n
    elapsed = time.perf_counter() - started
    if received != size:
        raise RuntimeError(f"downloaded {received} of {size} bytes")
    return size / elapsed / 1e6


def upload(address: Address, size: int) -> float:
    """MB/s of writing ``size`` bytes to the sink, up to its ``done``."""
    chunk = bytes(1024 * 1024)
    started = time.perf_counter()
    with _connect(address) as sock:
        for _ in range(size // len(chunk)):
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while data := sock.recv(64):
            answer += data
    elapsed = time.perf_counter() - started
    if answer != b"done\n":
        raise RuntimeError(f"the sink answered {answer!r}")
    return size / elapsed / 1e6


# -- the child: holds the tunnels -----------------------------------------------------


async def _child(spec: dict[str, Any]) -> None:
    """Expose what ``spec`` says, print the local addresses as JSON, hold them until stdin ends."""
    async with contextlib.AsyncExitStack() as stack:
        paths: dict[str, dict[str, Address]] = {}
        if spec["kind"] == "daemon":
            for name, daemon in (
                ("unix", DaemonClient(uds=spec["uds"], token=TOKEN)),
                ("tcp", DaemonClient(host="127.0.0.1", port=spec["tcp_port"], token=TOKEN)),
            ):
                stack.push_async_callback(daemon.aclose)
                paths[name] = {s: await _expose(daemon, p) for s, p in spec["ports"].items()}
        else:
            import sandman
            from sandman.client.remote import RemoteBackend

            service = await stack.enter_async_context(
                sandman.connect(spec["url"], api_key=spec["key"])
            )
            sb = await stack.enter_async_context(
                service.sandbox("busybox", network="none", memory="256Mi", timeout=60)
            )
            programs = _scripts(Path(tempfile.mkdtemp()), spec["mib"])
            for name in ("source", "sink"):
                await sb.write_file(f"/srv/{name}.sh", Path(programs[name]).read_text(), mode=0o755)
            ports = {name: 9000 + i for i, name in enumerate(SERVERS)}
            for name, port in ports.items():
                program = "/bin/cat" if name == "echo" else f"/srv/{name}.sh"
                await sb.spawn(["busybox", "nc", "-ll", "-p", str(port), "-e", program])
            paths["sandbox"] = {s: await _expose(sb, p) for s, p in ports.items()}
            backend = RemoteBackend(spec["url"], api_key=spec["key"])
            stack.push_async_callback(backend.aclose)
            proxied = await stack.enter_async_context(backend.proxied(sb.id).client())
            paths["proxy"] = {s: await _expose(proxied, p) for s, p in ports.items()}
        print(json.dumps(paths), flush=True)
        await asyncio.to_thread(sys.stdin.read)


async def _expose(client: Any, port: int) -> Address:
    exposed = await client.expose(port)
    return (exposed.host, exposed.port)


@contextlib.contextmanager
def _tunnels(spec: dict[str, Any]) -> Iterator[dict[str, dict[str, Address]]]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("the exposing child exited")
        found = json.loads(line)
        yield {path: {s: (a[0], a[1]) for s, a in ports.items()} for path, ports in found.items()}
    finally:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# -- the run ------------------------------------------------------------------------------


@contextlib.contextmanager
def _host_servers(root: Path, mib: int) -> Iterator[dict[str, int]]:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("needs busybox on PATH")
    programs = _scripts(root, mib)
    ports = {name: _free_port() for name in SERVERS}
    processes = [
        subprocess.Popen([busybox, "nc", "-ll", "-p", str(ports[name]), "-e", programs[name]])
        for name in SERVERS
    ]
    try:
        yield ports
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _host_daemon(root: Path) -> Iterator[tuple[str, int]]:
    sock = str(root / "sandmand.sock")
    port = _free_port()
    log = (root / "sandmand.log").open("wb")
    daemon = subprocess.Popen(
        [str(daemon_path()), "--listen", f"unix:{sock}", "--listen", f"tcp:127.0.0.1:{port}"],
        env={**os.environ, "SANDMAND_TOKEN": TOKEN}, stdout=log, stderr=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while (root / "sandmand.log").read_text().count("listening on") < 2:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sandmand did not start")
            time.sleep(0.005)
        yield sock, port
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
        log.close()


def measure(paths: dict[str, dict[str, Address]], n: int, rounds: int, size: int) -> str:
    for ports in paths.values():
        _wait_echo(ports["echo"])
    figures: dict[str, dict[str, list[float]]] = {
        path: {"rtt": [], "connect": [], "download": [], "upload": []} for path in paths
    }
    per_round = max(1, n // rounds)
    for _ in range(rounds):
        for path, ports in paths.items():
            f = figures[path]
            f["rtt"] += rtt(ports["echo"], per_round)
            f["connect"] += connect_rtt(ports["echo"], max(1, per_round // 10))
            f["download"].append(download(ports["source"], size))
            f["upload"].append(upload(ports["sink"], size))
    lines = []
    summary: dict[str, float] = {}
    for path, f in figures.items():
        rtt_ms = statistics.median(f["rtt"]) * 1e3
        summary[f"rtt_ms_{path}"] = rtt_ms
        summary[f"connect_ms_{path}"] = statistics.median(f["connect"]) * 1e3
        summary[f"download_MBps_{path}"] = statistics.median(f["download"])
        summary[f"upload_MBps_{path}"] = statistics.median(f["upload"])
        lines.append(
            f"{path:<8} rtt median_ms={rtt_ms:.3f} p95_ms={quantile(f['rtt'], 0.95) * 1e3:.3f}"
            f" n={len(f['rtt'])} | connect median_ms={summary[f'connect_ms_{path}']:.3f}"
            f" | download MB/s={summary[f'download_MBps_{path}']:.0f}"
            f" upload MB/s={summary[f'upload_MBps_{path}']:.0f} ({size >> 20} MiB x{rounds})"
        )
    if "direct" in figures:
        for path in figures:
            if path != "direct":
                summary[f"rtt_added_ms_{path}"] = (
                    summary[f"rtt_ms_{path}"] - summary["rtt_ms_direct"]
                )
    lines.append(
        " ".join(f"{k}={v:.3f}" if "ms" in k else f"{k}={v:.0f}" for k, v in summary.items())
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="round trips per path")
    parser.add_argument("--rounds", type=int, default=5, help="turns the paths take")
    parser.add_argument("--mib", type=int, default=256, help="MiB per download and upload")
    parser.add_argument("--service", action="store_true", help="also a sandbox and the proxy route")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(json.loads(args.child)))
        return 0
    size = args.mib * 1024 * 1024
    with (
        tempfile.TemporaryDirectory(prefix="sandman-bench-") as tmp,
        _host_servers(Path(tmp) / "srv", args.mib) as ports,
        _host_daemon(Path(tmp)) as (sock, tcp_port),
        _tunnels({"kind": "daemon", "uds": sock, "tcp_port": tcp_port, "ports": ports}) as host,
        contextlib.ExitStack() as stack,
    ):
        paths = {"direct": {s: ("127.0.0.1", p) for s, p in ports.items()}, **host}
        if args.service:
            paths.update(stack.enter_context(_service_tunnels(args.mib)))
        print(measure(paths, args.n, args.rounds, size))
    return 0


@contextlib.contextmanager
def _service_tunnels(mib: int) -> Iterator[dict[str, dict[str, Address]]]:
    """``sandman serve`` on the local provider (started from a thread's loop), a sandbox
    in it, its ports exposed by a child."""
    from _service import local_service

    box: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()

    async def run() -> None:
        try:
            async with local_service() as service:
                box["spec"] = {"kind": "service", "url": service.url, "key": service.api_key,
                               "mib": mib}  # fmt: skip
                started.set()
                await asyncio.to_thread(done.wait)
        finally:
            started.set()

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    started.wait()
    try:
        if "spec" not in box:
            raise RuntimeError("sandman serve did not start")
        with _tunnels(box["spec"]) as paths:
            yield paths
    finally:
        done.set()
        thread.join(180)


if __name__ == "__main__":
    sys.exit(main())
