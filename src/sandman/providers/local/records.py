"""Each local sandbox's directory and the record in it, made whole and removed last.

Under ``<state_dir>/sandboxes/<id>/``: ``meta.json`` (written first: the record that
makes even a half-created sandbox findable; the directory is made under a staging
name, ``.new-<id>.<random>``, and renamed into place once the record is in it; a
delete removes the record last), ``config.json`` (the OCI bundle), ``upper/`` and
``work/`` (the sandbox's overlay layer over the shared, read-only image; with a disk
limit they are in ``<state_dir>/disk/<id>/`` instead, see `disk`), ``rootfs/`` (the
mount point, mounted only inside the container's mount namespace),
``sandmand.sock`` (the daemon's socket: bound here by the host, handed to the daemon
as a descriptor; the sandbox sees no path to it), ``token``, ``pid``, ``log``, and
``endpoint.json`` (gVisor: the daemon's TCP address) or ``paused-memory/`` (a pause
with memory, `checkpoints`) when there is one. The directory is root's alone (0700).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from sandman import errors
from sandman.images import Image
from sandman.providers.base import DaemonEndpoint
from sandman.providers.local.runtime import read_pid
from sandman.providers.local.trees import remove_tree

__all__ = [
    "ID",
    "META",
    "PAUSED",
    "SOCKET",
    "TCP_ENDPOINT",
    "directory",
    "endpoint",
    "lowerdir",
    "make",
    "read",
    "relabel",
    "remove",
    "remove_strays",
    "state_error",
    "write",
]

ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
"""A sandbox id, and so the name of its directory."""
META = "meta.json"
SOCKET = "sandmand.sock"
TCP_ENDPOINT = "endpoint.json"
PAUSED = "paused-memory"
"""A sandbox paused with its memory: the checkpoint, until resumed."""
_STAGING = ".new-"  # a sandbox's directory before its record is whole: never a valid id
_TRASH = ".old-"  # a sandbox's directory on its way out, record and all: never a valid id


def directory(root: Path, sandbox_id: str) -> Path:
    """The directory of ``sandbox_id`` under ``root``; ConfigError for an id that is not
    one (never a path)."""
    if not ID.match(sandbox_id):
        raise errors.ConfigError(
            f"invalid sandbox id {sandbox_id!r}: lowercase letters, digits and '-', at most 63"
        )
    return root / sandbox_id


def read(directory: Path) -> dict[str, Any]:
    """The sandbox's record; SandboxNotFound when it has none."""
    try:
        meta: dict[str, Any] = json.loads((directory / META).read_text())
    except FileNotFoundError:
        raise errors.SandboxNotFound(f"no sandbox {directory.name} in {directory.parent}") from None
    except (OSError, ValueError) as exc:
        raise errors.ProviderError(f"cannot read sandbox {directory.name}'s record: {exc}") from exc
    return meta


def endpoint(directory: Path, token: str) -> DaemonEndpoint:
    """Where a running sandbox's daemon listens, from what its directory records."""
    with contextlib.suppress(OSError, ValueError):
        where = json.loads((directory / TCP_ENDPOINT).read_text())
        return DaemonEndpoint(host=str(where["host"]), port=int(where["port"]), token=token)
    return DaemonEndpoint(uds=str(directory / SOCKET), token=token, pid=read_pid(directory / "pid"))


def lowerdir(image: Image) -> Path:
    """The image's layers as the lowerdir of the sandbox's overlay (``upper``, ``work``
    over them at ``rootfs``), topmost first (``a:b:c``): stacked as the layer store keeps
    them (`Image.lowers`), not copied."""
    return Path(":".join(str(p) for p in image.lowers))


def write(path: Path, text: str, mode: int = 0o600) -> None:
    """A new file (never one already there, nor through a symlink's name)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def state_error(sid: str, directory: Path, exc: OSError) -> errors.ProviderError:
    """A failure of this host's state directory (read-only, full...), named as such."""
    where = exc.filename or directory
    return errors.ProviderError(
        f"cannot create sandbox {sid}: the state directory failed at {where}: {exc.strerror or exc}"
    )


def make(directory: Path, meta: str) -> None:
    """The sandbox's directory with its ``meta.json``, whole or not at all: made under a
    staging name `list` does not see (`remove_strays` finds it if we die first), then renamed.

    The staging directory is flocked while it is made: one with its record written
    and no lock held is a create that died, which `remove_strays` takes at once,
    not after its grace (a dead pool's watchdog sweeps right after the death)."""
    staging = directory.with_name(f"{_STAGING}{directory.name}.{secrets.token_hex(4)}")
    try:
        staging.mkdir(mode=0o700)
        try:
            fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # at once: only a sweeper's look may hold it
                write(staging / META, meta)
                # Onto nothing, or onto an empty directory a crashed delete left.
                staging.rename(directory)
            finally:
                os.close(fd)
        except BaseException:
            remove_tree(staging)
            raise
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise errors.ConfigError(f"sandbox {directory.name} already exists") from None
        raise state_error(directory.name, directory, exc) from exc


def relabel(directory: Path, labels: dict[str, str | None]) -> None:
    """Merge ``labels`` into the record (None removes one), replacing it whole: a reader
    sees the old record or the new."""
    meta_path = directory / META
    meta = json.loads(meta_path.read_text())
    merged = {**meta.get("labels", {}), **labels}
    meta["labels"] = {k: v for k, v in merged.items() if v is not None}
    staged = meta_path.with_name(f".{meta_path.name}.{secrets.token_hex(4)}")
    write(staged, json.dumps(meta))
    os.replace(staged, meta_path)


def remove(directory: Path) -> None:
    """The sandbox's files, then its record (``meta.json``) and directory at once.

    Killed half-way, this leaves a sandbox `list` still finds by its labels (and
    the next delete finishes), or a directory under a trash name that it never
    lists and the next delete of it, or `remove_strays`, removes at once. It never leaves a directory under
    the sandbox's name without its record: `list` would show it unlabelled, so no
    sweep by label would remove it (a client SIGKILLed mid-delete did). Another
    delete of the same sandbox at the same time is no error: what it removed
    first is skipped, never a reason to stop and leave the rest.
    """
    try:
        names = [entry.name for entry in os.scandir(directory)]
    except FileNotFoundError:
        # Gone already, or a delete before this one failed once it had the trash
        # name (the state directory read-only for a moment): this retry removes
        # that, or nothing would (only a dead pool's sweep and gc look for trash).
        _remove_trash_of(directory)
        return
    for name in names:
        if name != META:
            _remove_entry(directory / name)
    trash = directory.with_name(f"{_TRASH}{directory.name}.{secrets.token_hex(4)}")
    try:
        directory.rename(trash)
    except FileNotFoundError:
        return  # another delete got there first
    remove_tree(trash)


def remove_strays(root: Path, older_than: float) -> list[str]:
    """Remove the directories under ``root`` that are no sandbox's: a create's that died
    before its record was whole (at once if its record was written, else once older
    than ``older_than`` seconds), a delete's that died after its record had gone (at
    once). Returns their names."""
    removed = []
    deadline = time.time() - older_than
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if not entry.name.startswith((_STAGING, _TRASH)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if (
                    entry.name.startswith(_TRASH)
                    or entry.stat(follow_symlinks=False).st_mtime < deadline
                    or _abandoned(Path(entry.path))
                ):
                    remove_tree(Path(entry.path))
                    removed.append(entry.name)
    return removed


def _abandoned(staging: Path) -> bool:
    """Whether a staging directory's create died: its record written, its lock free
    (`make` holds it until the rename; a dead process holds nothing)."""
    try:
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a create in flight
        # Gone (renamed into place) since we opened it: no record under this name.
        return (staging / META).exists()
    finally:
        os.close(fd)


def _remove_trash_of(directory: Path) -> None:
    """What earlier deletes of this sandbox left under a trash name."""
    prefix = f"{_TRASH}{directory.name}."
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory.parent):
            if entry.name.startswith(prefix):
                remove_tree(Path(entry.path))


def _remove_entry(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        remove_tree(path)
