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

import contextlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from sandman import errors
from sandman.images import Image
from sandman.providers.base import SnapshotInfo
from sandman.providers.local.disk import SNAPSHOTS, DiskPool
from sandman.providers.local.trees import remove_tree
from sandman.providers.snapshot_records import META, SnapshotRecords, check_id, new_snapshot_id

__all__ = ["SnapshotStore", "check_id", "image_users", "new_snapshot_id", "tree_size"]

_UPPER = "upper"
_MEMORY = "memory"
_TOKEN = "token"


class SnapshotStore(SnapshotRecords):
    """The snapshots of one state directory. Methods block: call them in a thread."""

    def __init__(self, state_dir: Path, disk: DiskPool, provider: str = "local") -> None:
        super().__init__(state_dir / "snapshots", provider, "the state directory")
        self.disk = disk

    def _remove_tree(self, path: Path) -> None:
        remove_tree(path)  # follows no link and crosses no mount

    # -- making ---------------------------------------------------------------------

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

    # -- using ----------------------------------------------------------------------

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

    # -- listing and deleting: the disk's snapshots beside the records ----------------

    def _found(self) -> dict[str, SnapshotInfo]:
        # Layers without a record too (a crash's between the two), to be deleted.
        found = super()._found()
        for name in self.disk.snapshot_names():
            if name not in found:
                found[name] = self._orphan(name)
        return found

    def _delete_files(self, snapshot_id: str) -> None:
        self.disk.remove(f"{SNAPSHOTS}/{snapshot_id}")


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
                        meta = json.loads((Path(entry.path) / META).read_text())
                        if meta.get("image_id") == image.id:
                            return True
        return False

    return in_use
