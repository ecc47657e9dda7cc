"""What a sandbox makes of the host's superblocks, and the views that replace the rest.

Every superblock on the host adds a shrinker slot to every memory cgroup, so the
kernel's memory for them grows with the square of the sandbox count (`views`). A
sandbox makes 4 (its overlay root, /proc, devpts, its IPC namespace's mqueue); /dev,
/dev/shm, /sys and /sys/fs/cgroup are views that keep their walls.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.base import SandboxInfo
from sandman.providers.local import LocalProvider, views
from tests.providers.local.conftest import (
    config_for,
    needs_root_and_crun,
    provider_for,
    ready,
)
from tests.support import eventually

SPEC = SandboxSpec(image="busybox", memory="64Mi", pids=64, cpu=0.5)


def _superblocks(pid: int) -> dict[str, str]:
    """The superblocks (device numbers) under a process's mounts, with their types."""
    found: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        found.setdefault(fields[2], fields[fields.index("-") + 1])
    return found


def _own(one: SandboxInfo, other: SandboxInfo) -> list[str]:
    """The types of the superblocks ``one`` has and neither ``other`` nor the host has."""
    assert one.endpoint is not None and one.endpoint.pid is not None
    assert other.endpoint is not None and other.endpoint.pid is not None
    shared = _superblocks(other.endpoint.pid).keys() | _superblocks(os.getpid()).keys()
    return sorted(t for dev, t in _superblocks(one.endpoint.pid).items() if dev not in shared)


@pytest.mark.anyio
@needs_root_and_crun
@pytest.mark.parametrize(
    ("settings", "own"),
    [
        ({}, ["devpts", "mqueue", "overlay", "proc"]),
        ({"userns": False}, ["devpts", "mqueue", "overlay", "proc"]),
        (
            # /dev and /dev/shm tmpfs of their own, and a sysfs; /sys/fs/cgroup stays binds.
            {"dev_tmpfs": True, "own_sysfs": True},
            ["devpts", "mqueue", "overlay", "proc", "sysfs", "tmpfs", "tmpfs"],
        ),
    ],
)
async def test_a_sandbox_makes_four_superblocks_unless_asked_for_more(
    state_dir: Path, busybox_tar: Path, settings: dict[str, bool], own: list[str]
) -> None:
    async with provider_for(config_for(state_dir, **settings), busybox_tar) as provider:
        first, second = await provider.create(SPEC), await provider.create(SPEC)
        assert _own(first, second) == _own(second, first) == own
        if not settings.get("dev_tmpfs"):
            # On cgroup v1 the runtime's /sys/fs/cgroup is a tmpfs: here, binds.
            assert first.endpoint is not None and first.endpoint.pid is not None
            types = set(_superblocks(first.endpoint.pid).values())
            assert "tmpfs" not in types, types


@pytest.mark.anyio
@needs_root_and_crun
async def test_dev_shm_is_the_sandboxs_own_directory_on_its_disk_limit(
    provider: LocalProvider,
) -> None:
    one = await provider.create(SPEC.model_copy(update={"disk": 32 * 2**20}))
    other = await provider.create(SPEC)
    async with await ready(one) as a, await ready(other) as b:
        modes = await a.exec("stat -c '%a %u %g' /dev /dev/shm", check=True)
        assert modes.stdout.split("\n")[:2] == ["755 0 0", "1777 0 0"]
        await a.exec("echo mine > /dev/shm/x && mkdir /dev/more", check=True)
        assert (await b.exec("ls -A /dev/shm")).stdout == ""
        assert (await b.exec("ls /dev/more")).exit_code != 0
        # What /dev/shm holds is on the sandbox's disk limit, not in the host's memory.
        full = await a.exec("dd if=/dev/zero of=/dev/shm/big bs=1M count=64")
        assert full.exit_code != 0 and "quota" in full.stderr.lower(), full.stderr
        # The usual devices work; others stay refused by the devices cgroup.
        devices = await a.exec(
            "echo x > /dev/null && head -c 8 /dev/urandom | wc -c && head -c 3 /dev/zero | wc -c",
            check=True,
        )
        assert devices.stdout.split() == ["8", "3"]
        refused = await a.exec("mknod /dev/mem c 1 1")
        assert refused.exit_code != 0


def _with_a_dev(busybox_tar: Path, path: Path) -> Path:
    """The busybox image with a /dev of its own: a file named null, a link named fd."""
    with tarfile.open(busybox_tar) as source, tarfile.open(path, "w") as target:
        for member in source.getmembers():
            target.addfile(member, source.extractfile(member) if member.isfile() else None)
        null = tarfile.TarInfo("dev/null")
        null.size = 4
        target.addfile(null, io.BytesIO(b"file"))
        link = tarfile.TarInfo("dev/fd")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        target.addfile(link)
    return path


DEVICES = (
    "test -c /dev/null && test -c /dev/zero && test -c /dev/full && test -c /dev/tty"
    " && test -c /dev/random && test -c /dev/urandom && test -d /dev/pts && test -d /dev/shm"
    " && echo x > /dev/null && test ! -s /dev/null && head -c 3 /dev/zero | wc -c"
    " && readlink /dev/fd && readlink /dev/stdin && readlink /dev/ptmx && ls /dev/fd/ | head -1"
)


@pytest.mark.anyio
@needs_root_and_crun
@pytest.mark.parametrize("userns", [True, False])
async def test_dev_is_the_runtimes_whatever_the_image_or_a_snapshot_left_there(
    state_dir: Path, busybox_tar: Path, userns: bool
) -> None:
    async with provider_for(config_for(state_dir, userns=userns), busybox_tar) as provider:
        image = _with_a_dev(busybox_tar, state_dir / "with-dev.tar")
        await provider.images.import_archive(image, name="with-dev")
        info = await provider.create(SPEC.model_copy(update={"image": "with-dev"}))
        async with await ready(info) as sb:
            # The image's /dev is hidden, as a tmpfs hid it.
            seen = await sb.exec(DEVICES, check=True)
            assert seen.stdout.split() == ["3", "/proc/self/fd", "/proc/self/fd/0", "pts/ptmx", "0"]
            # The sandbox replaces what the runtime made (under user namespaces, /dev/null
            # is the bind of the host's, busy): its snapshot keeps that, not its forks.
            replace = (
                "rm /dev/fd && ln -s /etc /dev/fd && echo kept > /dev/shm/k && echo d > /dev/mine"
            )
            if not userns:
                replace += " && rm /dev/null && echo mine > /dev/null"
            await sb.exec(replace, check=True)
        snapshot = await provider.snapshot(info.id)
        fork = await provider.create(
            SPEC.model_copy(update={"image": "with-dev", "snapshot": snapshot.id})
        )
        async with await ready(fork) as sb:
            assert (await sb.exec(DEVICES, check=True)).stdout.split()[1] == "/proc/self/fd"
            kept = await sb.exec("cat /dev/shm/k /dev/mine", check=True)
            assert kept.stdout.split() == ["kept", "d"]


@pytest.mark.anyio
@needs_root_and_crun
@pytest.mark.parametrize("userns", [True, False])
async def test_sys_is_one_read_only_view_naming_no_interface_of_the_host(
    state_dir: Path, busybox_tar: Path, userns: bool
) -> None:
    host = sorted(p.name for p in Path("/sys/class/net").iterdir())
    async with provider_for(config_for(state_dir, userns=userns), busybox_tar) as provider:
        info = await provider.create(SPEC)
        async with await ready(info) as sb:
            seen = (await sb.exec("ls /sys/class/net", check=True)).stdout.split()
            assert seen == ["lo"] and not set(seen) & (set(host) - {"lo"}), host
            # Up, as the sandbox's own loopback is (the runtime brings it up).
            lo = await sb.exec("cat /sys/class/net/lo/flags /sys/class/net/lo/operstate")
            assert lo.stdout.split() == ["0x9", "unknown"], lo
            refused = await sb.exec("echo 1 > /sys/kernel/uevent_helper")
            assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
            # Still masked on the shared view.
            assert (
                await sb.exec("ls -A /sys/firmware /sys/fs/btrfs", check=True)
            ).stdout.split() == [
                "/sys/firmware:",
                "/sys/fs/btrfs:",
            ]


@pytest.mark.anyio
@needs_root_and_crun
async def test_the_shared_sys_holds_nothing_open_once_its_sandboxes_are_gone(
    provider: LocalProvider,
) -> None:
    def sysfs_of(info: SandboxInfo) -> str:
        assert info.endpoint is not None and info.endpoint.pid is not None
        return next(d for d, t in _superblocks(info.endpoint.pid).items() if t == "sysfs")

    before = len(os.listdir("/proc/self/fd"))
    first = await provider.create(SPEC)
    second = await provider.create(SPEC)
    assert sysfs_of(first) == sysfs_of(second)  # one namespace's, held for both
    await provider.delete(first.id)
    third = await provider.create(SPEC)
    assert sysfs_of(third) == sysfs_of(second)
    for info in (second, third):
        await provider.delete(info.id)
    await eventually(lambda: len(os.listdir("/proc/self/fd")) <= before, what="no descriptor left")
    # The next sandbox gets a namespace again.
    async with await ready(await provider.create(SPEC)) as sb:
        assert (await sb.exec("ls /sys/class/net", check=True)).stdout.split() == ["lo"]


@pytest.mark.anyio
@needs_root_and_crun
async def test_sys_fs_cgroup_shows_the_sandboxs_own_cgroups_read_only(
    provider: LocalProvider,
) -> None:
    if not views.hierarchies():
        pytest.skip("cgroup v2: the runtime's view is no tmpfs, nothing replaced")
    info = await provider.create(SPEC)
    async with await ready(info) as sb:
        limit = await sb.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes", check=True)
        assert int(limit.stdout) == SPEC.memory
        assert (await sb.exec("cat /sys/fs/cgroup/pids/pids.max", check=True)).stdout == "64\n"
        # As the runtime's mounts are: rooted at the sandbox's cgroup namespace, "/".
        table = (await sb.exec("cat /proc/self/mountinfo", check=True)).stdout
        memory = [line for line in table.splitlines() if line.split()[4] == "/sys/fs/cgroup/memory"]
        assert len(memory) == 1 and memory[0].split()[3] == "/", memory
        assert " - cgroup " in memory[0] and "memory" in memory[0].split()[-1]
        for attempt in (
            "echo 1 > /sys/fs/cgroup/memory/memory.limit_in_bytes",
            "mkdir /sys/fs/cgroup/memory/child",
            "mkdir /sys/fs/cgroup/other",
        ):
            refused = await sb.exec(attempt)
            assert refused.exit_code != 0 and "Read-only file system" in refused.stderr, attempt
    assert info.id not in table


@pytest.mark.anyio
@needs_root_and_crun
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)  # the first run on a machine builds the image
async def test_python_shared_memory_and_multiprocessing_work_in_dev_shm(
    provider: LocalProvider,
) -> None:
    from tests.images.debian import debian_python_tar

    await provider.images.import_archive(debian_python_tar(), name="debian-python")
    info = await provider.create(SandboxSpec(image="debian-python", memory="512Mi"))
    script = (
        "import multiprocessing as mp\n"
        "from multiprocessing import shared_memory\n"
        "def square(x): return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.Pool(2) as pool: print(sum(pool.map(square, range(10))))\n"
        "    made = shared_memory.SharedMemory(create=True, size=1 << 20)\n"
        "    made.buf[0] = 7\n"
        "    seen = shared_memory.SharedMemory(name=made.name)\n"
        "    print(seen.buf[0]); seen.close(); made.close(); made.unlink()\n"
        "    lock, queue = mp.Lock(), mp.Queue()\n"
        "    with lock: queue.put(3)\n"
        "    print(queue.get())\n"
    )
    async with await ready(info) as sb:
        await sb.write_file("/tmp/shm.py", script)
        done = await sb.exec(["python3", "/tmp/shm.py"], check=True)
        assert done.stdout.split() == ["285", "7", "3"]
        assert (await sb.exec("ls -A /dev/shm")).stdout == ""


def test_the_dev_of_a_layer_is_made_without_following_what_the_sandbox_left(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    views.make_dev(fresh)
    assert oct((fresh / "dev").stat().st_mode & 0o7777) == "0o755"
    assert oct((fresh / "dev" / "shm").stat().st_mode & 0o7777) == "0o1777"
    # Opaque: the image's /dev stays hidden, as it was under a tmpfs.
    assert os.getxattr(fresh / "dev", "trusted.overlay.opaque") == b"y"
    kept = tmp_path / "kept"
    (kept / "dev" / "shm").mkdir(parents=True)
    (kept / "dev" / "shm" / "sem.x").write_text("k")
    (kept / "dev" / "mine").write_text("m")
    # What the runtime makes is made anew: a sandbox's replacement does not last.
    (kept / "dev" / "null").write_text("not a device")
    (kept / "dev" / "fd").symlink_to("/etc")
    (kept / "dev" / "pts" / "deep").mkdir(parents=True)
    views.make_dev(kept)
    assert (kept / "dev" / "shm" / "sem.x").read_text() == "k"
    assert sorted(p.name for p in (kept / "dev").iterdir()) == ["mine", "shm"]
    # A layer from a snapshot holds what the workload made: symlinks out are not followed.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "null").write_text("outside")
    for link in ("dev", "dev/shm", "dev/pts"):
        layer = tmp_path / link.replace("/", "-")
        (layer / link).parent.mkdir(parents=True, exist_ok=True)
        (layer / link).symlink_to(outside)
        views.make_dev(layer)
        assert not (layer / "dev").is_symlink() and not (layer / "dev" / "shm").is_symlink()
        assert (layer / "dev" / "shm").is_dir()
        assert not os.path.lexists(layer / "dev" / "pts")  # the runtime makes it
    assert [p.name for p in outside.iterdir()] == ["null"]


def test_the_hierarchies_are_named_as_the_runtime_names_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("memory", "systemd", "cpu,cpuacct", "net_cls,net_prio", "pids"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(views, "_CGROUP_ROOT", tmp_path)
    proc_cgroup = (
        "12:pids:/a\n11:name=systemd:/\n10:cpuacct,cpu:/\n9:net_prio,net_cls:/\n"
        "8:memory:/x\n7:rdma:/\n0::/\n"
    )
    # rdma has no directory here (not mounted): the runtime shows none either.
    assert views.hierarchies(proc_cgroup) == (
        "pids",
        "systemd",
        "cpu,cpuacct",
        "net_cls,net_prio",
        "memory",
    )
    assert views.hierarchies("0::/\n") == ()
