"""The SDK on the embedded pool and the real local provider."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent
from sandman.settings import LocalConfig
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = needs_root_and_crun


@pytest.mark.anyio
async def test_async_client_end_to_end(
    imported: LocalProvider, local_state: Path, tmp_path: Path
) -> None:
    async with (
        sandman.local(state_dir=local_state) as client,
        client.sandbox("busybox", cpu=0.5, memory="128Mi") as sb,
    ):
        result = await sb.exec("echo hi from $(hostname)")
        assert result.stdout == f"hi from {sb.id}\n"
        assert (await sb.exec(["true"])).ok
        await sb.write_file("/root/a.txt", "persisted")
        assert await sb.read_file("/root/a.txt") == b"persisted"

        proc = await sb.spawn("echo started; sleep 1000")
        assert (await sb.poll(proc.id)).running
        out = await sb.read_output(proc.id, wait=5)
        assert "started" in out.stdout

        shell = await sb.create_shell()
        await sb.run_in_shell(shell.id, "cd /tmp && export X=1", check=True)
        assert (await sb.run_in_shell(shell.id, "echo $PWD $X")).stdout == "/tmp 1\n"

        local_dir = tmp_path / "up"
        (local_dir / "sub").mkdir(parents=True)
        (local_dir / "sub" / "f.txt").write_text("tree")
        await sb.upload(local_dir, "/work")
        assert await sb.read_file("/work/sub/f.txt") == b"tree"
        await sb.download("/work", tmp_path / "down")
        assert (tmp_path / "down" / "sub" / "f.txt").read_text() == "tree"

        async with sb.exec_stream("echo a; echo b") as events:
            kinds = [event.event async for event in events]
        assert kinds[-1] == "exit"

        timeline = await sb.timeline()
        assert list(timeline) == [
            "queued", "create_called", "accepted", "running", "daemon_ready", "handed_out",
        ]  # fmt: skip
    assert await imported.list() == []


@pytest.mark.anyio
async def test_every_local_setting_reaches_the_provider(
    imported: LocalProvider, local_state: Path
) -> None:
    parent = f"/sandman-test/entry-{os.getpid()}"
    client = sandman.local(state_dir=local_state, cgroup_parent=parent, disk=None)
    try:
        async with client, client.sandbox("busybox") as sb:
            assert (await sb.exec("true")).ok
            assert Path(f"/sys/fs/cgroup/memory{parent}/{sb.id}").is_dir()
    finally:
        remove_cgroup_parent(parent)  # even when the test fails
    with pytest.raises(sandman.ConfigError, match="cgroup_parent"):
        sandman.local(state_dir=local_state, cgroup_parent="no leading slash")
    with pytest.raises(sandman.ConfigError, match="not both"):
        sandman.local(LocalConfig(state_dir=local_state), runtime="runc")
    with pytest.raises(sandman.ConfigError, match="no_such_setting"):
        sandman.kubernetes(no_such_setting=1)


@pytest.mark.anyio
async def test_command_failure_is_data_and_a_lost_sandbox_is_an_exception(
    imported: LocalProvider, local_state: Path
) -> None:
    async with sandman.local(state_dir=local_state) as client:
        sb = await client.acquire("busybox")
        assert (await sb.exec("exit 3")).exit_code == 3
        with pytest.raises(sandman.CommandFailed):
            await sb.exec("exit 3", check=True)
        await imported.delete(sb.id)  # evicted from outside
        with pytest.raises(sandman.SandboxNotFound):
            await sb.exec(["true"])
        await sb.release()
        with pytest.raises(sandman.CreateTimeout):
            await client.acquire("busybox", timeout=0.001)
        with pytest.raises(sandman.ImageError):
            await client.acquire("no-such-image")


@pytest.mark.anyio
async def test_a_daemon_killed_from_the_host_is_a_lost_sandbox_and_freed_at_once(
    imported: LocalProvider, local_state: Path
) -> None:
    async with sandman.local(state_dir=local_state) as client:
        sb = await client.acquire("busybox")
        other = await client.acquire("busybox")
        await sb.spawn("sleep 1000")
        pid = int((local_state / "sandboxes" / sb.id / "pid").read_text())
        os.kill(pid, signal.SIGKILL)
        # The pool hears of it at once and frees its container, cgroups and directory
        # while the holder still holds it (before any reconcile pass: 15 s).
        with anyio.fail_after(10):
            while sb.id in {info.id for info in await imported.list()}:
                await anyio.sleep(0.01)
        with pytest.raises(sandman.SandboxLost, match="SIGKILL") as lost:
            await sb.exec(["true"])
        assert lost.value.reason == "killed"
        assert isinstance(lost.value, sandman.SandboxNotFound)
        with pytest.raises(sandman.SandboxLost):
            await sb.read_file("/etc/hostname")  # every call says so
        await sb.release()
        assert (await other.exec(["true"])).exit_code == 0  # its neighbour lives on
        assert [info.id for info in await imported.list()] == [other.id]


def test_sync_client(imported: LocalProvider, local_state: Path) -> None:
    with sandman.local_sync(state_dir=local_state) as client, client.sandbox("busybox") as sb:
        assert sb.exec(["echo", "sync"]).stdout == "sync\n"
        sb.write_file("/root/s", "x")
        assert sb.read_file("/root/s") == b"x"
        with sb.exec_stream("echo streamed") as events:
            assert [e.data for e in events if e.event == "stdout"] == ["streamed\n"]


def _public(cls: type) -> dict[str, inspect.Signature]:
    members = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or isinstance(member, property):
            continue
        members[name] = inspect.signature(member)
    return members


@pytest.mark.parametrize(
    ("async_cls", "sync_cls"),
    [(sandman.AsyncSandbox, sandman.Sandbox), (sandman.AsyncClient, sandman.Client)],
)
def test_both_faces_have_the_same_signatures(async_cls: type, sync_cls: type) -> None:
    rename = {"aclose": "close"}
    async_members = {rename.get(k, k): v for k, v in _public(async_cls).items()}
    sync_members = _public(sync_cls)
    assert async_members.keys() == sync_members.keys()
    for name, signature in async_members.items():
        assert list(signature.parameters) == list(sync_members[name].parameters), name
        for param, spec in signature.parameters.items():
            assert spec.default == sync_members[name].parameters[param].default, (name, param)


def test_a_sandbox_speaks_its_daemons_vocabulary() -> None:
    # One vocabulary: a sandbox has every call of its daemon's client (but the
    # connection's own), with the same parameters and words.
    daemon = _public(sandman.DaemonClient)
    sandbox = _public(sandman.AsyncSandbox)
    assert daemon.keys() - {"aclose", "wait_ready"} <= sandbox.keys()
    own = {
        "release",
        "timeline",
        "usage",
        "snapshot",
        "fork",
        "restore",
        "pause",
        "resume",
        "set_egress",
    }
    assert sandbox.keys() - daemon.keys() == own
    for name in daemon.keys() & sandbox.keys():
        assert daemon[name] == sandbox[name], name
        assert getattr(sandman.AsyncSandbox, name).__doc__, name
        assert getattr(sandman.Sandbox, name).__doc__ == getattr(sandman.DaemonClient, name).__doc__


KILLED = textwrap.dedent(
    """
    import asyncio, sys
    import sandman

    async def main() -> None:
        client = sandman.local(state_dir=sys.argv[1])
        held = [await client.acquire("busybox") for _ in range(2)]
        # More being created while we die:
        pending = [asyncio.ensure_future(client.acquire("busybox")) for _ in range(4)]
        print("holding", *(sb.id for sb in held), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_sigkill_of_the_client_process_leaves_nothing(
    imported: LocalProvider, local_state: Path
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(local_state)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("holding"), line
        assert len(await imported.list()) >= 2
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
    started = time.monotonic()
    with anyio.fail_after(30):
        while await imported.list():
            await anyio.sleep(0.1)
    assert time.monotonic() - started < 30


FORKED = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import sandman

    async def main() -> None:
        client = sandman.local(state_dir=sys.argv[1])
        held = await client.acquire("busybox")
        child = os.fork()  # as multiprocessing does: every descriptor is inherited
        if child == 0:
            time.sleep(3600)
            os._exit(0)
        print("holding", held.id, child, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_forked_child_does_not_keep_the_watchdog_from_sweeping(
    imported: LocalProvider, local_state: Path
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", FORKED, str(local_state)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        _, sandbox_id, child = process.stdout.readline().split()
        assert [info.id for info in await imported.list()] == [sandbox_id]
        os.kill(process.pid, signal.SIGKILL)  # the pool's process only: its child lives on
        process.wait()
        with anyio.fail_after(30):
            while await imported.list():
                await anyio.sleep(0.1)
        os.kill(int(child), 0)  # still alive, still holding the pipe's write end
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.anyio
async def test_a_session_that_stops_heartbeating_loses_its_sandboxes(
    imported: LocalProvider,
) -> None:
    from sandman.pool import Pool, PoolConfig

    async with Pool(imported, PoolConfig(name="lease-test", lease=1.0)) as pool:
        quiet = pool.open_session()
        record = await pool.acquire(sandman.SandboxSpec(image="busybox"), session=quiet)
        assert [info.id for info in await imported.list()] == [record.id]
        started = time.monotonic()
        with anyio.fail_after(15):
            while await imported.list():
                await anyio.sleep(0.05)
        assert time.monotonic() - started >= 0.5  # not before the lease had passed


@pytest.mark.anyio
async def test_what_a_hostile_sandbox_sends_back_stays_bounded_and_inside(
    imported: LocalProvider, local_state: Path, tmp_path: Path
) -> None:
    """The workload shapes what the host downloads: a symlink chain that would
    resolve outside the destination, a symlink to /dev/zero, a 64 GiB sparse
    file. The host refuses each with a clear error and keeps nothing of it."""
    victim = tmp_path / "victim"
    victim.write_text("original")
    async with (
        sandman.local(state_dir=local_state) as client,
        client.sandbox("busybox", cpu=0.5, memory="128Mi") as sb,
    ):
        await sb.exec(
            "mkdir -p /work/t && cd /work/t && echo x > f && ln -s . d && ln -s d/.. a"
            " && ln -s /dev/zero /work/zero"
            " && dd if=/dev/zero of=/work/sparse bs=1 count=0 seek=64G 2>/dev/null",
            check=True,
        )
        with pytest.raises(sandman.UnsafeArchive, match="'a' -> 'd/..' resolves outside"):
            await sb.download("/work/t", tmp_path / "down")
        assert not (tmp_path / "down").exists()
        with pytest.raises(sandman.NotARegularFile, match="/work/zero"):
            await sb.read_file("/work/zero")
        with pytest.raises(sandman.FileTooLarge, match="max_bytes=67108864"):
            await sb.read_file("/work/sparse")
        with pytest.raises(sandman.FileTooLarge, match="max_bytes=1048576"):
            await sb.download("/work/sparse", tmp_path / "sparse", max_bytes=1024**2)
        with pytest.raises(sandman.FileTooLarge, match="max_bytes=4194304"):
            async with sb.read_file_stream("/work/sparse", max_bytes=4 * 1024**2):
                pass
        # Without a limit the stream reads any size in bounded pieces.
        received = 0
        async with sb.read_file_stream("/work/sparse") as chunks:
            async for piece in chunks:
                assert len(piece) <= 1024**2
                received += len(piece)
                if received >= 4 * 1024**2:
                    break
    assert victim.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]
