"""A client whose session expired opens a new one and carries on, saying what was lost
(issue 14, item 5): embedded, remote, and a client process stopped past its lease."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import sandman
from sandman.client import AsyncClient, InProcessBackend
from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.providers.local import LocalProvider
from sandman.testing import FakeProvider
from tests.providers.local.conftest import needs_root_and_crun
from tests.server.conftest import KEY_A, serve
from tests.support import eventually

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider(daemon=True, seed=11) as provider:
        yield provider


def replaced(events: list[PoolEvent]) -> list[PoolEvent]:
    return [e for e in events if e.name == "session.replaced"]


async def test_an_acquire_in_an_expired_session_goes_on_in_a_new_one(
    fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[PoolEvent] = []
    async with Pool(fake, PoolConfig(name="t", lease=0.3)) as pool:
        # No heartbeat comes in time: the pool expires the session.
        client = AsyncClient(InProcessBackend(pool, own_pool=False), heartbeat_interval=3600,
                             hook=events.append)  # fmt: skip
        async with client:
            old = client.session
            held = await client.acquire("task", timeout=20)
            await eventually(lambda: pool.stats()["sessions"] == 0)
            with caplog.at_level("WARNING", logger="sandman.client"):
                sb = await client.acquire("task", timeout=20)
            assert (await sb.exec("echo again")).stdout == "again\n"
            new = client.session
            assert new is not None and new != old
            (event,) = replaced(events)
            assert (event.session, event.pool) == (new, "t")
            assert event.detail == {"old_session": old, "lost": [held.id], "reason": "acquire"}
            assert f"session {old} expired" in caplog.text and held.id in caplog.text
            with pytest.raises(sandman.SandboxNotFound, match="expired"):
                await held.exec("true")
            await held.release()  # still fine: idempotent
            assert [r.id for r in pool.list(session=new)] == [sb.id]
        await eventually(lambda: fake.live == 0)


async def test_a_heartbeat_that_finds_the_session_gone_replaces_it(fake: FakeProvider) -> None:
    events: list[PoolEvent] = []
    async with Pool(fake, PoolConfig(name="t")) as pool:
        client = AsyncClient(InProcessBackend(pool, own_pool=False), heartbeat_interval=0.05,
                             hook=events.append)  # fmt: skip
        async with client:
            async with client.sandbox("task", timeout=20):
                old = client.session
                assert old is not None
                pool.close_session(old)  # ended behind the client's back
                await eventually(lambda: bool(replaced(events)))
            (event,) = replaced(events)
            assert event.detail["reason"] == "heartbeat" and event.session == client.session
            assert client.session is not None
            pool.heartbeat(client.session)  # the new one is alive
            await eventually(lambda: fake.live == 0)
            async with client.sandbox("task", timeout=20) as sb:
                assert (await sb.exec("true")).exit_code == 0
            assert len(replaced(events)) == 1
        await eventually(lambda: fake.live == 0)


async def test_a_closed_client_does_not_open_a_session_again(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t", lease=0.3)) as pool:
        client = AsyncClient(InProcessBackend(pool, own_pool=False), heartbeat_interval=3600)
        await client.acquire("task", timeout=20)
        await eventually(lambda: pool.stats()["sessions"] == 0)
        await client.aclose()
        with pytest.raises(sandman.PoolClosed):
            await client.acquire("task", timeout=20)
        assert pool.stats()["sessions"] == 0


async def test_a_remote_client_whose_session_expired_goes_on() -> None:
    events: list[PoolEvent] = []
    with serve(pool_config=PoolConfig(name="served", lease=0.5)) as served:
        client = sandman.connect(served.url, api_key=KEY_A, heartbeat_interval=3600,
                                 hook=events.append)  # fmt: skip
        async with client:
            held = await client.acquire("task", timeout=20)
            old = client.session
            await eventually(lambda: served.pool.stats()["sessions"] == 0)
            async with client.sandbox("task", timeout=20) as sb:
                assert (await sb.exec("echo remote")).stdout == "remote\n"
            (event,) = replaced(events)
            assert event.pool == served.url and event.detail["old_session"] == old
            assert event.detail["lost"] == [held.id] and event.session == client.session
            with pytest.raises(sandman.SandboxNotFound):
                await held.exec("true")


@pytest.mark.timeout(60)
def test_the_sync_client_goes_on_too() -> None:
    events: list[PoolEvent] = []
    with (
        serve(pool_config=PoolConfig(name="served", lease=0.5)) as served,
        sandman.connect_sync(
            served.url, api_key=KEY_A, heartbeat_interval=3600, hook=events.append
        ) as client,
    ):
        assert client.session is None
        with client.sandbox("task", timeout=20):
            old = client.session
        deadline = time.monotonic() + 20
        while served.run(_sessions(served.pool)):
            assert time.monotonic() < deadline, "the session did not expire"
            time.sleep(0.01)
        with client.sandbox("task", timeout=20) as sb:
            assert sb.exec(["echo", "sync"]).stdout == "sync\n"
        assert client.session not in (None, old)
        assert [e.detail["old_session"] for e in replaced(events)] == [old]


async def _sessions(pool: Pool) -> float:
    return pool.stats()["sessions"]


# -- a client process stopped (SIGSTOP) for longer than its lease ---------------------

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import sandman
    from sandman.pool import PoolConfig

    async def main() -> None:
        events = []
        if sys.argv[1] == "remote":
            client = sandman.connect(sys.argv[2], api_key=sys.argv[3], heartbeat_interval=0.2,
                                     hook=events.append)
        else:
            client = sandman.local(state_dir=sys.argv[2], heartbeat_interval=0.2,
                                   pool=PoolConfig(name=sys.argv[3], lease=1.0),
                                   hook=events.append)
        async with client:
            held = await client.acquire(sys.argv[4], timeout=60)
            print("holding", held.id, client.session, flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # the test stopped us meanwhile
            async with client.sandbox(sys.argv[4], timeout=60) as sb:
                out = (await sb.exec(["echo", "alive"])).stdout.strip()
            try:
                await held.exec(["true"])
                old = "usable"
            except sandman.SandboxNotFound:
                old = "lost"
            names = [e.name for e in events if e.name == "session.replaced"]
            print("acquired", out, client.session, old, len(names), flush=True)

    asyncio.run(main())
    """
)


@contextlib.contextmanager
def child(*args: str) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, start_new_session=True, env=env,
    )  # fmt: skip
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


async def readline(process: subprocess.Popen[str], timeout: float = 60) -> list[str]:
    assert process.stdout is not None
    async with asyncio.timeout(timeout):
        return (await asyncio.to_thread(process.stdout.readline)).split()


def resume_and_ask(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGCONT)
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


@pytest.mark.timeout(120)
async def test_a_remote_client_stopped_past_its_lease_acquires_again() -> None:
    with serve(pool_config=PoolConfig(name="served", lease=1.0)) as served, child(
        "remote", served.url, KEY_A, "task"
    ) as process:  # fmt: skip
        holding, _, old = await readline(process)
        assert holding == "holding"
        os.kill(process.pid, signal.SIGSTOP)
        # Stopped: no heartbeat; the service ends the session once its lease passes.
        await eventually(lambda: served.pool.stats()["sessions"] == 0, timeout=30)
        await eventually(lambda: served.provider.live == 0, timeout=30)
        resume_and_ask(process)
        acquired, out, new, was, count = await readline(process)
        assert (acquired, out, was, count) == ("acquired", "alive", "lost", "1")
        assert new != old
        assert process.wait(30) == 0
        await eventually(lambda: served.provider.live == 0, timeout=30)


@needs_root_and_crun
@pytest.mark.timeout(180)
async def test_an_embedded_client_stopped_past_its_lease_acquires_again(
    imported: LocalProvider, local_state: Path
) -> None:
    """Its pool stood still with it: the stall does not count against the lease, so the
    session, and the sandbox it holds, carry on (issue 14, item 5, first half)."""
    pool = f"stop-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    with child("local", str(local_state), pool, "busybox") as process:
        holding, _, old = await readline(process, timeout=120)
        assert holding == "holding"
        os.kill(process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        # Nothing to observe while it is stopped: let three leases pass.
        await eventually(lambda: time.monotonic() - stopped > 3.0, timeout=10)
        resume_and_ask(process)
        acquired, out, new, was, count = await readline(process, timeout=120)
        assert (acquired, out) == ("acquired", "alive")
        # Nothing was lost; had the session expired all the same, it was replaced.
        assert (new, was, count) == (old, "usable", "0") or (was, count) == ("lost", "1")
        assert process.wait(60) == 0
