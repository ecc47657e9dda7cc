"""Demo: real sandboxes on this machine with the local provider (crun + overlayfs).

Builds a tiny image from the host's static busybox, imports it, starts two
sandboxes from it, runs commands and file operations in them, keeps a
background process across calls, shows that the two are isolated, and
deletes them, leaving nothing behind.

Run as root: ``bash scripts/demo`` (or ``.venv/bin/python examples/local_demo.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from sandman.images.busybox import busybox_rootfs_tar
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig


async def tour(state_dir: Path) -> None:
    provider = LocalProvider(LocalConfig(state_dir=state_dir))
    with tempfile.TemporaryDirectory() as tmp:
        tar = busybox_rootfs_tar(Path(tmp) / "busybox.tar")
        image = await provider.images.import_archive(tar, name="demo-busybox")
    print(f"image demo-busybox: {image.short_id}, {image.size / 2**20:.1f} MiB unpacked")

    spec = SandboxSpec(image="demo-busybox", cpu=0.5, memory="128Mi", pids=64)
    started = time.perf_counter()
    first, second = await asyncio.gather(provider.create(spec), provider.create(spec))
    created: list[str] = [first.id, second.id]
    try:
        assert first.endpoint is not None and second.endpoint is not None
        async with first.endpoint.client() as a, second.endpoint.client() as b:
            await asyncio.gather(a.wait_ready(10), b.wait_ready(10))
            elapsed = (time.perf_counter() - started) * 1e3
            print(f"two sandboxes ready in {elapsed:.0f} ms: {first.id}, {second.id}")

            result = await a.exec(
                "echo hello from $(hostname); id; cat /proc/1/cmdline | tr '\\0' ' '"
            )
            print(f"$ exec in {first.id} -> exit {result.exit_code}:")
            for line in result.stdout.splitlines():
                print(f"    {line}")

            await a.write_file("/root/solution.sh", "echo the answer is $((6 * 7))\n")
            answer = await a.exec(["sh", "/root/solution.sh"])
            print(f"$ wrote /root/solution.sh and ran it: {answer.stdout.strip()}")

            ticker = await a.spawn("i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.1; done")
            await asyncio.sleep(0.35)
            out = await a.read_output(ticker.id)
            print(f"$ background process {ticker.id} still running, said: {out.stdout.split()[:6]}")

            shell = await a.create_shell()
            await a.run_in_shell(shell.id, "cd /tmp && export TASK=demo", check=True)
            here = await a.run_in_shell(shell.id, "echo $PWD $TASK")
            print(f"$ a shell remembers cd and export: {here.stdout.strip()}")

            seen = await b.exists("/root/solution.sh")
            procs = (await b.exec(["ps", "-o", "pid,comm"])).stdout.split("\n")[1:]
            print(
                f"$ {second.id} sees the file: {seen}; its processes: {[p.strip() for p in procs if p]}"
            )

            limit = await a.exec("x=$(head -c 300000000 /dev/zero | tr '\\0' a); echo survived")
            print(
                f"$ a 300 MB memory hog under a 128 MiB limit: exit {limit.exit_code} (OOM-killed)"
            )
    finally:
        await asyncio.gather(*(provider.delete(sid) for sid in created))
        await provider.aclose()  # unmounts the state dir's disk filesystem
    left = await provider.list()
    print(f"deleted both; sandboxes left: {len(left)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/sandman"))
    args = parser.parse_args()
    asyncio.run(tour(args.state_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
