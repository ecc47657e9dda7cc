"""Snapshots of local sandboxes: their records and their files.

Under ``<state_dir>/snapshots/<id>/``: ``meta.json`` (the record, written first under a
staging name and renamed into place, as a sandbox's is) and, without a disk filesystem,
``upper/`` (a copy of the sandbox's overlay layer). A snapshot with memory (gVisor) also
has ``memory/`` (``runsc checkpoint``'s image of every process) and ``token`` (the
daemon's token in that image, which a sandbox restored from it replaces at once). With one (`disk`), the files are a
read-only btrfs snapshot of the sandbox's layer subvolume, ``<state_dir>/disk/.snapshots/<id>``:
made in constant time whatever the tree's size, and shared, block for block, with the
sandbox and with every sandbox made from it until one of them writes.

The snapshot's directory is flocked shared while a sandbox is made from it and
exclusively while it is deleted: a delete never pulls the files out from under a
create in flight (and once made, a sandbox's layer is its own).
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sandman import errors
from sandman.images import Image
from sandman.models import SandboxSpec
from sandman.providers.base import SnapshotInfo
from sandman.providers.local.disk import SNAPSHOTS, DiskPool
from sandman.providers.local.trees import remove_tree

__all__ = ["SnapshotStore", "image_users", "new_snapshot_id", "tree_size"]

_ID = re.compile(r"^sn-[a-z0-9]{1,60}$")
_META = "meta.json"
_UPPER = "upper"
_MEMORY = "memory"
_TOKEN = "token"
_STAGING = ".new-"
_TRASH = ".old-"
_STRAY_GRACE = 60.0


def new_snapshot_id() -> str:
    """A fresh snapshot id."""
    return f"sn-{secrets.token_hex(6)}"


def check_id(snapshot_id: str) -> str:
    """``snapshot_id`` if it is of a snapshot's form; else SnapshotNotFound (never a path)."""
    if not _ID.match(snapshot_id):
        raise errors.SnapshotNotFound(f"no snapshot {snapshot_id!r}: not a snapshot id")
    return snapshot_id


class SnapshotStore:
    """The snapshots of one state directory. Methods block: call them in a thread."""

    def __init__(self, state_dir: Path, disk: DiskPool, provider: str = "local") -> None:
        self.root = state_dir / "snapshots"
        self.disk = disk
        self._provider = provider

    def _dir(self, snapshot_id: str) -> Path:
        return self.root / check_id(snapshot_id)

    # -- making ---------------------------------------------------------------------

    def record(self, snapshot_id: str, meta: dict[str, Any]) -> None:
        """The snapshot's record, whole or not at all (before any file is kept)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = self._dir(snapshot_id)
        staging = self.root / f"{_STAGING}{snapshot_id}.{secrets.token_hex(4)}"
        staging.mkdir(mode=0o700)
        try:
            (staging / _META).write_text(json.dumps(meta))
            staging.rename(directory)
        except BaseException:
            remove_tree(staging)
            raise

    def keep(self, snapshot_id: str, sandbox_id: str, layer: Path) -> int:
        """Keep the files of the sandbox whose overlay layer (``upper``/``work``) is
        ``layer``; returns their size in bytes. The sandbox must be paused."""
        if self.disk.has(sandbox_id):
            size = self.disk.snapshot(sandbox_id, snapshot_id)
        else:
            # No btrfs (`LocalConfig.disk=None`): the next best thing is a copy, by
            # reflink where the filesystem has them; its cost grows with the tree.
            target = self._dir(snapshot_id) / _UPPER
            _copy_tree(layer / "upper", target)
            size = _size(target)
        self._update(snapshot_id, {"size": size, "complete": True})
        return size

    def memory(self, snapshot_id: str) -> Path:
        """The directory of the snapshot's memory image (made empty, root's, by `record`'s
        caller through `make_memory`)."""
        return self._dir(snapshot_id) / _MEMORY

    def make_memory(self, snapshot_id: str, token: str) -> Path:
        """An empty directory for the memory image, and the token that image's daemon has."""
        directory = self.memory(snapshot_id)
        directory.mkdir(mode=0o700)
        fd = os.open(self._dir(snapshot_id) / _TOKEN, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as handle:
            handle.write(token)
        return directory

    def token(self, snapshot_id: str) -> str:
        """The daemon's token held in the snapshot's memory image."""
        return (self._dir(snapshot_id) / _TOKEN).read_text()

    def add_size(self, snapshot_id: str, extra: int) -> None:
        """Count ``extra`` bytes more in the snapshot's size (its memory image)."""
        info = self._read(self._dir(snapshot_id))
        if info is not None:
            self._update(snapshot_id, {"size": info[0].size + extra})

    def _update(self, snapshot_id: str, changes: Mapping[str, Any]) -> None:
        path = self._dir(snapshot_id) / _META
        meta = json.loads(path.read_text())
        meta.update(changes)
        staged = path.with_name(f".{_META}.{secrets.token_hex(4)}")
        staged.write_text(json.dumps(meta))
        os.replace(staged, path)

    # -- using ----------------------------------------------------------------------

    def get(self, snapshot_id: str) -> SnapshotInfo:
        """The snapshot, complete; SnapshotNotFound otherwise."""
        info = self._read(self._dir(snapshot_id))
        if info is None or not info[1]:
            raise errors.SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}")
        return info[0]

    @contextlib.contextmanager
    def using(self, snapshot_id: str) -> Iterator[SnapshotInfo]:
        """The snapshot, held (a delete waits) while the block makes a sandbox from it."""
        directory = self._dir(snapshot_id)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise errors.SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield self.get(snapshot_id)  # after the lock: not half-deleted
        finally:
            os.close(fd)

    def layer(self, snapshot_id: str, sandbox_id: str, directory: Path, limit: int | None) -> Path:
        """A new overlay layer (``upper``/``work``) for the sandbox, holding the snapshot's
        files; in the disk filesystem if the snapshot is (or ``limit`` asks), else in
        ``directory``. Call it inside `using`."""
        if self.disk.has(f"{SNAPSHOTS}/{snapshot_id}"):
            layer = self.disk.clone(snapshot_id, sandbox_id, limit)
            # The source's overlay work directory may hold what overlayfs left there.
            remove_tree(layer / "work")
            (layer / "work").mkdir()
            return layer
        layer = directory if limit is None else self.disk.create(sandbox_id, limit)
        (layer / "work").mkdir(exist_ok=True)
        upper = layer / "upper"
        if upper.exists():
            remove_tree(upper)
        _copy_tree(self._dir(snapshot_id) / _UPPER, upper)
        return layer

    def upper(self, snapshot_id: str) -> Path:
        """The directory holding the snapshot's files (an overlay upper directory)."""
        if self.disk.has(f"{SNAPSHOTS}/{snapshot_id}"):
            return self.disk.root / SNAPSHOTS / snapshot_id / "upper"
        return self._dir(snapshot_id) / _UPPER

    # -- listing and deleting -------------------------------------------------------

    def list(self, labels: Mapping[str, str] | None = None) -> list[SnapshotInfo]:
        """Every snapshot, half-made ones too (a crash's, to be deleted), and layers
        without a record; those whose labels include ``labels``."""
        found: dict[str, SnapshotInfo] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as entries:
            for entry in entries:
                if _ID.match(entry.name):
                    read = self._read(Path(entry.path))
                    found[entry.name] = read[0] if read else self._orphan(entry.name)
        for name in self.disk.snapshot_names():
            if name not in found:
                found[name] = self._orphan(name)
        wanted = dict(labels or {}).items()
        return sorted(
            (info for info in found.values() if wanted <= info.labels.items()),
            key=lambda info: info.created_at,
        )

    def delete(self, snapshot_id: str) -> None:
        """Its files, then its record; waits for creates from it in flight. Idempotent."""
        directory = self._dir(snapshot_id)
        fd = -1
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            self.disk.remove(f"{SNAPSHOTS}/{snapshot_id}")
            if fd >= 0:
                trash = self.root / f"{_TRASH}{snapshot_id}.{secrets.token_hex(4)}"
                with contextlib.suppress(FileNotFoundError):
                    directory.rename(trash)
                    remove_tree(trash)
        finally:
            if fd >= 0:
                os.close(fd)

    def remove_strays(self) -> builtins.list[str]:
        """What a make or a delete killed half-way left under a staging or trash name."""
        removed = []
        deadline = time.time() - _STRAY_GRACE
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as entries:
            for entry in entries:
                trash = entry.name.startswith(_TRASH)
                if trash or entry.name.startswith(_STAGING):
                    with contextlib.suppress(FileNotFoundError):
                        if trash or entry.stat(follow_symlinks=False).st_mtime < deadline:
                            remove_tree(Path(entry.path))
                            removed.append(entry.name)
        return removed

    def _read(self, directory: Path) -> tuple[SnapshotInfo, bool] | None:
        try:
            meta = json.loads((directory / _META).read_text())
        except (OSError, ValueError):
            return None
        spec = meta.get("spec")
        info = SnapshotInfo(
            id=directory.name,
            provider=self._provider,
            labels=meta.get("labels", {}),
            created_at=meta.get("created_at", 0.0),
            image=meta.get("image", ""),
            image_id=meta.get("image_id", ""),
            size=meta.get("size", 0),
            memory=meta.get("memory", False),
            source=meta.get("source"),
            spec=SandboxSpec.model_validate(spec) if spec else None,
        )
        return info, bool(meta.get("complete"))

    def _orphan(self, snapshot_id: str) -> SnapshotInfo:
        return SnapshotInfo(
            id=snapshot_id, provider=self._provider, labels={}, created_at=0.0,
            image="", image_id="", size=0,
        )  # fmt: skip


def _copy_tree(source: Path, target: Path) -> None:
    """``source`` copied to ``target`` (absent) whole: owners, modes, xattrs (overlayfs
    keeps whiteouts and opaque directories in them), hard links; by reflink where the
    filesystem can."""
    done = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", str(source), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        with contextlib.suppress(OSError):
            remove_tree(target)
        raise errors.ProviderError(f"cannot copy {source}: {done.stderr.strip()}")


def tree_size(root: Path) -> int:
    """What the files under ``root`` take on disk, in bytes."""
    return _size(root)


def _size(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def image_users(state_dir: Path) -> Callable[[Image], bool]:
    """Whether a sandbox or a snapshot of ``state_dir`` is made of an image (the image
    store's ``in_use`` hook: an image in use is not removed, nor are its layers pruned).
    Reads each record's ``image_id``: a few small files per sandbox, on a removal only."""

    def in_use(image: Image) -> bool:
        for records in (state_dir / "sandboxes", state_dir / "snapshots"):
            with contextlib.suppress(FileNotFoundError), os.scandir(records) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError, ValueError):
                        meta = json.loads((Path(entry.path) / _META).read_text())
                        if meta.get("image_id") == image.id:
                            return True
        return False

    return in_use
