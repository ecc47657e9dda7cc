"""The workload plays the attacker against what its sandbox shares with the host:
the trees it leaves for delete to remove, and the host's pids."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from sandman.providers.local.host import CGROUP_ROOT, parent_pids
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready
from tests.providers.local.leaks import leftovers

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

SPEC = SandboxSpec(image="busybox", memory="256Mi", pids=128, cpu=1)
DEPTH = 3000  # rmtree recursed once per level: 2,045 were enough to defeat it
LONG = "L" * 200


async def test_a_deep_odd_tree_made_inside_goes_with_its_sandbox(
    state_dir: Path, busybox_tar: Path
) -> None:
    # disk=None: the sandbox's files are in its own directory, removed by walking them.
    with tempfile.TemporaryDirectory(prefix="sm-canary-") as canary:
        (Path(canary) / "keep").write_text("precious")
        async with provider_for(config_for(state_dir, disk=None), busybox_tar) as provider:
            info = await provider.create(SPEC)
            async with await ready(info) as sb:
                # A chain DEPTH deep with long names (its path is ~600 KB, far past
                # PATH_MAX), every tenth directory mode 000, built bottom-up so that
                # each call names a short path; symlinks out of the sandbox's directory
                # (to the host's canary, to /, up the tree), odd modes and names.
                made = await sb.exec(
                    f"set -e; cd /tmp; mkdir c; i=0; while [ $i -lt {DEPTH} ]; do "
                    f"mkdir n; mv c n/{LONG}; if [ $((i % 10)) -eq 0 ]; then "
                    f"chmod 000 n/{LONG}; fi; mv n c; i=$((i + 1)); done; "
                    f"ln -s {canary} c/canary; ln -s / c/root; ln -s ../.. c/up; "
                    "mkfifo c/fifo; touch c/locked c/'new\nline'; chmod 000 c/locked; "
                    "mkdir -m 1000 c/sticky; chmod 000 c; echo made",
                    timeout=300,
                )
                assert made.stdout == "made\n", made
            upper = state_dir / "sandboxes" / info.id / "upper" / "tmp" / "c"
            assert _depth(upper, LONG) == DEPTH
            await provider.delete(info.id)
            assert not (state_dir / "sandboxes" / info.id).exists()
            assert [i.id for i in await provider.list()] == []
            assert leftovers(provider) == []  # no directory, container, mount, cgroup
        assert (Path(canary) / "keep").read_text() == "precious"


def _depth(top: Path, name: str) -> int:
    """How many directories ``name`` are nested under ``top``, walked by descriptors."""
    fd, depth = os.open(top, os.O_RDONLY | os.O_DIRECTORY), 0
    try:
        while True:
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                return depth
            os.close(fd)
            fd, depth = child, depth + 1
    finally:
        os.close(fd)


def _pids_dir(provider: LocalProvider, *below: str) -> Path:
    """The pids cgroup of the provider's parent (or of a sandbox ``below`` it)."""
    parent = provider.config.cgroup_parent.strip("/")
    v1 = CGROUP_ROOT / "pids"
    root = v1 if (v1 / "cgroup.procs").exists() else CGROUP_ROOT
    return root.joinpath(parent, *below)


def _events(directory: Path) -> int:
    """How many forks of this cgroup's tasks a pids.max refused."""
    return int((directory / "pids.events").read_text().split()[1])


async def test_the_cgroup_parent_caps_pids_below_the_hosts_pid_max(
    provider: LocalProvider,
) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    await provider.create(SPEC)
    limit = int((_pids_dir(provider) / "pids.max").read_text())
    assert limit == parent_pids(None) == pid_max * 3 // 4


async def test_the_parent_limit_binds_sandboxes_together_and_each_keeps_its_own(
    state_dir: Path, busybox_tar: Path
) -> None:
    bomb = "for i in $(seq 1 100); do sleep 60 </dev/null >/dev/null 2>&1 & done; echo tried"
    config = config_for(state_dir, cgroup_parent_pids=64)
    async with provider_for(config, busybox_tar) as provider:
        small = await provider.create(SPEC.model_copy(update={"pids": 24}))
        large = await provider.create(SPEC)
        async with await ready(small) as a, await ready(large) as b:
            # The sandbox's own limit: it stops at 24, far below the parent's.
            first = await a.exec(bomb, timeout=60)
            assert "can't fork" in first.stderr, first
            assert _events(_pids_dir(provider, small.id)) > 0
            assert int((_pids_dir(provider, small.id) / "pids.current").read_text()) <= 24
            # The parent's: the other sandbox, far below its own 128, stops at what
            # is left of the 64 all sandboxes share.
            second = await b.exec(bomb, timeout=60)
            assert "can't fork" in second.stderr, second
            held = int((_pids_dir(provider, small.id) / "pids.current").read_text())
            current = int((_pids_dir(provider, large.id) / "pids.current").read_text())
            assert current <= 64 - held < 128, (held, current)
            assert int((_pids_dir(provider) / "pids.current").read_text()) <= 64


async def test_no_sandbox_sees_the_hosts_btrfs_quota_groups(
    state_dir: Path, busybox_tar: Path
) -> None:
    # Two sandboxes with disk limits share one btrfs: its qgroups under /sys/fs/btrfs
    # would show each one's usage to the other.
    async with provider_for(config_for(state_dir), busybox_tar) as provider:
        a = await provider.create(SPEC.model_copy(update={"disk": 64 * 2**20}))
        b = await provider.create(SPEC.model_copy(update={"disk": 64 * 2**20}))
        assert provider.disk.qgroups(), "the layers have quota groups on the host"
        async with await ready(a) as sb:
            await sb.exec("head -c 1000000 /dev/urandom > /root/x")
        async with await ready(b) as sb:
            seen = await sb.exec("ls -A /sys/fs/btrfs; cat /sys/fs/btrfs/*/qgroups/*/referenced")
        assert seen.stdout == "", seen
        for info in (a, b):
            await provider.delete(info.id)


async def test_the_mount_table_names_no_sandbox(state_dir: Path, busybox_tar: Path) -> None:
    # The overlay's options (lowerdir, upperdir, workdir) are in every sandbox's
    # /proc/self/mountinfo: they named the host's state directory and the sandbox's id.
    async with provider_for(config_for(state_dir), busybox_tar) as provider:
        info = await provider.create(SPEC.model_copy(update={"disk": 64 * 2**20}))
        async with await ready(info) as sb:
            table = (await sb.exec("cat /proc/self/mountinfo")).stdout
        (root,) = [line for line in table.splitlines() if line.split()[4] == "/"]
        assert "lowerdir=/run/sandman-layers/0,upperdir=/run/sandman-layers/w/upper" in root
        assert str(state_dir) not in root, root
        # No line names the sandbox (the binds of the daemon and of the masked
        # directories still show their sources' host paths: docs/security.md).
        assert info.id not in table, table
        await provider.delete(info.id)
