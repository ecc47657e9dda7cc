"""The local provider against real crun containers from a real (busybox) image."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

import sandman
from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig
from tests.providers.local.conftest import needs_root_and_crun
from tests.providers.local.leaks import leftovers

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

SPEC = SandboxSpec(image="busybox", memory="256Mi", pids=128, cpu=1)


async def _ready(info: SandboxInfo) -> sandman.DaemonClient:
    assert info.endpoint is not None
    client = info.endpoint.client()
    await client.wait_ready(timeout=10)
    return client


async def test_create_exec_delete(provider: LocalProvider) -> None:
    info = await provider.create(SPEC, labels={"sandman.io/pool": "p1"})
    assert info.state == "running" and info.labels == {"sandman.io/pool": "p1"}
    async with await _ready(info) as sb:
        health = await sb.health()
        assert health.pid == 1
        result = await sb.exec("hostname; id -u; echo $$; ls /.sandman")
        assert result.stdout.split() == [info.id, "0", result.stdout.split()[2], "sandmand"]
        assert (await sb.exec(["cat", "/proc/1/cmdline"])).stdout.startswith("/.sandman/sandmand")
        # Under memory pressure the kernel kills commands, not PID 1 (the whole sandbox).
        # (set right after each fork: look at a process that lives on)
        sleeper = await sb.spawn(["sleep", "1000"])
        adj = await sb.exec(f"cat /proc/{sleeper.pid}/oom_score_adj /proc/1/oom_score_adj")
        assert adj.stdout.split() == ["1000", "0"]
    await provider.delete(info.id)
    assert leftovers(provider) == []
    await provider.delete(info.id)  # idempotent


async def test_state_persists_across_calls_and_sandboxes_are_isolated(
    provider: LocalProvider,
) -> None:
    a, b = await provider.create(SPEC), await provider.create(SPEC)
    async with await _ready(a) as sa, await _ready(b) as sbb:
        await sa.write_file("/root/notes.txt", "from a")
        await sa.exec("echo more >> /root/notes.txt && rm /bin/ls")
        proc = await sa.spawn("echo started; sleep 1000")
        assert await sa.read_file("/root/notes.txt") == b"from amore\n"
        assert (await sa.poll(proc.id)).running
        assert not await sbb.exists("/root/notes.txt")
        assert (await sbb.exec(["ls", "/"])).exit_code == 0  # b still has ls
        image = await provider.images.get("busybox")
        assert (image.rootfs / "bin" / "ls").is_symlink()  # the shared image is untouched
        # b cannot see a's processes
        assert "sleep" not in (await sbb.exec(["ps"])).stdout


async def test_list_and_inspect_survive_a_new_provider(provider: LocalProvider) -> None:
    one = await provider.create(SPEC, labels={"sandman.io/pool": "p", "k": "1"})
    two = await provider.create(SPEC, labels={"sandman.io/pool": "p", "k": "2"})
    again = LocalProvider(provider.config, images=provider.images)
    listed = await again.list(labels={"sandman.io/pool": "p"})
    assert [i.id for i in listed] == [one.id, two.id]
    assert all(i.state == "running" for i in listed)
    assert [i.id for i in await again.list(labels={"k": "2"})] == [two.id]
    inspected = await again.inspect(one.id)
    assert inspected.endpoint == one.endpoint
    # Relabelled durably: another provider's list sees it (None removes a label).
    await provider.relabel(two.id, {"k": None, "sandman.io/session": "s-1"})
    relabelled = await again.inspect(two.id)
    assert relabelled.labels == {"sandman.io/pool": "p", "sandman.io/session": "s-1"}
    assert await again.list(labels={"k": "2"}) == []  # what it read before is read again
    assert [i.id for i in await again.list(labels={"sandman.io/session": "s-1"})] == [two.id]
    with pytest.raises(sandman.SandboxNotFound):
        await again.relabel("sb-none", {"k": "v"})
    async with await _ready(inspected) as sb:
        assert (await sb.exec(["true"])).ok
    await again.delete(one.id)
    with pytest.raises(sandman.SandboxNotFound):
        await again.inspect(one.id)


async def test_bad_input(provider: LocalProvider) -> None:
    with pytest.raises(sandman.ImageError):
        await provider.create(SandboxSpec(image="no-such-image"))
    with pytest.raises(sandman.ConfigError):
        await provider.create(SPEC, sandbox_id="../escape")
    with pytest.raises(sandman.ConfigError):
        await provider.delete("../escape")
    no_uplink = LocalProvider(
        provider.config.model_copy(update={"uplink": "smnouplink0"}), images=provider.images
    )
    with pytest.raises(sandman.ConfigError, match="smnouplink0"):
        await no_uplink.create(SPEC.model_copy(update={"network": "egress"}))
    assert await provider.network.list() == []
    info = await provider.create(SPEC, sandbox_id="fixed-id")
    with pytest.raises(sandman.ConfigError, match="already exists"):
        await provider.create(SPEC, sandbox_id="fixed-id")
    await provider.delete(info.id)
    assert leftovers(provider) == []


async def test_killed_from_outside_is_stopped_and_deletes_cleanly(provider: LocalProvider) -> None:
    info = await provider.create(SPEC)
    async with await _ready(info) as sb:
        await sb.spawn(["sleep", "1000"])
    pid = int((provider.config.state_dir / "sandboxes" / info.id / "pid").read_text())
    os.kill(pid, signal.SIGKILL)
    with anyio.fail_after(10):
        while (await provider.inspect(info.id)).state != "stopped":
            await anyio.sleep(0.01)
    assert (await provider.inspect(info.id)).endpoint is None
    await provider.delete(info.id)
    assert leftovers(provider) == []


def _cgroup_file(provider: LocalProvider, sandbox_id: str, controller: str, name: str) -> str:
    parent = provider.config.cgroup_parent.strip("/")
    return Path(f"/sys/fs/cgroup/{controller}/{parent}/{sandbox_id}/{name}").read_text()


async def test_limits_contain_a_fork_bomb_and_a_memory_hog(provider: LocalProvider) -> None:
    small = SandboxSpec(image="busybox", memory="64Mi", pids=48)
    victim, neighbour = await provider.create(small), await provider.create(SPEC)
    async with await _ready(victim) as sb, await _ready(neighbour) as nb:
        bomb = await sb.exec("for i in $(seq 1 200); do sleep 2 & done; wait", timeout=30)
        assert "can't fork" in bomb.stderr
        assert int(_cgroup_file(provider, victim.id, "pids", "pids.events").split()[1]) > 0
        assert (await nb.exec("seq 1 100 | wc -l")).stdout.strip() == "100"
        with anyio.fail_after(20):  # the bomb's sleeps end; the sandbox recovers
            while int(_cgroup_file(provider, victim.id, "pids", "pids.current")) > 8:
                await anyio.sleep(0.1)

        oom = await sb.exec("x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout=30)
        assert oom.exit_code == 137, oom
        assert "oom_kill 1" in _cgroup_file(provider, victim.id, "memory", "memory.oom_control")
        # The sandbox sees the same count in its own cgroup, read-only (as in a pod).
        inside = await sb.exec(
            "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events"
            " 2>/dev/null; echo 0 > /sys/fs/cgroup/memory/memory.oom_control"
        )
        assert "oom_kill 1" in inside.stdout.splitlines()
        assert "Read-only file system" in inside.stderr
        assert (await sb.health()).status == "ok"  # the daemon (PID 1) survives
        assert (await nb.exec("seq 1 100 | wc -l")).stdout.strip() == "100"


async def test_network_none_has_only_loopback(provider: LocalProvider) -> None:
    info = await provider.create(SPEC)
    async with await _ready(info) as sb:
        devices = (await sb.read_file("/proc/net/dev")).decode()
        interfaces = {line.split(":")[0].strip() for line in devices.splitlines()[2:]}
        assert interfaces == {"lo"}


async def test_runtime_failing_half_way_leaves_nothing(
    provider: LocalProvider, tmp_path: Path
) -> None:
    crun = provider._runtime.binary
    failing = tmp_path / "crun-failing-start"
    failing.write_text(
        f'#!/bin/sh\nif [ "$3" = start ]; then echo "injected failure" >&2; exit 1; fi\nexec {crun} "$@"\n'
    )
    failing.chmod(0o755)
    broken = LocalProvider(
        provider.config.model_copy(update={"runtime_path": str(failing)}), images=provider.images
    )
    with pytest.raises(sandman.ProviderError, match="injected failure"):
        await broken.create(SPEC)
    assert leftovers(provider) == []


async def test_cancelled_create_leaves_nothing(provider: LocalProvider) -> None:
    # Cancelled at many points: before the record, during the runtime's
    # create and start, while the daemon starts.
    for delay in (0.001, 0.003, 0.005, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08):
        with anyio.move_on_after(delay):
            await provider.create(SPEC)
        for info in await provider.list():
            await provider.delete(info.id)
    assert leftovers(provider) == []


async def test_many_cycles_leak_nothing(provider: LocalProvider) -> None:
    for _ in range(10):
        infos = [await provider.create(SPEC) for _ in range(3)]
        for info in infos:
            async with await _ready(info) as sb:
                await sb.exec(["true"])
        for info in infos:
            await provider.delete(info.id)
    assert leftovers(provider) == []


def test_missing_runtime_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(sandman.ConfigError, match="not found"):
        LocalProvider(LocalConfig(runtime_path="/nonexistent/crun-binary", state_dir=tmp_path))


async def test_refuses_state_dirs_too_long_for_a_socket(
    provider: LocalProvider, tmp_path: Path
) -> None:
    deep = tmp_path / ("x" * 60) / ("y" * 40)
    long = LocalProvider(
        provider.config.model_copy(update={"state_dir": deep}), images=provider.images
    )
    with pytest.raises(sandman.ConfigError, match="shorter state_dir"):
        await long.create(SPEC)


async def test_a_runtime_that_cannot_be_started_is_a_provider_error(
    provider: LocalProvider, tmp_path: Path
) -> None:
    vanishing = tmp_path / "crun-copy"
    vanishing.write_bytes(Path(provider._runtime.binary).read_bytes())
    vanishing.chmod(0o755)
    broken = LocalProvider(
        provider.config.model_copy(update={"runtime_path": str(vanishing)}), images=provider.images
    )
    vanishing.unlink()  # gone between configuration and use
    with pytest.raises(sandman.ProviderError, match="crun-copy"):
        await broken.create(SPEC)
    # Its record stays (the runtime could not confirm anything is gone) until a
    # delete with a working runtime, as the pool's retries or reconciler do.
    [half] = await provider.list()
    await provider.delete(half.id)
    assert leftovers(provider) == []
