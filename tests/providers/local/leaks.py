"""What a deleted sandbox must not leave: containers, cgroups, mounts, processes, files.

Each test's provider uses its own cgroup parent, so anything found under it
belongs to that test.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio

from sandman.providers.local import LocalProvider
from sandman.providers.local.host import remove_cgroup_parent

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_parents(provider: LocalProvider) -> list[Path]:
    parent = provider.config.cgroup_parent.strip("/")
    return [h / parent for h in CGROUP_ROOT.iterdir() if (h / parent).is_dir()]


def leftovers(provider: LocalProvider, *, closed: bool = False) -> list[str]:
    """Everything of the provider's sandboxes that still exists; ``closed``: also the
    disk filesystem's mount and loop device, which go when the provider is closed."""
    state = provider.config.state_dir.resolve()
    sandboxes = state / "sandboxes"
    found: list[str] = []
    if sandboxes.exists():
        found += [f"dir {p}" for p in sandboxes.iterdir()]
    # Disk layers (btrfs subvolumes) and, once the provider is closed, the
    # filesystem's mount and loop device: see providers/local/disk.py.
    found += [f"disk layer {name}" for name in provider.disk.names()]
    found += [f"snapshot {info.id}" for info in provider.snapshot_store.list()]
    if provider.snapshot_store.root.exists():
        found += [f"snapshot file {p.name}" for p in provider.snapshot_store.root.iterdir()]
    layers = f"{state / 'disk'}/"
    runtime_state = state / "runtime" / provider.config.runtime
    if runtime_state.exists():
        found += [f"runtime state {p}" for p in runtime_state.iterdir()]
    for parent in _cgroup_parents(provider):
        found += [f"cgroup {p}" for p in parent.iterdir() if p.is_dir()]
    cgroup_parent = provider.config.cgroup_parent.rstrip("/") + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            mountinfo = (proc / "mountinfo").read_text()
            cgroups = (proc / "cgroup").read_text()
        except OSError:
            continue
        if str(sandboxes) in mountinfo or layers in mountinfo:
            found.append(f"a mount of pid {proc.name} refers to a sandbox's files")
        if closed and f" {state / 'disk'} " in mountinfo:
            found.append(
                f"pid {proc.name} still mounts {state / 'disk'}: "
                f"{(proc / 'cmdline').read_bytes()[:80]!r} {_namespace(proc)}"
            )
        if f":{cgroup_parent}" in cgroups:
            found.append(f"process {proc.name} in {cgroup_parent}")
    if closed:
        found += [f"loop device {d}" for d in loop_devices(state / "disk.img")]
    return found


def loop_devices(image: Path) -> list[str]:
    """Loop devices whose backing file is ``image``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        text = backing.read_text().strip().removesuffix(" (deleted)")
        if text == str(image):
            found.append(backing.parent.parent.name)
    return found


async def assert_nothing_left(provider: LocalProvider) -> None:
    """After the provider is closed: wait (with a deadline) until nothing is left,
    then remove the empty cgroup parents."""
    deadline = time.monotonic() + 10
    while (left := leftovers(provider, closed=True)) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not left, left
    # Its own parent must go; the shared /sandman-test stays only while another run uses it.
    own = set(_cgroup_parents(provider))
    busy = remove_cgroup_parent(provider.config.cgroup_parent)
    assert not own & set(busy), busy


def _namespace(proc: Path) -> str:
    try:
        return os.readlink(proc / "ns" / "mnt")
    except OSError as exc:  # a non-dumpable process's (the VM's init here)
        return f"(mount namespace unreadable: {exc.strerror})"
