"""What a sandbox sees of /dev, /sys and its cgroups without a superblock of its own (crun).

Every superblock on the host adds a shrinker slot to every memory cgroup on the host,
and each sandbox brings both, so that memory grows with the square of the sandbox
count: 1 KiB per 64 superblocks per memory cgroup (`host.memory_for`). A sandbox's
own are its overlay root, its /proc, its devpts and the mqueue of its IPC namespace
(the kernel makes that one with the namespace, mounted or not). The rest it sees here:

- ``/dev`` and ``/dev/shm``: directories of its own layer (`make_dev`), which the
  runtime fills with the usual device nodes; files of the sandbox like any other (on
  its disk limit, in its snapshots). As the tmpfs did, the layer's /dev hides the
  image's (an opaque directory), and what the runtime makes there is made anew at
  each start. `LocalConfig.dev_tmpfs` gives a tmpfs of its own for each instead.
- ``/sys`` of a sandbox without a network: the sysfs of one empty network namespace
  (`SharedNetns`), mounted read-only by ``sandmand overlay-exec --sysfs``. The kernel
  keeps one sysfs superblock per network namespace, so all such sandboxes share one;
  it shows what their own would (only ``lo``, up, no traffic: no process is in that
  namespace). `LocalConfig.own_sysfs` gives each its own; a sandbox with a network
  always has its own (its interfaces).
- ``/sys/fs/cgroup`` on cgroup v1: a read-only skeleton (`cgroup_skeleton`) with a
  directory per hierarchy, each the bind of the sandbox's own cgroup: the runtime's
  view needs a tmpfs to hold those directories. The view is the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import socket
import stat
import struct
import threading
from pathlib import Path

from sandman import errors

__all__ = ["SharedNetns", "cgroup_skeleton", "hierarchies", "make_dev"]

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_OPAQUE = "trusted.overlay.opaque"  # the overlay is mounted in the host's user namespace
# What crun makes in a /dev that is no mount of its own, at each start: its default
# devices, their symlinks, the mount points of devpts and mqueue (and /dev/console
# with a terminal). Removed from the layer first, so that it makes them anew: it keeps
# what is there already, which a snapshot's sandbox may have replaced, or a sandbox
# made in another configuration (an empty file, the mount point of a bound device
# under user namespaces, where a device node is made without).
_RUNTIME_DEV = (
    "console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random",
    "stderr", "stdin", "stdout", "tty", "urandom", "zero",
)  # fmt: skip
_CGROUP_ROOT = Path("/sys/fs/cgroup")
# crun's names for the hierarchies whose /proc/self/cgroup name differs from their
# directory's (libcrun/linux.c, do_mount_cgroup_v1).
_RENAMED = {"net_prio,net_cls": "net_cls,net_prio", "cpuacct,cpu": "cpu,cpuacct"}


class SharedNetns:
    """One empty network namespace (only a loopback, up), held open by this process,
    whose sysfs every sandbox sees: its ``path`` goes to ``overlay-exec --sysfs``."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._lock = threading.Lock()

    def path(self) -> str:
        """A path that opens the namespace, made on first use."""
        with self._lock:
            if self._fd is None:
                self._fd = _empty_netns()
            return f"/proc/{os.getpid()}/fd/{self._fd}"

    def close(self) -> None:
        """Let go of the namespace: it lives on while a sandbox's sysfs holds it; the
        next `path` makes a new one."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _empty_netns() -> int:
    """A descriptor of a new network namespace, made by a thread of its own that ends
    then (a namespace is a thread's; no other thread of this process moves)."""
    made: list[int] = []
    failed: list[OSError] = []

    def unshare() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            failed.append(OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}"))
            return
        try:
            _loopback_up()
            made.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=unshare, name="sandman-sysfs-netns", daemon=True)
    thread.start()
    thread.join()
    if failed or not made:
        reason = failed[0].strerror if failed else "no descriptor"
        raise errors.ProviderError(f"cannot make the network namespace /sys shows: {reason}")
    return made[0]


def _loopback_up() -> None:
    """Bring up ``lo`` of this thread's network namespace: a sandbox's own is up (the
    runtime brings it up), and its /sys/class/net/lo says so (``flags``, ``operstate``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)  # struct ifreq: name, flags, padding
        _, flags = struct.unpack("16sh22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def hierarchies(proc_cgroup: str | None = None) -> tuple[str, ...]:
    """The cgroup v1 hierarchies crun shows a sandbox at /sys/fs/cgroup/<name>, named as
    their directories there (this process's ``/proc/self/cgroup``, as crun reads its
    own); () on a cgroup v2 host, where the view is no tmpfs."""
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    names: list[str] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[1]:
            continue  # cgroup v2's line ("0::/..."): crun's v1 view leaves it out
        name = parts[1].split("name=", 1)[-1]
        name = _RENAMED.get(name, name)
        if (_CGROUP_ROOT / name).is_dir() and name not in names:
            names.append(name)
    return tuple(names)


def cgroup_skeleton(path: Path, names: tuple[str, ...]) -> None:
    """Make ``path`` the read-only skeleton of a sandbox's /sys/fs/cgroup: root's, mode
    0555, an empty directory per hierarchy in ``names`` and the host's symlinks to them
    (``cpu -> cpu,cpuacct``). Idempotent; what is there already stays."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o555)
    _check_dir(path)
    for name in names:
        with contextlib.suppress(FileExistsError):
            (path / name).mkdir(mode=0o555)
        _check_dir(path / name)
    for entry in _CGROUP_ROOT.iterdir():
        if entry.is_symlink() and os.readlink(entry) in names:
            link = path / entry.name
            if not link.is_symlink() or os.readlink(link) != os.readlink(entry):
                with contextlib.suppress(FileNotFoundError):
                    link.unlink()
                link.symlink_to(os.readlink(entry))


def _check_dir(path: Path) -> None:
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o777 != 0o555:
        raise errors.ProviderError(f"{path} must be a directory of root's, mode 0555")


def make_dev(upper: Path) -> None:
    """Make ``dev`` (0755, opaque: the image's /dev stays hidden, as under a tmpfs) and
    ``dev/shm`` (1777) in the overlay upper directory ``upper``: the sandbox's /dev and
    /dev/shm, directories of its own files, kept across its snapshots. What the runtime
    makes there (`_RUNTIME_DEV`) is removed, for it to make anew. A ``dev`` or ``dev/shm``
    that is not a directory (the sandbox's doing, kept by a snapshot) is replaced by
    one; nothing here follows a symlink."""
    root = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dev = _subdir(root, "dev", 0o755)
        try:
            os.setxattr(dev, _OPAQUE, b"y")
            for name in _RUNTIME_DEV:
                _remove(dev, name)
            os.close(_subdir(dev, "shm", 0o1777))
        finally:
            os.close(dev)
    finally:
        os.close(root)


def _remove(parent: int, name: str) -> None:
    """Remove ``name`` from the directory ``parent``, whatever it is, if it is there."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)  # by descriptors: no symlink in it is followed
    else:
        os.unlink(name, dir_fd=parent)


def _subdir(parent: int, name: str, mode: int) -> int:
    """The directory ``name`` in ``parent``, made with ``mode`` (root's) if absent or
    not a directory (removed then, never followed)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(name, dir_fd=parent).st_mode):
            return os.open(name, flags, dir_fd=parent)
        os.unlink(name, dir_fd=parent)
    os.mkdir(name, mode, dir_fd=parent)
    fd = os.open(name, flags, dir_fd=parent)
    os.fchmod(fd, mode)  # past the umask (1777 for /dev/shm)
    return fd
