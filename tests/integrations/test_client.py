"""The adapters' shared client: one per process (or loop) and URL, usable from any loop,
closed with its loop or at exit, and nothing left when the process dies."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from sandman.client import AsyncSandbox
from sandman.integrations._client import (
    close_loop_clients,
    close_shared,
    loop_client,
    resolve_url,
    shared_client,
)
from sandman.providers.local import LocalProvider
from tests.integrations.conftest import assert_gone
from tests.support import until

pytestmark = pytest.mark.integrations


def test_one_client_per_url_until_closed(local_provider: LocalProvider) -> None:
    first = shared_client()
    assert shared_client() is first
    close_shared()
    assert first.closed
    assert shared_client() is not first


def test_the_url_comes_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SANDMAN_URL", raising=False)
    assert resolve_url() is None
    assert resolve_url("http://a") == "http://a"
    monkeypatch.setenv("SANDMAN_URL", "http://b")
    assert resolve_url() == "http://b"
    assert resolve_url("http://a") == "http://a"


def test_a_sandbox_outlives_the_event_loops_that_use_it(local_provider: LocalProvider) -> None:
    # SWE-agent runs each runtime call in its own asyncio.run.
    shared = shared_client()

    async def acquire() -> AsyncSandbox:
        return await shared.run(shared.client.acquire, "busybox")

    sandbox = asyncio.run(acquire())

    async def echo() -> str:
        result = await shared.run(sandbox.exec, "echo hi")
        return result.stdout

    assert asyncio.run(echo()) == "hi\n"
    assert asyncio.run(echo()) == "hi\n"
    assert shared.call(sandbox.exec, "echo sync").stdout == "sync\n"
    asyncio.run(shared.run(sandbox.release))
    assert_gone(local_provider)


def test_cancelling_a_run_cancels_the_call(local_provider: LocalProvider) -> None:
    shared = shared_client()
    sandbox = shared.call(shared.client.acquire, "busybox")

    async def impatient() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await shared.run(sandbox.exec, "sleep 30; echo late > /tmp/late", timeout=60)

    asyncio.run(impatient())
    # The command is killed with the call (the daemon sees the client leave).
    until(
        "the command to be killed", lambda: "sleep 30" not in shared.call(sandbox.exec, "ps").stdout
    )
    shared.call(sandbox.release)


def test_a_loop_client_is_closed_with_its_loop(local_provider: LocalProvider) -> None:
    async def forgetful() -> str:
        client = await loop_client()
        assert await loop_client() is client
        sandbox = await client.acquire("busybox")  # never released
        return sandbox.id

    sandbox_id = asyncio.run(forgetful())
    assert sandbox_id
    assert_gone(local_provider)


def test_loop_clients_closed_early_are_made_again(local_provider: LocalProvider) -> None:
    async def twice() -> None:
        first = await loop_client()
        await first.acquire("busybox")
        await close_loop_clients()
        await asyncio.to_thread(assert_gone, local_provider)
        second = await loop_client()
        assert second is not first
        await second.acquire("busybox")  # closed with the loop in turn

    asyncio.run(twice())
    assert_gone(local_provider)


def test_a_forked_child_makes_its_own_client(local_provider: LocalProvider) -> None:
    shared = shared_client()
    sandbox = shared.call(shared.client.acquire, "busybox")
    read, write = os.pipe()
    with warnings.catch_warnings():  # "multi-threaded, fork may deadlock": what this tests
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: the parent's client has no thread here
        try:
            mine = shared_client()
            child_box = mine.call(mine.client.acquire, "busybox")
            ok = mine is not shared and mine.call(child_box.exec, "echo child").stdout == "child\n"
            close_shared()
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"ok"
    os.waitpid(pid, 0)
    # the parent's client and sandbox are untouched
    assert shared_client() is shared
    assert shared.call(sandbox.exec, "echo parent").stdout == "parent\n"


def test_nothing_is_left_when_the_process_dies(local_provider: LocalProvider) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        from sandman.integrations._client import shared_client
        shared = shared_client()
        sandbox = shared.call(shared.client.acquire, "busybox")
        print(sandbox.id, flush=True)
        os._exit(0)  # no atexit, no close: as if killed
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip()
    assert_gone(local_provider)
