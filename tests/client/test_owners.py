"""Pools in other processes, killed: who reaps their sandboxes, and who must not."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from sandman.cli import build
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun
from tests.support import alive, until

pytestmark = [needs_root_and_crun, pytest.mark.anyio, pytest.mark.timeout(180)]

POOL = "sandman.io/pool"

HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import sandman
    from sandman.pool import PoolConfig

    async def main() -> None:
        client = sandman.local(state_dir=sys.argv[1], pool=PoolConfig(name=sys.argv[2]))
        held = [await client.acquire("busybox") for _ in range(2)]
        print("holding", *(sb.id for sb in held), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@dataclass
class Holder:
    """A process holding an embedded pool (and its watchdog) with two sandboxes."""

    process: subprocess.Popen[str]
    held: set[str]
    watchdog: int = 0

    def find_watchdog(self) -> int:
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (proc / "stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) != self.process.pid:
                    continue
                if b"sandman.client.watchdog" in (proc / "cmdline").read_bytes():
                    return int(proc.name)
        raise AssertionError(f"no watchdog of {self.process.pid}")

    def kill(self) -> None:
        """SIGKILL the process and all of its process group (not the watchdog: its own session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def holders(local_state: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []

    def _stop() -> None:
        for holder in started:
            holder.kill()
            if holder.process.stdout is not None:
                holder.process.stdout.close()
        # Their watchdogs sweep: done before the state directory is checked and removed.
        until(
            "the watchdogs to finish their sweeps",
            lambda: not any(alive(h.watchdog) for h in started if h.watchdog),
            60,
        )

    try:
        yield started
    finally:
        _stop()


def hold(holders: list[Holder], state: Path, pool: str) -> Holder:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(state), pool],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    holder = Holder(process, set())
    holders.append(holder)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("holding"), line
    holder.held = set(line.split()[1:])
    holder.watchdog = holder.find_watchdog()
    return holder


async def ids(provider: LocalProvider, pool: str | None = None) -> set[str]:
    return {i.id for i in await provider.list() if pool is None or i.labels.get(POOL) == pool}


@pytest.mark.parametrize("reaper", ["gc", "a live pool"])
async def test_a_pool_killed_with_its_watchdog_is_reaped_and_no_other(
    imported: LocalProvider, local_state: Path, holders: list[Holder], reaper: str
) -> None:
    dead_name, live_name = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
    dead = hold(holders, local_state, dead_name)
    live = hold(holders, local_state, live_name)
    # One kill for the process holding the pool and its watchdog: nothing of it runs.
    watchdog = dead.watchdog
    os.kill(watchdog, signal.SIGKILL)
    dead.kill()
    with anyio.fail_after(10):
        while alive(watchdog):
            await anyio.sleep(0.02)
    left = await ids(imported, dead_name)
    assert dead.held <= left
    assert await ids(imported, live_name) == live.held

    if reaper == "gc":
        runner = CliRunner()
        result = await anyio.to_thread.run_sync(
            lambda: runner.invoke(build(), ["--state-dir", str(local_state), "gc"])
        )
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        reaped = {line.split()[1].rstrip(":") for line in lines[:-1]}
        assert reaped == left, result.output
        assert all(f"owner dead (process {dead.process.pid})" in line for line in lines[:-1])
        assert lines[-1] == f"reaped {len(left)} sandbox(es) (owner dead: {len(left)})"
    else:
        async with Pool(imported, PoolConfig(name="third")) as pool:
            with anyio.fail_after(30):
                while await ids(imported) != live.held or pool.list():
                    await anyio.sleep(0.05)
    assert await ids(imported) == live.held
    assert live.process.poll() is None


async def test_a_successor_of_the_same_name_keeps_its_sandboxes_from_the_old_watchdog(
    imported: LocalProvider, local_state: Path, holders: list[Holder]
) -> None:
    name = f"serve-{secrets.token_hex(3)}"
    old = hold(holders, local_state, name)
    new = hold(holders, local_state, name)  # its start did not take the live one's either
    assert await ids(imported, name) == old.held | new.held
    watchdog = old.watchdog
    old.kill()  # not its watchdog, which sweeps
    with anyio.fail_after(30):
        while alive(watchdog):
            await anyio.sleep(0.05)
    assert await ids(imported, name) == new.held
    assert new.process.poll() is None
    new.kill()  # and now its own watchdog sweeps its own
    with anyio.fail_after(30):
        while await ids(imported):
            await anyio.sleep(0.05)
