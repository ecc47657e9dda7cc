"""Demo: start sandmand on this machine and drive it through the Python client.

Commands, a persistent shell, a background process, files and an archive,
all through the daemon protocol that every Sandman sandbox speaks. (Until the
local provider lands, the daemon runs on the host, not in a container.)

Run: ``bash scripts/demo``
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from sandman import DaemonClient, daemon_path


def _start(sock: Path, token: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [str(daemon_path()), "--listen", f"unix:{sock}"],
            env={**os.environ, "SANDMAND_TOKEN": token},
            stdout=out,
            stderr=out,
        )
    deadline = time.monotonic() + 10
    while not sock.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"sandmand did not start:\n{log.read_text()}")
        time.sleep(0.005)
    return daemon


async def tour(sock: Path, token: str, workdir: Path) -> None:
    async with DaemonClient(uds=str(sock), token=token) as sb:
        health = await sb.wait_ready(10)  # the socket exists a moment before it listens
        print(f"sandmand {health.version} (protocol {health.protocol}) is up, pid {health.pid}")

        result = await sb.exec("echo hello from $0; uname -s", cwd=str(workdir))
        print(f"$ exec -> exit {result.exit_code} in {result.duration_seconds * 1e3:.1f} ms:",
              result.stdout.strip().replace("\n", " | "))  # fmt: skip

        shell = await sb.create_shell()
        await sb.run_in_shell(shell.id, f"cd {workdir} && export TASK=demo", check=True)
        here = await sb.run_in_shell(shell.id, "echo $PWD $TASK")
        print(f"$ a shell remembers cd and export: {here.stdout.strip()}")

        await sb.write_file(str(workdir / "solution.py"), "print(sum(range(10)))\n")
        run = await sb.exec(["python3", "solution.py"], cwd=str(workdir))
        print(f"$ wrote solution.py and ran it: {run.stdout.strip()}")

        server = await sb.spawn("for i in 1 2 3; do echo tick $i; sleep 0.1; done")
        await sb.wait(server.id, timeout=10)
        out = await sb.read_output(server.id)
        print(f"$ background process {server.id} said: {out.stdout.split()}")

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = b"def test_ok():\n    assert True\n"
            info = tarfile.TarInfo("tests/test_ok.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        unpacked = await sb.upload_archive(str(workdir / "repo"), buf.getvalue())
        listing = [e.name for e in await sb.list_dir(str(workdir / "repo" / "tests"))]
        print(f"$ uploaded an archive: {unpacked.files} file(s) -> {listing}")

        async with sb.exec_stream("for i in 1 2 3; do echo line $i; done") as events:
            async for event in events:
                if event.event == "exit":
                    print(f"$ streamed command exited {event.exit_code}")
                else:
                    print(f"  [{event.event}] {event.data.strip()}")


def main() -> int:
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="sandman-demo-") as tmp:
        sock = Path(tmp) / "sandmand.sock"
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        daemon = _start(sock, token, Path(tmp) / "sandmand.log")
        try:
            asyncio.run(tour(sock, token, workdir))
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=15)
        print(f"sandmand stopped (exit {code}); nothing left behind in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
