"""Example: prepare a task once, fork it into a GRPO group, score each rollout.

A GRPO step samples several answers to one task. Each needs the task's environment as it
is after setup (a checkout, installed dependencies); preparing it once and forking it
costs one setup instead of one per rollout. Forks share the prepared files
copy-on-write: each writes only what it changes.

Run as root: ``.venv/bin/python examples/grpo_fork.py`` (it builds a tiny busybox image).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import sandman
from sandman.images.busybox import busybox_rootfs_tar
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig

SETUP = "mkdir -p /task && cd /task && echo 'def add(a, b): return a - b' > solution.py"
ANSWERS = [  # what each "policy sample" writes: only some fix the bug
    "sed -i 's/a - b/a + b/' solution.py",
    "sed -i 's/a - b/b - a/' solution.py",
    "sed -i 's/a - b/a + b/' solution.py",
    "true",
]
TEST = "grep -q 'return a + b' /task/solution.py && echo PASS || echo FAIL"


async def main(state_dir: Path) -> None:
    config = LocalConfig(state_dir=state_dir)
    provider = LocalProvider(config)
    with tempfile.TemporaryDirectory() as tmp:
        await provider.images.import_archive(busybox_rootfs_tar(Path(tmp) / "bb.tar"), name="task")
    async with sandman.local(config) as client, client.sandbox("task", memory="128Mi") as prepared:
        await prepared.exec(SETUP, check=True)  # once, however many rollouts
        group = await prepared.fork(len(ANSWERS))

        async def rollout(sb: sandman.AsyncSandbox, answer: str) -> float:
            await sb.exec(f"cd /task && {answer}", check=True)
            verdict = await sb.exec(TEST)
            return 1.0 if verdict.stdout.strip() == "PASS" else 0.0

        try:
            rewards = await asyncio.gather(
                *(rollout(sb, a) for sb, a in zip(group, ANSWERS, strict=True))
            )
        finally:
            await asyncio.gather(*(sb.release() for sb in group))
        print(f"rewards of the group: {rewards}")
        untouched = await prepared.exec("cat /task/solution.py")
        print(f"the prepared sandbox is as it was: {untouched.stdout.strip()}")
    snapshots, sandboxes = await provider.snapshots(), await provider.list()
    print(f"snapshots left: {len(snapshots)}, sandboxes left: {len(sandboxes)}")
    await provider.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/sandman"))
    asyncio.run(main(parser.parse_args().state_dir))
