"""Root in a sandbox is nobody on the host: each crun sandbox runs in a user namespace of
its own, owned by its own host uid range (`sandman.providers.local.userns`).

The workload plays the attacker against what root on the host shares: the per-user
kernel limits (one sandbox holding every inotify instance root may have), and the
ids its files and processes have on the host. The image's layers stay shared
(idmapped), and what a sandbox writes is stored with the ids it sees, so snapshots,
forks into another range and images made of a sandbox read right.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import shutil
import struct
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandman.daemon import DaemonClient
from sandman.errors import CapacityError
from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider, userns
from sandman.providers.local.trees import remove_tree
from tests.images.builders import (
    directory,
    docker_archive,
    file,
    image_config,
    layer_tar,
    sha256,
)
from tests.providers.local.conftest import config_for, needs_root_and_crun, provider_for, ready
from tests.support import eventually

pytestmark = [pytest.mark.anyio, needs_root_and_crun]

SPEC = SandboxSpec(image="busybox", memory="128Mi", pids=256, cpu=1)
OWNERS = SandboxSpec(image="owners", memory="128Mi", pids=64, cpu=1)
HOG_SOURCE = Path(__file__).with_name("inotify_hog.c")
HOG = "/hog"
NS_GET_OWNER_UID = 0xB704  # _IO(0xb7, 0x4): the uid that owns a user namespace
MAX_INSTANCES = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())


@pytest.fixture(scope="module")
def hog(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the static inotify hog")
    binary = tmp_path_factory.mktemp("hog") / "hog"
    subprocess.run(
        ["gcc", "-static", "-no-pie", "-O2", "-o", str(binary), str(HOG_SOURCE)],
        check=True,
        capture_output=True,
    )
    return binary.read_bytes()


@pytest.fixture(scope="module")
def owners_tar(busybox_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """busybox with a layer whose files belong to uid 1000 and to nobody (65534)."""
    extra = layer_tar(
        [
            directory("home/user", mode=0o700, uid=1000, gid=1000),
            file("home/user/notes", b"notes", mode=0o600, uid=1000, gid=1000),
            file("srv/nobodys", b"n", mode=0o644, uid=65534, gid=65534),
        ]
    )
    layers = [busybox_tar.read_bytes(), extra]
    config = image_config([sha256(layer) for layer in layers], user="", working_dir="/")
    path = tmp_path_factory.mktemp("owners") / "owners.tar"
    return docker_archive(path, layers, repo_tags=("owners:latest",), config=config)


@pytest.fixture
async def owned(
    state_dir: Path, busybox_tar: Path, owners_tar: Path, request: pytest.FixtureRequest
) -> AsyncIterator[LocalProvider]:
    """A provider with the ``owners`` image; ``disk`` from the test's parameter."""
    disk = getattr(request, "param", "10Gi")
    async with provider_for(config_for(state_dir, disk=disk), busybox_tar) as provider:
        await provider.images.import_archive(owners_tar, name="owners")
        yield provider


def _owner_of_userns(pid: int) -> int:
    """The host uid that owns process ``pid``'s user namespace (NS_GET_OWNER_UID)."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        answer = fcntl.ioctl(fd, NS_GET_OWNER_UID, b"\0" * 4)
    finally:
        os.close(fd)
    return int(struct.unpack("I", answer)[0])


def _ids(pid: int) -> tuple[set[int], set[int]]:
    """Process ``pid``'s host uids and gids (real, effective, saved, filesystem)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            fields[key] = {int(v) for v in value.split()}
    return fields["Uid"], fields["Gid"]


def _pids(provider: LocalProvider, sandbox_id: str) -> list[int]:
    """Every process of the sandbox, from its cgroup (v1 pids hierarchy, or v2)."""
    parent = provider.config.cgroup_parent.strip("/")
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        procs = root / parent / sandbox_id / "cgroup.procs"
        if procs.exists():
            return [int(p) for p in procs.read_text().split()]
    raise AssertionError(f"no cgroup of {sandbox_id}")


def _base(provider: LocalProvider, sandbox_id: str) -> int:
    base = userns.allocated(provider.config.state_dir.resolve() / "sandboxes" / sandbox_id)
    assert base is not None
    return base


def _upper(provider: LocalProvider, sandbox_id: str) -> Path:
    layer = provider.disk.root / sandbox_id
    if not layer.exists():
        layer = provider.config.state_dir / "sandboxes" / sandbox_id
    return layer / "upper"


async def _stat(sb: DaemonClient, *paths: str) -> list[str]:
    done = await sb.exec(["stat", "-c", "%u:%g", *paths], check=True)
    return done.stdout.split()


# -- who root inside is ----------------------------------------------------------------


async def test_root_inside_is_an_unprivileged_host_uid_range_of_its_own(
    provider: LocalProvider,
) -> None:
    infos = [await provider.create(SPEC) for _ in range(2)]
    ranges = []
    for info in infos:
        async with await ready(info) as sb:
            inside = await sb.exec("id -u; id -g; cat /proc/self/uid_map", check=True)
            await sb.spawn(["sleep", "60"])  # the workload's processes too, not just PID 1
            uid, gid, zero, base, size = (int(v) for v in inside.stdout.split())
            assert (uid, gid, zero, size) == (0, 0, 0, userns.RANGE)
            assert base >= userns.FIRST_ID
            assert base == _base(provider, info.id)
            pids = _pids(provider, info.id)
            assert len(pids) >= 2
            for pid in pids:
                assert _ids(pid) == ({base}, {base}), pid
            # Owned by the sandbox's uid, not root's: the kernel charges per-user
            # limits of everything in the namespace to its owner.
            assert info.endpoint is not None and info.endpoint.pid is not None
            assert _owner_of_userns(info.endpoint.pid) == base
            assert os.readlink(f"/proc/{info.endpoint.pid}/ns/user") != os.readlink(
                "/proc/self/ns/user"
            )
            ranges.append(range(base, base + size))
    first, second = ranges
    assert first.stop <= second.start or second.stop <= first.start, ranges


async def test_root_of_its_namespace_still_meets_every_read_only_and_masked_path(
    provider: LocalProvider,
) -> None:
    """Root of its own user, uts, ipc and cgroup namespaces: what the runtime made
    read-only or masked stays so (its cgroup's files are root's on the host, and
    read-only besides)."""
    info = await provider.create(SPEC)
    async with await ready(info) as sb:
        for write in (
            "echo other > /proc/sys/kernel/hostname",
            "echo 0 > /proc/sys/kernel/ns_last_pid",
            "echo 9999999999 > /sys/fs/cgroup/memory/memory.limit_in_bytes",
            "echo max > /sys/fs/cgroup/pids/pids.max",
            "echo x > /sys/kernel/uevent_helper",
        ):
            refused = await sb.exec(write)
            assert refused.exit_code != 0, write
        assert (await sb.exec(["cat", "/proc/keys", "/proc/timer_list"], check=True)).stdout == ""
        assert (await sb.exec(["ls", "-A", "/sys/fs/btrfs"], check=True)).stdout == ""
    parent = provider.config.cgroup_parent.strip("/")
    limit = Path("/sys/fs/cgroup/memory") / parent / info.id / "memory.limit_in_bytes"
    if limit.exists():
        assert limit.stat().st_uid == 0
        assert int(limit.read_text()) == SPEC.memory


async def test_exec_as_a_user_and_file_transfers_keep_their_owners(owned: LocalProvider) -> None:
    info = await owned.create(OWNERS)
    base = _base(owned, info.id)
    async with await ready(info) as sb:
        assert (await sb.exec("id -u; id -g", user="1000:1000", check=True)).stdout.split() == [
            "1000",
            "1000",
        ]
        # Its own files are its own: uid 1000 reads its 0700 home, root does too.
        notes = await sb.exec(["cat", "/home/user/notes"], user="1000:1000", check=True)
        assert notes.stdout == "notes"
        spawned = await sb.spawn(["sleep", "60"], user="1000:1000")
        on_host = [pid for pid in _pids(owned, info.id) if _ids(pid)[0] == {base + 1000}]
        assert len(on_host) == 1, (spawned, [_ids(p) for p in _pids(owned, info.id)])
        # An upload's files are the daemon's (root inside: never nobody, never a host
        # id), whatever its tar says; a download tells the owners as the sandbox sees them.
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            entry = tarfile.TarInfo("uploaded")
            entry.uid = entry.gid = 4242
            entry.size = 4
            tar.addfile(entry, io.BytesIO(b"data"))
        await sb.upload_archive("/srv", buffer.getvalue())
        await sb.write_file("/srv/written", b"w")
        await sb.exec("echo u > /home/user/made", user="1000:1000", check=True)
        assert await _stat(sb, "/srv/uploaded", "/srv/written") == ["0:0", "0:0"]
        downloaded = await sb.download_archive("/home/user")
        with tarfile.open(fileobj=io.BytesIO(downloaded)) as got:
            owners = {m.name.removeprefix("./"): (m.uid, m.gid) for m in got.getmembers()}
        assert owners["made"] == owners["notes"] == (1000, 1000), owners
    upper = _upper(owned, info.id)
    assert (upper / "srv" / "uploaded").stat().st_uid == 0
    assert (upper / "srv" / "written").stat().st_uid == 0
    assert (upper / "home" / "user" / "made").stat().st_uid == 1000


# -- the attack on the per-user limits ---------------------------------------------------


async def _hold_every_instance(sb: DaemonClient, hog: bytes) -> tuple[str, list[int]]:
    """Start the hog holding as many inotify instances as it can; (its process id,
    [opened, errno of the refusal])."""
    await sb.write_file(HOG, hog, mode=0o755)
    process = await sb.spawn([HOG, "1000000", "hold"])
    output: list[str] = []

    async def printed() -> bool:
        output[:] = [(await sb.read_output(process.id)).stdout]
        return output[0].endswith("\n")

    await eventually(printed, timeout=30, what="the hog's count")
    return process.id, [int(v) for v in output[0].split()]


def _host_root_inotify() -> int:
    """inotify_init1 as root on the host: 0 if it works, else its errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


async def test_one_sandbox_holding_every_inotify_instance_starves_no_one(
    provider: LocalProvider, hog: bytes
) -> None:
    attacker, other = [await provider.create(SPEC) for _ in range(2)]
    async with await ready(attacker) as a, await ready(other) as b:
        hog_id, (opened, refused) = await _hold_every_instance(a, hog)
        # It met the per-user limit, its own: all of it, and no more.
        assert (opened, refused) == (MAX_INSTANCES, errno.EMFILE)
        await b.write_file(HOG, hog, mode=0o755)
        assert (await b.exec([HOG, "16"], check=True)).stdout.split() == ["16", "0"]
        assert _host_root_inotify() == 0
        await a.kill(hog_id)


async def test_without_user_namespaces_the_attack_is_real(
    state_dir: Path, busybox_tar: Path, hog: bytes
) -> None:
    """The control (``userns=False``): every sandbox is root, and one takes root's
    instances from all. Held for two calls only: root's processes on the host fail
    meanwhile."""
    async with provider_for(config_for(state_dir, userns=False), busybox_tar) as provider:
        attacker, other = [await provider.create(SPEC) for _ in range(2)]
        async with await ready(attacker) as a, await ready(other) as b:
            await b.write_file(HOG, hog, mode=0o755)
            hog_id, (opened, refused) = await _hold_every_instance(a, hog)
            try:
                starved = (await b.exec([HOG, "1"], check=True)).stdout.split()
                host = _host_root_inotify()
            finally:
                await a.kill(hog_id)
            assert refused == errno.EMFILE and opened <= MAX_INSTANCES
            assert starved == ["0", str(errno.EMFILE)]
            assert host == errno.EMFILE
            await eventually(lambda: _host_root_inotify() == 0, what="root's instances back")


# -- files: the image's shared, the sandbox's canonical ---------------------------------


@pytest.mark.parametrize("owned", ["10Gi", None], indirect=True, ids=["btrfs-layer", "no-disk"])
async def test_image_files_keep_their_owners_and_writes_are_stored_as_seen(
    owned: LocalProvider,
) -> None:
    info = await owned.create(OWNERS)
    base = _base(owned, info.id)
    async with await ready(info) as sb:
        image_files = ["/bin/busybox", "/etc/passwd", "/home/user", "/home/user/notes"]
        assert await _stat(sb, *image_files, "/srv/nobodys") == [
            "0:0", "0:0", "1000:1000", "1000:1000", "65534:65534",
        ]  # fmt: skip
        await sb.exec(
            "echo r > /root/made; touch /tmp/given; busybox chown 1000:1000 /tmp/given; "
            "echo more >> /etc/passwd; rm /srv/nobodys",
            check=True,
        )
        await sb.exec(
            "echo u > /home/user/made; echo n > /tmp/nobodys", user="1000:1000", check=True
        )
        await sb.exec("echo n > /tmp/nobody", user="65534", check=True)
    # The image's files on the host are untouched, shared and owned as the image says.
    lower = next(layer for layer in (await owned.images.get("owners")).lowers)
    assert (lower / "home" / "user" / "notes").stat().st_uid == 1000
    # What the sandbox wrote is stored with the ids it saw, not the host's (base + n).
    upper = _upper(owned, info.id)
    stored = {
        path: ((upper / path).lstat().st_uid, (upper / path).lstat().st_gid)
        for path in ("root/made", "tmp/given", "etc/passwd", "home/user/made", "tmp/nobody")
    }
    assert stored == {
        "root/made": (0, 0),
        "tmp/given": (1000, 1000),
        "etc/passwd": (0, 0),  # copied up with its owner
        "home/user/made": (1000, 1000),
        "tmp/nobody": (65534, 65534),
    }
    assert (upper / "home" / "user").stat().st_uid == 1000
    whiteout = (upper / "srv" / "nobodys").lstat()
    assert (os.major(whiteout.st_rdev), os.minor(whiteout.st_rdev)) == (0, 0)
    assert all(base > v for v in (s for pair in stored.values() for s in pair))


@pytest.mark.parametrize("owned", ["10Gi", None], indirect=True, ids=["btrfs-layer", "no-disk"])
async def test_a_fork_into_another_range_and_an_image_of_it_keep_the_owners(
    owned: LocalProvider,
) -> None:
    source = await owned.create(OWNERS)
    async with await ready(source) as sb:
        await sb.exec("echo u > /home/user/mine; echo r > /root/mine", user="0", check=True)
        await sb.exec("busybox chown 1000:1000 /home/user/mine", check=True)
    snapshot = await owned.snapshot(source.id)
    fork = await owned.create(OWNERS.model_copy(update={"snapshot": snapshot.id}))
    assert _base(owned, fork.id) != _base(owned, source.id)
    async with await ready(fork) as sb:
        assert await _stat(sb, "/home/user/mine", "/root/mine", "/home/user/notes") == [
            "1000:1000", "0:0", "1000:1000",
        ]  # fmt: skip
        # Owned, not just named: user 1000 writes its file in its 0700 home.
        await sb.exec("echo again >> /home/user/mine", user="1000:1000", check=True)
        assert (await sb.read_file("/home/user/mine")) == b"u\nagain\n"
    image = await owned.save_image(snapshot.id, "owners-made:v1")
    top = image.lowers[0]
    assert (top / "home" / "user" / "mine").stat().st_uid == 1000
    assert (top / "root" / "mine").stat().st_uid == 0
    made = await owned.create(SandboxSpec(image="owners-made:v1", memory="128Mi"))
    async with await ready(made) as sb:
        assert await _stat(sb, "/home/user/mine", "/root/mine") == ["1000:1000", "0:0"]


# -- what a create leaves, and who adopts it --------------------------------------------


def _holders(base: int) -> list[int]:
    """Host processes running with an id of the range, or in a namespace ``base`` owns."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            uids, _ = _ids(int(proc.name))
            owner = _owner_of_userns(int(proc.name))
        except (OSError, KeyError):
            continue
        if any(base <= u < base + userns.RANGE for u in uids) or owner == base:
            found.append(int(proc.name))
    return found


def _mounts_naming(path: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path) in (proc / "mountinfo").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def test_delete_leaves_no_namespace_no_mount_and_frees_the_range(
    provider: LocalProvider,
) -> None:
    info = await provider.create(SPEC)
    directory = provider.config.state_dir.resolve() / "sandboxes" / info.id
    base = _base(provider, info.id)
    slot = (base - userns.FIRST_ID) // userns.RANGE
    async with await ready(info) as sb:
        await sb.exec("true", check=True)
    assert userns.holder(slot) == str(directory)
    assert _holders(base)
    # The namespace was bound in the helper's private mount namespace only: no host
    # mount, and none the sandbox keeps (its own mount table names no host path).
    assert _mounts_naming(directory / userns.MOUNT_POINT) == []
    await provider.delete(info.id)
    assert userns.holder(slot) is None
    # Its PID 1, killed, may be a zombie a moment longer, until the host's init reaps it.
    await eventually(lambda: _holders(base) == [], what="no process of the range")
    assert not directory.exists()
    assert _mounts_naming(directory) == []


async def test_a_restarted_provider_adopts_restores_in_the_same_range_and_frees_it(
    state_dir: Path, busybox_tar: Path
) -> None:
    config = config_for(state_dir)
    async with provider_for(config, busybox_tar) as first:
        info = await first.create(SPEC)
        base = _base(first, info.id)
        async with await ready(info) as sb:
            await sb.write_file("/root/kept", b"k")
        snapshot = await first.snapshot(info.id)
        adopter = LocalProvider(config)  # a new process would start so
        try:
            [seen] = await adopter.list()
            assert seen.id == info.id and seen.endpoint is not None
            async with await ready(seen) as sb:
                assert (await sb.exec("id -u", check=True)).stdout == "0\n"
            restored = await adopter.restore(info.id, snapshot.id)
            assert _base(adopter, info.id) == base
            assert restored.endpoint is not None and restored.endpoint.pid is not None
            assert _owner_of_userns(restored.endpoint.pid) == base
            async with await ready(restored) as sb:
                assert await sb.read_file("/root/kept") == b"k"
                assert await _stat(sb, "/root/kept") == ["0:0"]
            await adopter.delete(info.id)
            assert userns.holder((base - userns.FIRST_ID) // userns.RANGE) is None
        finally:
            await adopter.aclose()


async def test_a_networked_sandbox_sees_its_own_sysfs_read_only(provider: LocalProvider) -> None:
    """The host made its network namespace, which its user namespace does not own: crun
    would bind the host's /sys (the host's interfaces); overlay-exec mounts its own."""
    info = await provider.create(SPEC.model_copy(update={"network": "isolated"}))
    async with await ready(info) as sb:
        seen = await sb.exec("ls /sys/class/net; ls -A /sys/fs/btrfs /sys/firmware", check=True)
        assert sorted(seen.stdout.split()) == sorted(
            ["eth0", "lo", "/sys/fs/btrfs:", "/sys/firmware:"]
        )
        refused = await sb.exec("echo 1 > /sys/kernel/uevent_helper")
        assert refused.exit_code != 0 and "Read-only file system" in refused.stderr


# -- the ranges ---------------------------------------------------------------------------


def test_ranges_are_disjoint_and_a_dead_holders_is_taken_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(userns, "REGISTRY", tmp_path / "registry")
    dirs = [tmp_path / f"sb-{i}" for i in range(300)]
    for d in dirs:
        d.mkdir()
    bases = [userns.allocate(d) for d in dirs]
    assert len(set(bases)) == len(bases)
    assert all((b - userns.FIRST_ID) % userns.RANGE == 0 for b in bases)
    assert all(userns.FIRST_ID <= b < userns.FIRST_ID + userns.SLOTS * userns.RANGE for b in bases)
    assert [userns.allocate(d) for d in dirs[:5]] == bases[:5]  # held: the same again
    # A holder whose directory is gone (a removed state directory), or which records
    # another range (a crash between the two writes), holds nothing; a live one does.
    gone, moved = dirs[0], dirs[1]
    shutil.rmtree(gone)
    (moved / userns.IDS).write_text(str(bases[2]))
    tried = _slots([bases[3], bases[0], bases[3], bases[1]])
    monkeypatch.setattr(userns, "_candidates", lambda: iter(tried))
    late = [tmp_path / "late-a", tmp_path / "late-b"]
    for d in late:
        d.mkdir()
    assert [userns.allocate(d) for d in late] == [bases[0], bases[1]]
    assert userns.allocate(dirs[3]) == bases[3]
    for d in dirs[2:]:
        userns.release(d)
        assert not (d / userns.IDS).exists() and not (d / userns.MOUNT_POINT).exists()
    userns.release(dirs[2])  # again: nothing
    left = {p.name for p in (tmp_path / "registry").iterdir() if not p.name.startswith(".")}
    assert left == {str(s) for s in _slots(bases[:2])}
    monkeypatch.setattr(userns, "_candidates", lambda: iter(()))
    with pytest.raises(CapacityError, match="user-namespace id ranges"):
        userns.allocate(tmp_path / "sb-4")


async def test_a_range_stays_taken_while_an_orphan_of_it_runs(
    provider: LocalProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox whose directory was removed out of band runs on under its range until
    the reconcile deletes it: meanwhile no other sandbox gets that range."""
    info = await provider.create(SPEC)
    directory = provider.config.state_dir.resolve() / "sandboxes" / info.id
    base = _base(provider, info.id)
    [slot] = _slots([base])
    newcomer = tmp_path / "newcomer"
    newcomer.mkdir()
    try:
        async with await ready(info) as sb:
            await sb.exec("true", check=True)
        remove_tree(directory)  # out of band: its container runs on
        assert _holders(base)
        # The allocator is sent to that slot alone (fault injection: a random pick).
        monkeypatch.setattr(userns, "_candidates", lambda: iter([slot]))
        assert userns.held(slot)
        with pytest.raises(CapacityError):
            userns.allocate(newcomer)
        assert userns.holder(slot) == str(directory)
        await provider.delete(info.id)  # what the reconcile does with the orphan
        await eventually(lambda: _holders(base) == [], what="no process of the range")
        assert not userns.held(slot)
        assert userns.allocate(newcomer) == base
    finally:
        await provider.delete(info.id)
        userns.release(newcomer)
        if userns.holder(slot) == str(directory):  # failed before the newcomer took it
            (userns.REGISTRY / str(slot)).unlink()
    assert userns.holder(slot) is None


def _slots(bases: list[int]) -> list[int]:
    return [(b - userns.FIRST_ID) // userns.RANGE for b in bases]
