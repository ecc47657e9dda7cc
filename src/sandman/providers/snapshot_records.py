"""The records of a provider's snapshots on this host, shared by the local and the
Kubernetes snapshot stores (each keeps its own files beside them).

One directory a snapshot, ``<root>/<id>/``, holding ``meta.json``: the record, written
first under a staging name (``.new-``) and renamed into place, so that a half-made
snapshot is found by `SnapshotRecords.list` and deleted; ``complete`` in it marks the
snapshot usable. A delete renames the directory to a trash name (``.old-``) before it
removes it; `SnapshotRecords.remove_strays` removes what a killed make or delete left.

The directory is flocked shared while a sandbox is made from the snapshot (`using`) and
exclusively while it is deleted: a delete waits for the creates in flight.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio

from sandman import errors
from sandman.models import SandboxSpec
from sandman.providers.base import SnapshotInfo

__all__ = ["META", "SnapshotRecords", "check_id", "new_snapshot_id", "snapshot_id_of"]

_ID = re.compile(r"^sn-[a-z0-9]{1,60}$")
META = "meta.json"
"""The record's file in a snapshot's directory."""
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


def snapshot_id_of(given: str | None) -> str:
    """The id a new snapshot takes: ``given`` (checked by `check_id`), or a fresh one."""
    return check_id(given) if given else new_snapshot_id()


class SnapshotRecords:
    """The snapshot records under ``root``, of the provider named ``provider``; ``place``
    names ``root`` in errors. Methods block (call them in a thread), but for the async
    `add`, `find` and `drop`, which do.

    A store keeps its files beside the record by overriding the hooks: `_remove_tree`,
    `_found`, `_delete_files` and `_remove_stray`."""

    def __init__(self, root: Path, provider: str, place: str) -> None:
        self.root = root
        self._provider = provider
        self._place = place

    def _dir(self, snapshot_id: str) -> Path:
        return self.root / check_id(snapshot_id)

    def _remove_tree(self, path: Path) -> None:
        """Remove ``path`` and all under it; OSError if it cannot."""
        shutil.rmtree(path)

    # -- making ---------------------------------------------------------------------

    def record(self, snapshot_id: str, meta: dict[str, Any]) -> None:
        """The snapshot's record, whole or not at all (before any file is kept)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory = self._dir(snapshot_id)
        staging = self.root / f"{_STAGING}{snapshot_id}.{secrets.token_hex(4)}"
        staging.mkdir(mode=0o700)
        try:
            (staging / META).write_text(json.dumps(meta))
            staging.rename(directory)
        except BaseException:
            # What failed is the error to see; a staging left is a stray, removed later.
            with contextlib.suppress(OSError):
                self._remove_tree(staging)
            raise

    async def add(self, snapshot_id: str, meta: dict[str, Any]) -> None:
        """`record`, in a thread; ConfigError if the id is taken, ProviderError if the
        directory fails (read-only, full)."""
        try:
            await anyio.to_thread.run_sync(self.record, snapshot_id, meta)
        except FileExistsError:
            raise errors.ConfigError(f"snapshot {snapshot_id} already exists") from None
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            raise errors.ProviderError(
                f"cannot record snapshot {snapshot_id}: {self._place} failed at "
                f"{exc.filename or self.root}: {exc.strerror or exc}"
            ) from exc

    def _update(self, snapshot_id: str, changes: Mapping[str, Any]) -> None:
        """The record with ``changes``, replaced whole."""
        path = self._dir(snapshot_id) / META
        meta = json.loads(path.read_text())
        meta.update(changes)
        staged = path.with_name(f".{META}.{secrets.token_hex(4)}")
        staged.write_text(json.dumps(meta))
        os.replace(staged, path)

    # -- using ----------------------------------------------------------------------

    def get(self, snapshot_id: str) -> SnapshotInfo:
        """The snapshot, complete; SnapshotNotFound otherwise."""
        read = self._read(self._dir(snapshot_id))
        if read is None or not read[1]:
            raise errors.SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}")
        return read[0]

    @contextlib.contextmanager
    def using(self, snapshot_id: str) -> Iterator[SnapshotInfo]:
        """The snapshot, held (a delete waits) while the block makes a sandbox from it."""
        try:
            fd = os.open(self._dir(snapshot_id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise errors.SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield self.get(snapshot_id)  # after the lock: not half-deleted
        finally:
            os.close(fd)

    # -- listing and deleting -------------------------------------------------------

    def _found(self) -> dict[str, SnapshotInfo]:
        """Every snapshot recorded, half-made ones too, by id."""
        found: dict[str, SnapshotInfo] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as entries:
            for entry in entries:
                if _ID.match(entry.name):
                    read = self._read(Path(entry.path))
                    found[entry.name] = read[0] if read else self._orphan(entry.name)
        return found

    def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[SnapshotInfo]:
        """Every snapshot, half-made ones too (a crash's, to be deleted), whose labels
        include ``labels``; oldest first."""
        wanted = dict(labels or {}).items()
        return sorted(
            (info for info in self._found().values() if wanted <= info.labels.items()),
            key=lambda info: info.created_at,
        )

    async def find(self, labels: Mapping[str, str] | None = None) -> builtins.list[SnapshotInfo]:
        """`list`, in a thread."""
        return await anyio.to_thread.run_sync(self.list, labels)

    def _delete_files(self, snapshot_id: str) -> None:
        """The snapshot's files kept outside its directory, removed (under the lock)."""

    def delete(self, snapshot_id: str) -> None:
        """Its files, then its record; waits for creates from it in flight. Idempotent."""
        directory = self._dir(snapshot_id)
        fd = -1
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            self._delete_files(snapshot_id)
            if fd >= 0:
                trash = self.root / f"{_TRASH}{snapshot_id}.{secrets.token_hex(4)}"
                with contextlib.suppress(FileNotFoundError):
                    directory.rename(trash)
                    self._remove_tree(trash)
        finally:
            if fd >= 0:
                os.close(fd)

    async def drop(self, snapshot_id: str) -> None:
        """`delete`, in a thread; ProviderError if it fails."""
        try:
            await anyio.to_thread.run_sync(self.delete, snapshot_id)
        except OSError as exc:
            if isinstance(exc, errors.SandboxError):
                raise
            raise errors.ProviderError(f"cannot delete snapshot {snapshot_id}: {exc}") from exc

    def _remove_stray(self, entry: os.DirEntry[str], deadline: float) -> bool:
        """Remove ``entry`` if a make (older than ``deadline``) or a delete left it;
        whether it did."""
        trash = entry.name.startswith(_TRASH)
        if trash or entry.name.startswith(_STAGING):
            with contextlib.suppress(FileNotFoundError):
                if trash or entry.stat(follow_symlinks=False).st_mtime < deadline:
                    self._remove_tree(Path(entry.path))
                    return True
        return False

    def remove_strays(self) -> builtins.list[str]:
        """What a make or a delete killed half-way left under a staging or trash name."""
        removed: builtins.list[str] = []
        deadline = time.time() - _STRAY_GRACE
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as entries:
            removed = [entry.name for entry in entries if self._remove_stray(entry, deadline)]
        return removed

    # -- records ------------------------------------------------------------------------

    def _read(self, directory: Path) -> tuple[SnapshotInfo, bool] | None:
        """The snapshot's record and whether it is complete; None if it has none."""
        try:
            meta = json.loads((directory / META).read_text())
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
