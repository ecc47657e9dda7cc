"""sandman.testing.FakeProvider: every fault, a real daemon end to end, and nothing left behind."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sandman
import sandman.testing
from sandman.models import SandboxSpec
from sandman.providers.base import Provider, SandboxInfo
from sandman.testing import FakeProvider, Faults
from tests.support import alive, eventually

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image="task")


def _processes_under(directory: Path) -> list[int]:
    """Live processes whose command line or working directory is in ``directory``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if (str(directory).encode() in cmdline or cwd.startswith(str(directory))) and alive(
            int(entry.name)
        ):
            found.append(int(entry.name))
    return found


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A short state directory; no process may use it once the test is over."""
    path = Path(tempfile.mkdtemp(prefix="sf-", dir="/tmp"))
    try:
        yield path
        assert not _processes_under(path)
    finally:
        for pid in _processes_under(path):
            os.kill(pid, 9)
        shutil.rmtree(path, ignore_errors=True)


def test_satisfies_the_provider_protocol() -> None:
    provider: Provider = FakeProvider(daemon=False)  # checked by mypy
    assert provider.name == "fake"


# -- a real daemon -------------------------------------------------------------


async def test_end_to_end_with_a_real_daemon(state_dir: Path) -> None:
    async with FakeProvider(state_dir=state_dir) as provider:
        spec = SandboxSpec(image="task", env={"GREETING": "hello"})
        info = await provider.create(spec, labels={"pool": "p"})
        assert (info.provider, info.state, info.image) == ("fake", "running", "task")
        assert info.endpoint is not None and info.endpoint.uds is not None
        assert len(os.fsencode(info.endpoint.uds)) < 100
        pid = provider.daemon_pid(info.id)
        assert pid is not None and alive(pid)
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=10)
            result = await client.exec(["echo", "hi"])
            assert (result.exit_code, result.stdout) == (0, "hi\n")
            assert (await client.exec("echo $GREETING")).stdout == "hello\n"
            # A background process in a process group of its own dies with the sandbox too.
            background = await client.spawn(["sleep", "1000"])
        assert alive(background.pid)
        await provider.delete(info.id)
        assert not alive(pid) and not alive(background.pid)
        assert not Path(info.endpoint.uds).exists()
        assert list(state_dir.iterdir()) == []
        with pytest.raises(sandman.SandboxNotFound):
            await provider.inspect(info.id)
        assert (provider.live, provider.created_total, provider.deleted_total) == (0, 1, 1)
        assert provider.calls == [("create", info.id), ("delete", info.id), ("inspect", info.id)]


async def test_ready_latency_is_observed_with_wait_ready(state_dir: Path) -> None:
    async with FakeProvider(faults=Faults(ready_latency=0.4), state_dir=state_dir) as provider:
        started = time.monotonic()
        info = await provider.create(SPEC)
        assert time.monotonic() - started < 0.3
        assert info.state == "running" and info.endpoint is not None
        assert provider.daemon_pid(info.id) is None
        async with info.endpoint.client() as client:
            with pytest.raises(sandman.DaemonUnavailable):
                await client.health()
            await client.wait_ready(timeout=10)
            assert time.monotonic() - started >= 0.35
        await provider.delete(info.id)
        assert provider.live == 0


async def test_default_state_dir_is_short_and_removed_by_aclose() -> None:
    provider = FakeProvider()
    info = await provider.create(SPEC)
    assert info.endpoint is not None and info.endpoint.uds is not None
    assert len(os.fsencode(info.endpoint.uds)) < 100
    directory = Path(info.endpoint.uds).parent
    await provider.aclose()
    assert not directory.exists() and not _processes_under(directory)
    await provider.delete(info.id)
    assert provider.live == 0 and not directory.exists()


async def test_a_long_state_dir_is_refused(tmp_path: Path) -> None:
    async with FakeProvider(state_dir=tmp_path / ("x" * 100)) as provider:
        with pytest.raises(sandman.ConfigError, match="longer than"):
            await provider.create(SPEC)
        assert provider.live == 0 and provider.calls == []


async def test_relabel_merges_and_removes_labels() -> None:
    async with FakeProvider(daemon=False) as provider:
        info = await provider.create(SPEC, labels={"a": "1", "b": "2"})
        await provider.relabel(info.id, {"a": None, "c": "3"})
        assert (await provider.inspect(info.id)).labels == {"b": "2", "c": "3"}
        assert [i.id for i in await provider.list(labels={"c": "3"})] == [info.id]
        await provider.delete(info.id)
        with pytest.raises(sandman.SandboxNotFound):
            await provider.relabel(info.id, {"a": "1"})


# -- faults on create ------------------------------------------------------------


async def test_creates_run_concurrently_and_take_create_latency() -> None:
    async with FakeProvider(faults=Faults(create_latency=0.2), daemon=False) as provider:
        started = time.monotonic()
        infos = await asyncio.gather(*(provider.create(SPEC) for _ in range(20)))
        elapsed = time.monotonic() - started
        assert 0.2 <= elapsed < 1.0
        assert provider.max_concurrent_creates == 20 and provider.creating == 0
        assert provider.live == 20 and len({info.id for info in infos}) == 20
        assert all(info.endpoint is None and info.state == "running" for info in infos)
        await asyncio.gather(*(provider.delete(info.id) for info in infos))
        assert provider.live == 0


async def test_fail_create_records_nothing_and_leaves_nothing(state_dir: Path) -> None:
    async with FakeProvider(faults=Faults(fail_create=1.0), state_dir=state_dir) as provider:
        with pytest.raises(sandman.ProviderError) as failed:
            await provider.create(SPEC, sandbox_id="sb-1")
        assert type(failed.value) is sandman.ProviderError
        assert provider.live == 0 and provider.created_total == 0
        assert await provider.list() == []
        assert provider.calls[0] == ("create", "sb-1")
        assert list(state_dir.iterdir()) == []


async def test_throttle_raises_a_retryable_error_with_retry_after() -> None:
    faults = Faults(throttle=1.0, throttle_retry_after=0.25)
    async with FakeProvider(faults=faults, daemon=False) as provider:
        with pytest.raises(sandman.ThrottledError) as throttled:
            await provider.create(SPEC)
        assert throttled.value.retryable and throttled.value.retry_after == 0.25
        assert isinstance(throttled.value, sandman.ProviderError)
        faults.throttle_retry_after = None
        with pytest.raises(sandman.ThrottledError) as throttled:
            await provider.create(SPEC)
        assert throttled.value.retry_after is None
        assert provider.live == 0 and provider.max_concurrent_creates == 0


async def test_capacity_counts_held_sandboxes_and_creates_in_flight() -> None:
    faults = Faults(capacity=2, create_latency=0.05)
    async with FakeProvider(faults=faults, daemon=False) as provider:
        results = await asyncio.gather(
            *(provider.create(SPEC) for _ in range(3)), return_exceptions=True
        )
        held = [r for r in results if isinstance(r, SandboxInfo)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(held) == 2 and len(refused) == 1
        assert isinstance(refused[0], sandman.CapacityError) and refused[0].retryable
        assert provider.live == 2
        with pytest.raises(sandman.CapacityError):
            await provider.create(SPEC)
        await provider.delete(held[0].id)
        await provider.create(SPEC)
        assert provider.live == 2


async def test_image_errors_fail_at_once_and_are_permanent() -> None:
    faults = Faults(image_errors=frozenset({"broken"}), create_latency=5.0)
    async with FakeProvider(faults=faults, daemon=False) as provider:
        with pytest.raises(sandman.ImageError) as failed:
            await asyncio.wait_for(provider.create(SandboxSpec(image="broken")), 1.0)
        assert not failed.value.retryable
        faults.create_latency = 0.0
        await provider.create(SPEC)
        assert provider.live == 1


async def test_a_failed_create_may_leave_a_listed_leftover(state_dir: Path) -> None:
    faults = Faults(fail_create=1.0, leak_on_fail=1.0)
    async with FakeProvider(faults=faults, state_dir=state_dir) as provider:
        with pytest.raises(sandman.ProviderError):
            await provider.create(SPEC, sandbox_id="sb-leak", labels={"sandman.io/pool": "p"})
        (leftover,) = await provider.list(labels={"sandman.io/pool": "p"})
        assert leftover.id == "sb-leak" and leftover.state == "running"
        assert leftover.labels == {"sandman.io/pool": "p"}
        assert provider.live == 1 and provider.created_total == 1
        # Like a pod made by a timed-out call, it is really running.
        assert leftover.endpoint is not None
        async with leftover.endpoint.client() as client:
            await client.wait_ready(timeout=10)
        await provider.delete(leftover.id)
        assert provider.live == 0 and await provider.list() == []


async def test_a_cancelled_create_leaves_nothing(state_dir: Path) -> None:
    faults = Faults(create_latency=10.0)
    async with FakeProvider(faults=faults, state_dir=state_dir) as provider:
        task = asyncio.create_task(provider.create(SPEC, labels={"pool": "p"}))
        await eventually(lambda: provider.creating == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert provider.live == 0 and provider.creating == 0 and provider.created_total == 0
        assert await provider.list() == []
        assert not _processes_under(state_dir) and list(state_dir.iterdir()) == []


async def test_a_cancelled_create_with_leak_on_fail_leaves_a_leftover(state_dir: Path) -> None:
    faults = Faults(create_latency=10.0, leak_on_fail=1.0)
    async with FakeProvider(faults=faults, state_dir=state_dir) as provider:
        task = asyncio.create_task(provider.create(SPEC, labels={"pool": "p"}))
        await eventually(lambda: provider.creating == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (leftover,) = await provider.list(labels={"pool": "p"})
        await eventually(lambda: provider.daemon_pid(leftover.id) is not None)
        await provider.delete(leftover.id)
        assert provider.live == 0 and not _processes_under(state_dir)


async def test_faults_can_change_mid_run() -> None:
    async with FakeProvider(daemon=False) as provider:
        await provider.create(SPEC)
        provider.faults.fail_create = 1.0
        with pytest.raises(sandman.ProviderError):
            await provider.create(SPEC)
        provider.faults = Faults()
        await provider.create(SPEC)
        assert provider.live == 2


def test_faults_are_checked() -> None:
    with pytest.raises(sandman.ConfigError):
        Faults(fail_create=1.5)
    with pytest.raises(sandman.ConfigError):
        Faults(capacity=-1)


async def test_taken_and_invalid_ids_are_refused() -> None:
    async with FakeProvider(daemon=False) as provider:
        await provider.create(SPEC, sandbox_id="sb-1")
        with pytest.raises(sandman.ConfigError, match="already exists"):
            await provider.create(SPEC, sandbox_id="sb-1")
        with pytest.raises(sandman.ConfigError, match="invalid"):
            await provider.create(SPEC, sandbox_id="Not/An/Id")
        assert provider.live == 1


# -- delete, list, inspect -----------------------------------------------------------


async def test_delete_is_idempotent(state_dir: Path) -> None:
    async with FakeProvider(state_dir=state_dir) as provider:
        info = await provider.create(SPEC)
        pid = provider.daemon_pid(info.id)
        assert pid is not None
        await asyncio.gather(*(provider.delete(info.id) for _ in range(3)))
        assert not alive(pid)
        await provider.delete(info.id)
        await provider.delete("never-existed")
        assert (provider.live, provider.deleted_total) == (0, 1)
        assert [op for op, _ in provider.calls].count("delete") == 5


async def test_delete_latency() -> None:
    async with FakeProvider(faults=Faults(delete_latency=0.2), daemon=False) as provider:
        info = await provider.create(SPEC)
        started = time.monotonic()
        await provider.delete(info.id)
        assert time.monotonic() - started >= 0.2
        assert provider.live == 0


async def test_fail_delete_keeps_the_sandbox_and_a_retry_may_succeed(state_dir: Path) -> None:
    faults = Faults(fail_delete=1.0)
    async with FakeProvider(faults=faults, state_dir=state_dir) as provider:
        info = await provider.create(SPEC)
        with pytest.raises(sandman.ProviderError):
            await provider.delete(info.id)
        assert (await provider.inspect(info.id)).state == "running"
        assert provider.daemon_pid(info.id) is not None
        faults.fail_delete = 0.0
        await provider.delete(info.id)
        assert provider.live == 0


async def test_list_filters_by_labels() -> None:
    async with FakeProvider(daemon=False) as provider:
        spec = SandboxSpec(image="task", labels={"team": "a"})
        one = await provider.create(spec, labels={"pool": "p1"})
        two = await provider.create(spec, labels={"pool": "p2", "team": "b"})
        assert one.labels == {"team": "a", "pool": "p1"}
        assert two.labels == {"team": "b", "pool": "p2"}
        assert [i.id for i in await provider.list()] == [one.id, two.id]
        assert [i.id for i in await provider.list(labels={})] == [one.id, two.id]
        assert [i.id for i in await provider.list(labels={"team": "a"})] == [one.id]
        assert [i.id for i in await provider.list(labels={"pool": "p2", "team": "b"})] == [two.id]
        assert await provider.list(labels={"pool": "p2", "team": "a"}) == []
        assert await provider.inspect(one.id) == one
        with pytest.raises(sandman.SandboxNotFound):
            await provider.inspect("nope")


# -- lost sandboxes ----------------------------------------------------------------


async def test_lose_now(state_dir: Path) -> None:
    async with FakeProvider(state_dir=state_dir) as provider:
        info = await provider.create(SPEC)
        assert info.endpoint is not None
        pid = provider.daemon_pid(info.id)
        assert pid is not None
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=10)
            provider.lose(info.id)
            lost = await provider.inspect(info.id)
            assert lost.state == "stopped" and lost.endpoint is None
            with pytest.raises(sandman.DaemonUnavailable):
                await client.health()
        await eventually(lambda: not alive(pid))
        assert provider.live == 1 and [i.id for i in await provider.list()] == [info.id]
        with pytest.raises(sandman.SandboxNotFound):
            provider.lose("nope")
        await provider.delete(info.id)
        assert provider.live == 0


async def test_lose_after(state_dir: Path) -> None:
    faults = Faults(lose_after=0.3)
    async with FakeProvider(faults=faults, state_dir=state_dir) as provider:
        info = await provider.create(SPEC)
        pid = provider.daemon_pid(info.id)
        assert info.endpoint is not None and pid is not None
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=10)
            assert (await provider.inspect(info.id)).state == "running"

            async def stopped() -> bool:
                return (await provider.inspect(info.id)).state == "stopped"

            await eventually(stopped, what="the fake to lose the sandbox")
            with pytest.raises(sandman.DaemonUnavailable):
                await client.health()
        await eventually(lambda: not alive(pid))
        await provider.delete(info.id)
        assert provider.live == 0


async def test_lose_after_without_daemons() -> None:
    async with FakeProvider(faults=Faults(lose_after=0.05), daemon=False) as provider:
        infos = [await provider.create(SPEC) for _ in range(5)]

        async def all_stopped() -> bool:
            return {i.state for i in await provider.list()} == {"stopped"}

        await eventually(all_stopped, what="the fake to lose every sandbox")
        for info in infos:
            await provider.delete(info.id)
        assert provider.live == 0


# -- aclose --------------------------------------------------------------------------


async def test_aclose_kills_every_daemon_but_keeps_the_records(state_dir: Path) -> None:
    provider = FakeProvider(faults=Faults(ready_latency=0.05), state_dir=state_dir)
    infos = [await provider.create(SPEC) for _ in range(3)]
    for info in infos:
        assert info.endpoint is not None
        async with info.endpoint.client() as client:
            await client.wait_ready(timeout=10)
            await client.spawn(["sleep", "1000"])
    late = await provider.create(SPEC)  # its daemon has not started yet
    assert len(_processes_under(state_dir)) == 6
    await provider.aclose()
    assert _processes_under(state_dir) == []
    assert provider.live == 4
    assert {i.state for i in await provider.list()} == {"stopped"}
    for info in [*infos, late]:
        await provider.delete(info.id)
    assert provider.live == 0 and provider.deleted_total == 4
    assert list(state_dir.iterdir()) == []


async def test_aclose_forget(state_dir: Path) -> None:
    provider = FakeProvider(state_dir=state_dir)
    await provider.create(SPEC)
    await provider.aclose(forget=True)
    assert provider.live == 0 and provider.deleted_total == 0
    assert _processes_under(state_dir) == []
    # Still usable afterwards.
    info = await provider.create(SPEC)
    assert provider.daemon_pid(info.id) is not None
    await provider.aclose()
    assert _processes_under(state_dir) == []


# -- scale and determinism ----------------------------------------------------------


async def test_many_sandboxes_without_daemons() -> None:
    async with FakeProvider(daemon=False, faults=Faults(create_latency=0.01)) as provider:
        infos = await asyncio.gather(*(provider.create(SPEC) for _ in range(2000)))
        assert provider.live == 2000 and provider.max_concurrent_creates == 2000
        await asyncio.gather(*(provider.delete(info.id) for info in infos))
        assert provider.live == 0 and provider.deleted_total == 2000


async def _scenario(seed: int) -> list[object]:
    faults = Faults(
        throttle=0.2, fail_create=0.3, leak_on_fail=0.5, fail_delete=0.3, create_latency=0.001
    )
    outcome: list[object] = []
    async with FakeProvider(faults=faults, daemon=False, seed=seed) as provider:
        results = await asyncio.gather(
            *(provider.create(SPEC, labels={"n": str(n)}) for n in range(40)),
            return_exceptions=True,
        )
        outcome += [r.id if not isinstance(r, BaseException) else type(r).__name__ for r in results]
        for info in await provider.list():
            try:
                await provider.delete(info.id)
                outcome.append(f"deleted {info.id} {info.labels}")
            except sandman.ProviderError:
                outcome.append(f"kept {info.id}")
        outcome.append(provider.calls)
        outcome.append((provider.live, provider.created_total, provider.deleted_total))
    return outcome


async def test_a_seed_makes_runs_reproducible() -> None:
    first = await _scenario(seed=42)
    assert first == await _scenario(seed=42)
    assert first != await _scenario(seed=43)
    names = set(first[:40])
    assert {"ThrottledError", "ProviderError"} <= {str(n) for n in names}
    assert any(str(n).startswith("fake-") for n in names)
    assert any(str(o).startswith("kept") for o in first)


async def test_the_module_docstring_example_runs() -> None:
    assert sandman.testing.__doc__ is not None
    match = re.search(r"```python\n(.*?)```", sandman.testing.__doc__, re.DOTALL)
    assert match is not None
    namespace: dict[str, Any] = {}
    exec(match[1], namespace)  # noqa: S102 -- our own docstring, run as users would
    await namespace["test_a_flaky_backend"]()


def test_public_surface_is_documented() -> None:
    assert sandman.testing.__all__ == ["FakeProvider", "Faults"]
    for name in sandman.testing.__all__:
        assert getattr(sandman.testing, name).__doc__, name
    for name, member in vars(FakeProvider).items():
        if not name.startswith("_") and callable(member):
            assert member.__doc__, name


async def test_losses_of_watched_sandboxes_are_reported_deletes_are_not() -> None:
    async with FakeProvider(daemon=False) as provider:
        reports = provider.lost()  # sees every report from now on
        deleted = await provider.create(SPEC)
        provider.watch_lost(deleted)
        await provider.delete(deleted.id)
        provider.faults.lose_after = 0.05  # read at each create
        lost, unwatched = [await provider.create(SPEC) for _ in range(2)]
        provider.faults.lose_after = None
        provider.watch_lost(lost)
        async with asyncio.timeout(5):
            report = await anext(reports)
        assert (report.sandbox_id, report.reason) == (lost.id, "node_lost")
        async with asyncio.timeout(5):  # lost too, but nobody asked to hear of it
            while (stopped := await provider.inspect(unwatched.id)).state != "stopped":
                await asyncio.sleep(0.01)
        assert stopped.lost is not None
        assert stopped.lost.reason == "node_lost"
        provider.watch_lost(await provider.create(SPEC))
        later = await provider.create(SPEC)
        provider.watch_lost(later)
        provider.lose(later.id, reason="evicted", detail="fake: a drain")
        async with asyncio.timeout(5):
            report = await anext(reports)
        assert (report.sandbox_id, report.reason, report.detail) == (
            later.id, "evicted", "fake: a drain",
        )  # fmt: skip
        await reports.aclose()
        for info in await provider.list():
            await provider.delete(info.id)
