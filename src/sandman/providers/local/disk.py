"""Per-sandbox disk limits: each sandbox's writable layer is a btrfs subvolume with a quota.

One btrfs filesystem per state directory, in a sparse image file
(``<state_dir>/disk.img``) loop-mounted at ``<state_dir>/disk``; each
sandbox's overlay ``upper/`` and ``work/`` live in the subvolume
``<state_dir>/disk/<id>``, created with its qgroup limit in the same ioctl.
A write past the limit fails in the kernel with EDQUOT ("Disk quota
exceeded"), which the daemon reports as ``no_space``. Metadata (inodes,
directories) counts too, so a million empty files hit the limit as well.

Why this and not another mechanism (measured on kernel 6.18, ext4 ``/``):

- ext4/XFS project quotas: this kernel has no ``CONFIG_QFMT_V2`` (ext4
  refuses to mount a filesystem with the ``quota`` feature) and no
  ``CONFIG_XFS_QUOTA``; both are common in distribution kernels to be off.
  btrfs quotas need no format module.
- one filesystem image per sandbox: mkfs + loop + mount costs 54 ms per
  sandbox (35 ms with a pre-made template copied), a loop device and a
  host mount each -- the host mount table every new container copies grows
  with the sandbox count.
- here: one loop device and one mount for the whole state directory;
  creating a subvolume with its limit takes ~0.05 ms, destroying it ~0.02 ms;
  the kernel drops the qgroup itself once the subvolume is gone.

Simple quotas (``squota``, kernel >= 6.7) are used where the kernel has
them: no backref walks at commit, fit for layers that share nothing; older
kernels get full qgroups. The image is as large as the state directory's
filesystem and sparse: it takes host space only for what sandboxes hold,
and ``discard=async`` gives deleted data back to the host. Discards still queued
at an unmount are lost, and a deleted subvolume's blocks are freed later, by
btrfs's cleaner: before each unmount the pool waits for the cleaner and trims
the free space (``FITRIM``), and it trims again after each mount (what a crash
left), so the host keeps no deleted sandbox's blocks.

The filesystem is mounted at the first create with a limit and stays
mounted while sandboxes hold subvolumes; `DiskPool.release` (called by the
provider's ``aclose``) unmounts it when none are left, and the loop device
(autoclear) goes with it. Every step takes ``<state_dir>/disk.lock`` so
that processes sharing a state directory agree on the mount.

A full state directory: a write of btrfs into its sparse image fails there, btrfs
aborts the transaction and turns read-only for good (it refuses a remount; reads in
it fail with EIO, so the sandboxes with a layer in it are broken). Whichever process
next takes the lock to create, remove or release finds it so and discards it whole:
the mount detached, the image unlinked. Its live sandboxes' overlays hold it until
they are deleted, which frees its space; their removes find nothing left to do. The
next create makes a fresh filesystem, or, while the state directory is still full,
fails with a ProviderError saying so. Why not preallocate the image instead, which
would keep btrfs writable (measured on ext4: ``fallocate`` ~18 ms per GiB, mkfs then
0.3 s): the image is as large as the state directory's filesystem (thin provisioning:
limits add up past it), which cannot be reserved up front; a smaller image reserved
would cap what all sandboxes together may write, and hold that much host disk while
they write nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from sandman import errors

__all__ = ["SNAPSHOTS", "DiskPool", "probe"]

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_MIN_IMAGE = 256 * 2**20  # mkfs.btrfs needs ~114 MiB; leave room for the layers
# A fresh filesystem takes ~5 MiB of its sparse image, more with the first layers: with
# less room it would abort again at once, and mkfs says only "Input/output error".
_MIN_FREE = 64 * 2**20
_MOUNT_OPTIONS = "loop,discard=async,noatime"
_SUBVOL_ROOT_INO = 256  # the root directory of every btrfs subvolume has this inode number


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | number  # BTRFS_IOCTL_MAGIC


_W, _R, _RW = 1, 2, 3
_IOC_SNAP_DESTROY = _ioc(_W, 15, 4096)  # struct btrfs_ioctl_vol_args
_IOC_FS_INFO = _ioc(_R, 31, 1024)  # struct btrfs_ioctl_fs_info_args
_IOC_SUBVOL_CREATE_V2 = _ioc(_W, 24, 4096)  # struct btrfs_ioctl_vol_args_v2
_IOC_SNAP_CREATE_V2 = _ioc(_W, 23, 4096)  # struct btrfs_ioctl_vol_args_v2
_IOC_QUOTA_CTL = _ioc(_RW, 40, 16)  # struct btrfs_ioctl_quota_ctl_args
_IOC_INO_LOOKUP = _ioc(_RW, 18, 4096)  # struct btrfs_ioctl_ino_lookup_args
_IOC_START_SYNC = _ioc(_R, 24, 8)  # __u64 transid
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_SUBVOL_RDONLY = 1 << 1
_SUBVOL_QGROUP_INHERIT = 1 << 2
_INHERIT_SET_LIMITS = 1 << 0
_LIMIT_MAX_RFER = 1 << 0
_INHERIT_SIZE = 72  # struct btrfs_qgroup_inherit with no qgroups
_V2_NAME_OFFSET = 56  # offsetof(struct btrfs_ioctl_vol_args_v2, name)

SNAPSHOTS = ".snapshots"
"""Where snapshots' layers live in the filesystem: a name no sandbox id can take."""

_MNT_DETACH = 2
_FITRIM = (3 << 30) | (24 << 16) | (ord("X") << 8) | 121  # _IOWR('X', 121, fstrim_range)
_libc = ctypes.CDLL(None, use_errno=True)


def _subvolume_create(
    parent_fd: int, name: str, limit: int | None, *, source_fd: int = -1, readonly: bool = False
) -> None:
    """BTRFS_IOC_SUBVOL_CREATE_V2 with a qgroup limit: the subvolume never exists unlimited.
    With ``source_fd``, BTRFS_IOC_SNAP_CREATE_V2: a snapshot of that subvolume (shared
    extents, copy-on-write; its cost does not grow with the tree)."""
    inherit = ctypes.create_string_buffer(_INHERIT_SIZE)
    # flags, num_qgroups, num_ref_copies, num_excl_copies, then btrfs_qgroup_limit:
    # flags, max_rfer, max_excl, rsv_rfer, rsv_excl.
    if limit is not None:
        struct.pack_into(
            "4Q5Q", inherit, 0, _INHERIT_SET_LIMITS, 0, 0, 0, _LIMIT_MAX_RFER, limit, 0, 0, 0
        )
    flags = (_SUBVOL_QGROUP_INHERIT if limit is not None else 0) | (
        _SUBVOL_RDONLY if readonly else 0
    )
    args = bytearray(4096)
    struct.pack_into(
        "qQQQQ", args, 0, source_fd, 0, flags, _INHERIT_SIZE, ctypes.addressof(inherit)
    )
    encoded = name.encode()
    args[_V2_NAME_OFFSET : _V2_NAME_OFFSET + len(encoded)] = encoded
    command = _IOC_SNAP_CREATE_V2 if source_fd >= 0 else _IOC_SUBVOL_CREATE_V2
    fcntl.ioctl(parent_fd, command, args)


def _subvolume_destroy(parent_fd: int, name: str) -> None:
    args = bytearray(4096)
    encoded = name.encode()
    args[8 : 8 + len(encoded)] = encoded
    fcntl.ioctl(parent_fd, _IOC_SNAP_DESTROY, args)


def _fsid(fd: int) -> str:
    args = bytearray(1024)
    fcntl.ioctl(fd, _IOC_FS_INFO, args)
    return str(uuid.UUID(bytes=bytes(args[16:32])))


def _enable_quotas(fd: int) -> str:
    """Turn quotas on (simple quotas where the kernel has them); idempotent. Returns the mode."""
    for command in (_QUOTA_ENABLE_SIMPLE, _QUOTA_ENABLE):
        try:
            fcntl.ioctl(fd, _IOC_QUOTA_CTL, bytearray(struct.pack("QQ", command, 0)))
            break
        except OSError as exc:
            if exc.errno != errno.EINVAL or command == _QUOTA_ENABLE:
                raise
    qgroups = Path("/sys/fs/btrfs") / _fsid(fd) / "qgroups"
    # Without quotas on, a subvolume's limit would be silently dropped: check, don't trust.
    if not (qgroups / "enabled").exists() or (qgroups / "enabled").read_text().strip() != "1":
        raise errors.ProviderError(f"btrfs quotas did not turn on ({qgroups})")
    mode = qgroups / "mode"
    return mode.read_text().strip() if mode.exists() else "qgroup"


def _umount(path: Path, *, detach: bool = False) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH if detach else 0) != 0:
        code = ctypes.get_errno()
        if code != errno.EINVAL:  # EINVAL: not a mount point (any more)
            raise OSError(code, os.strerror(code), str(path))


def _failed(exc: OSError, where: Path) -> errors.ProviderError:
    return errors.ProviderError(
        f"the disk filesystem failed at {exc.filename or where}: {exc.strerror or exc}"
    )


def _make_image(image: Path, size: int) -> None:
    """A sparse file of ``size`` bytes holding an empty btrfs; made aside, then renamed."""
    mkfs = shutil.which("mkfs.btrfs")
    if mkfs is None:
        raise errors.ConfigError(
            "per-sandbox disk limits need mkfs.btrfs: apt-get install -y btrfs-progs "
            "(or set LocalConfig.disk=None)"
        )
    partial = image.with_name(image.name + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    stats = os.statvfs(image.parent)
    if stats.f_bavail * stats.f_frsize < _MIN_FREE:
        raise errors.ProviderError(
            f"cannot make the disk filesystem {image}: its filesystem is full "
            f"({stats.f_bavail * stats.f_frsize // 2**20} MiB free): "
            f"{os.strerror(errno.ENOSPC)}"
        )
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    done = subprocess.run(
        [mkfs, "-q", "-f", "-m", "single", "-d", "single", "--nodiscard", str(partial)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        partial.unlink()
        raise errors.ProviderError(f"mkfs.btrfs {partial} failed: {done.stderr.strip()}")
    os.rename(partial, image)


class DiskPool:
    """The btrfs filesystem of one state directory and its per-sandbox subvolumes.

    Methods block (ioctls, and a mount now and then): call them in a thread.
    """

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "disk"
        self.image = state_dir / "disk.img"
        self._lock_path = state_dir / "disk.lock"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, held while the block runs; a failing state directory (read-only,
        full) in it is a ProviderError naming the path, not a bare OSError."""
        try:
            # flock on a fresh open file: excludes other processes and our own threads.
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _failed(exc, self._lock_path) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            raise _failed(exc, self.root) from exc
        finally:
            os.close(fd)

    def mounted(self) -> bool:
        """Whether the filesystem is mounted at ``root``."""
        try:
            return os.stat(self.root).st_dev != os.stat(self.root.parent).st_dev
        except FileNotFoundError:
            return False

    def _image_size(self) -> int:
        stats = os.statvfs(self.root.parent)
        return max(_MIN_IMAGE, stats.f_blocks * stats.f_frsize)

    def aborted(self) -> bool:
        """Whether the mounted filesystem turned read-only: btrfs does when it cannot
        write its image (the state directory full), for good."""
        return self.mounted() and bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)

    def _discard(self) -> None:
        """Let go of an aborted filesystem, layers and all (see the module's docstring)."""
        # The image first: if it cannot go (a read-only state directory), the filesystem
        # stays mounted for the next try, rather than its stale image being mounted anew.
        self.image.unlink(missing_ok=True)
        _umount(self.root, detach=True)  # live sandboxes' overlays hold it, not the host
        logger.warning(
            "the disk filesystem at %s had turned read-only (its state directory full?): "
            "discarded; sandboxes with a layer in it are broken (EIO) and hold it until deleted",
            self.root,
        )

    def _mount(self) -> None:
        """Mount the filesystem, making it first if need be; one that aborted is replaced."""
        if self.mounted():
            if not self.aborted():
                return
            self._discard()
        self.root.mkdir(mode=0o700, exist_ok=True)
        if not self.image.exists():
            _make_image(self.image, self._image_size())
        done = subprocess.run(
            ["mount", "-t", "btrfs", "-o", _MOUNT_OPTIONS, str(self.image), str(self.root)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise errors.ProviderError(f"cannot mount {self.image}: {done.stderr.strip()}")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _enable_quotas(fd)
        except BaseException:
            _umount(self.root)
            raise
        finally:
            os.close(fd)
        self._trim()

    def _trim(self) -> None:
        """Give the host back the image's blocks the filesystem does not use (a deleted
        subvolume's once the cleaner has dropped it, waited for here)."""
        subprocess.run(
            ["btrfs", "subvolume", "sync", str(self.root)],
            capture_output=True,
            timeout=60,
            check=False,
        )
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _FITRIM, struct.pack("QQQ", 0, 2**64 - 1, 0))
        except OSError as exc:  # e.g. a state directory whose filesystem cannot discard
            logger.debug("cannot trim %s: %s", self.root, exc)
        finally:
            os.close(fd)

    def create(self, sandbox_id: str, limit: int) -> Path:
        """The sandbox's layer directory, holding empty ``upper/`` and ``work/``; at most
        ``limit`` bytes (data and metadata) can be written under it."""
        with self._locked():
            self._mount()
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _subvolume_create(fd, sandbox_id, limit)
            except OSError as exc:
                raise errors.ProviderError(
                    f"cannot create the disk layer of {sandbox_id}: {exc}"
                ) from exc
            finally:
                os.close(fd)
        layer = self.root / sandbox_id
        try:
            (layer / "upper").mkdir()
            (layer / "work").mkdir()
        except OSError as exc:
            # The filesystem aborted just now, most likely: no layer without its dirs.
            with contextlib.suppress(OSError, errors.SandboxError):
                self.remove(sandbox_id)
            raise _failed(exc, layer) from exc
        return layer

    def has(self, name: str) -> bool:
        """Whether ``name`` (a sandbox id, or `SNAPSHOTS`/<snapshot id>) is a layer here."""
        if not self.mounted():
            return False
        try:
            return os.stat(self.root / name).st_ino == _SUBVOL_ROOT_INO
        except OSError:
            return False

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> int:
        """A read-only snapshot of the sandbox's layer, as `SNAPSHOTS`/<snapshot_id>;
        returns the bytes the layer held. The sandbox must not be writing (paused)."""
        with self._locked():
            if not self.mounted() or self.aborted():
                raise errors.ProviderError(f"the disk filesystem at {self.root} is not mounted")
            held = self.root / SNAPSHOTS
            held.mkdir(mode=0o700, exist_ok=True)
            source = os.open(self.root / sandbox_id, os.O_RDONLY | os.O_DIRECTORY)
            parent = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _subvolume_create(parent, snapshot_id, None, source_fd=source, readonly=True)
            except OSError as exc:
                raise errors.ProviderError(
                    f"cannot snapshot the disk layer of {sandbox_id}: {exc}"
                ) from exc
            finally:
                os.close(parent)
                os.close(source)
        used = self.usage(sandbox_id)
        return used[0] if used is not None else 0

    def clone(self, snapshot_id: str, sandbox_id: str, limit: int | None) -> Path:
        """The sandbox's layer as a writable snapshot of `SNAPSHOTS`/<snapshot_id>, at most
        ``limit`` bytes (None: no limit of its own)."""
        with self._locked():
            self._mount()
            source_path = self.root / SNAPSHOTS / snapshot_id
            try:
                source = os.open(source_path, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                raise errors.SnapshotNotFound(
                    f"snapshot {snapshot_id} holds no files at {source_path}"
                ) from None
            parent = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _subvolume_create(parent, sandbox_id, limit, source_fd=source)
            except OSError as exc:
                raise errors.ProviderError(
                    f"cannot make the disk layer of {sandbox_id} from {snapshot_id}: {exc}"
                ) from exc
            finally:
                os.close(parent)
                os.close(source)
        return self.root / sandbox_id

    def remove(self, sandbox_id: str) -> None:
        """Destroy the sandbox's layer and, with it, its quota; fine if it is gone.
        ``sandbox_id`` may be `SNAPSHOTS`/<snapshot id>: a snapshot's."""
        with self._locked():
            if self.aborted():
                self._discard()  # and the layer with it: nothing left to do
            was_mounted = self.mounted()
            if not was_mounted:
                if not self.image.exists():
                    return
                self._mount()  # after a reboot or a crash: its layer may still be inside
            parent, _, name = sandbox_id.rpartition("/")
            try:
                fd = os.open(self.root / parent, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                return
            try:
                _subvolume_destroy(fd, name)
                # Start (not wait for) a commit: it wakes the cleaner, which frees the
                # layer's space and drops its qgroup now rather than within 30 s.
                fcntl.ioctl(fd, _IOC_START_SYNC, bytearray(8))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise errors.ProviderError(
                    f"cannot remove the disk layer of {sandbox_id}: {exc}"
                ) from exc
            finally:
                os.close(fd)
            if not was_mounted:
                self._unmount_if_empty()

    def names(self) -> list[str]:
        """The sandbox ids that hold a layer (none while unmounted, nor in an aborted
        filesystem: they go with it)."""
        if not self.mounted() or self.aborted():
            return []
        try:
            return [e.name for e in os.scandir(self.root) if _ID.match(e.name)]
        except OSError as exc:
            if self.aborted():  # just now
                return []
            raise _failed(exc, self.root) from exc

    def release(self) -> None:
        """Unmount the filesystem if no sandbox holds a layer in it; its loop device goes too."""
        with self._locked():
            if self.aborted():
                self._discard()
            elif self.mounted():
                self._unmount_if_empty()

    def snapshot_names(self) -> list[str]:
        """The snapshot ids that hold a layer here."""
        if not self.mounted() or self.aborted():
            return []
        try:
            return [e.name for e in os.scandir(self.root / SNAPSHOTS) if _ID.match(e.name)]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _failed(exc, self.root) from exc

    def _unmount_if_empty(self) -> None:
        with contextlib.suppress(OSError):  # not empty: snapshots hold it
            (self.root / SNAPSHOTS).rmdir()
        with os.scandir(self.root) as entries:
            empty = next(entries, None) is None
        if empty:
            self._trim()
            _umount(self.root)

    def usage(self, sandbox_id: str) -> tuple[int, int] | None:
        """(bytes used, limit) of a sandbox's layer from the kernel's qgroup; None if it has none."""
        if not self.mounted() or self.aborted():
            return None
        try:
            fd = os.open(self.root / sandbox_id, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_ino != _SUBVOL_ROOT_INO:
                return None
            qgroup = Path("/sys/fs/btrfs") / _fsid(fd) / "qgroups" / f"0_{_subvolume_id(fd)}"
        finally:
            os.close(fd)
        used = int((qgroup / "referenced").read_text())
        limit = (qgroup / "max_referenced").read_text().strip()
        return used, int(limit) if limit.isdigit() else 0

    def qgroups(self) -> list[str]:
        """The level-0 qgroups other than the top level's (``0_<subvolume id>``); for tests."""
        if not self.mounted():
            return []
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            qgroups = Path("/sys/fs/btrfs") / _fsid(fd) / "qgroups"
        finally:
            os.close(fd)
        return sorted(p.name for p in qgroups.glob("0_*") if p.name != "0_5")


def _subvolume_id(fd: int) -> int:
    args = bytearray(4096)
    struct.pack_into("QQ", args, 0, 0, _SUBVOL_ROOT_INO)
    fcntl.ioctl(fd, _IOC_INO_LOOKUP, args)
    return int(struct.unpack_from("Q", args, 0)[0])


def probe() -> tuple[bool, str]:
    """Try the whole mechanism in a scratch directory: image, mount, quota, a
    subvolume with a 16 MiB limit written past. Returns (works, why not)."""
    if os.geteuid() != 0:
        return False, "needs root"
    scratch = Path(tempfile.mkdtemp(prefix="sandman-disk-probe-"))
    pool = DiskPool(scratch)
    try:
        pool.root.mkdir()
        _make_image(pool.image, _MIN_IMAGE)
        layer = pool.create("probe", 16 * 2**20)
        try:
            with open(layer / "upper" / "fill", "wb") as handle:
                handle.writelines(b"\0" * 2**20 for _ in range(32))
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            if exc.errno not in (errno.EDQUOT, errno.ENOSPC):
                return False, f"writing past the limit failed with {exc}"
        else:
            return False, "32 MiB written past a 16 MiB limit: quotas are not enforced"
        finally:
            pool.remove("probe")
        return True, ""
    except (OSError, subprocess.SubprocessError, errors.SandboxError) as exc:
        return False, str(exc)
    finally:
        with contextlib.suppress(OSError):
            pool.release()
        shutil.rmtree(scratch, ignore_errors=True)
