"""Each sandbox's own host uid range: root inside its user namespace is nobody on the host.

Under crun every sandbox runs in a user namespace of its own (`LocalConfig.userns`):
container ids 0..65535 are host ids ``base..base+65535``, a range no other sandbox of
this host has, and the namespace is owned by ``base`` (made by ``sandmand overlay-exec
--userns``). The kernel charges per-user limits (inotify instances and watches, user
namespaces, RLIMIT_NPROC, mqueue bytes) up the chain of user namespaces to each one's
owner: owned by the sandbox's own uid, each sandbox has the host's per-user limits
to itself, and none can exhaust root's or another sandbox's. The image's layers are
bound idmapped into that namespace, so they stay shared and unchanged; the sandbox's
own layer is too, so on disk it holds the ids the sandbox sees (0 for its root):
snapshots, forks into a sandbox with another range, and images made of a sandbox
read right, with or without user namespaces.

The ranges belong to the host, not to one state directory (two providers must never
hand out the same one): a slot is a file ``/run/sandman/userns/<n>`` naming the
sandbox directory that holds it (boot-scoped, as the processes using the range are),
made under a lock together with the sandbox's own record of it (``<dir>/ids``). A
slot whose sandbox directory is gone, or no longer records that slot, is free again
(what a crash between the two writes, or a removed state directory, leaves) once no
process runs with an id of its range: a sandbox whose directory was removed out of
band may still run, until the reconcile deletes it (`held`). A delete releases the
slot after the sandbox's processes are gone.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sandman import _flock, errors

__all__ = [
    "FIRST_ID",
    "IDS",
    "MOUNT_POINT",
    "RANGE",
    "REGISTRY",
    "ROOTFS",
    "SLOTS",
    "allocate",
    "allocated",
    "held",
    "holder",
    "prepare",
    "probe",
    "release",
]

REGISTRY = Path("/run/sandman/userns")
FIRST_ID = 2**30
"""The first host id handed out; far above the ids of users, and of /etc/subuid ranges
(from 100000), and below 2**31 (some tools read uids as signed)."""
RANGE = 65536
"""Ids per sandbox: 0..65535 inside, as in /etc/subuid (65534 is nobody)."""
SLOTS = 16384
"""Sandboxes with a range at once on one host: FIRST_ID + SLOTS * RANGE = 2**31."""
IDS = "ids"
"""A sandbox directory's record of its range: the first host id."""
MOUNT_POINT = "userns"
"""A sandbox directory's empty file where overlay-exec binds the user namespace, in its
private mount namespace only, for the runtime to join (``namespaces[].path``)."""
ROOTFS = Path("/run/sandman-rootfs")
"""Where overlay-exec mounts a sandbox's root, in its private mount namespace (on the
host, an empty directory): the runtime's container process, root of the sandbox's
namespace and so nobody to the host's root-only (0700) state directory, reaches it
only on a path whose every directory it may search."""
_TRIES = 64
_PROC = Path("/proc")


def allocate(directory: Path) -> int:
    """The first host id of the sandbox at ``directory``: the range it holds already,
    else a free one now taken for it. Also makes its `MOUNT_POINT`.
    CapacityError when every slot is taken."""
    mount_point = directory / MOUNT_POINT
    if not mount_point.exists():
        os.close(os.open(mount_point, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    recorded = allocated(directory)
    if recorded is not None and holder(_slot(recorded)) == str(directory):
        return recorded
    fd = _flock.lock_file(REGISTRY / ".lock", mode=0o600, parent_mode=0o700)
    try:
        for slot in _candidates():
            entry = REGISTRY / str(slot)
            try:
                _write(entry, str(directory), exclusive=True)
            except FileExistsError:
                if held(slot):
                    continue
                _write(entry, str(directory), exclusive=False)
            base = FIRST_ID + slot * RANGE
            _write(directory / IDS, str(base), exclusive=False)
            return base
    finally:
        os.close(fd)
    raise errors.CapacityError(
        f"every one of the {SLOTS} user-namespace id ranges of this host is taken "
        f"({REGISTRY}): delete sandboxes, or set LocalConfig(userns=False)"
    )


def allocated(directory: Path) -> int | None:
    """The first host id the sandbox at ``directory`` records, or None."""
    try:
        text = (directory / IDS).read_text()
    except OSError:
        return None
    if not text.isdigit():
        return None
    base = int(text)
    slot = _slot(base)
    return base if 0 <= slot < SLOTS and FIRST_ID + slot * RANGE == base else None


def holder(slot: int) -> str | None:
    """The sandbox directory that holds ``slot``, or None when it is free."""
    try:
        return (REGISTRY / str(slot)).read_text()
    except OSError:
        return None


def release(directory: Path) -> None:
    """Free the range of the sandbox at ``directory`` (its processes gone) and its
    record; its `MOUNT_POINT` goes too. Idempotent; a slot another sandbox holds now
    (after a reboot emptied the registry) is left to it."""
    base = allocated(directory)
    if base is not None:
        entry = REGISTRY / str(_slot(base))
        if holder(_slot(base)) == str(directory):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
    for name in (IDS, MOUNT_POINT):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()


def _slot(base: int) -> int:
    return (base - FIRST_ID) // RANGE


def _candidates() -> Iterator[int]:
    """Slots to try: a few at random (cheap while most are free), then every free one."""
    for _ in range(_TRIES):
        yield random.randrange(SLOTS)  # a spread, not a secret
    taken = {int(name) for name in os.listdir(REGISTRY) if name.isdigit()}
    yield from (slot for slot in range(SLOTS) if slot not in taken)


def held(slot: int) -> bool:
    """Whether ``slot`` is taken: its holder records it, or a process still runs with
    an id of its range (an orphan container of a holder whose directory was removed out
    of band). A slot with no entry in the `REGISTRY` is free. Exact under the registry's
    lock (`allocate`: a holder's two records are written together)."""
    named = holder(slot)
    if named is None:
        return False
    base = FIRST_ID + slot * RANGE
    return allocated(Path(named)) == base or _in_use(base)


def _in_use(base: int) -> bool:
    """Whether a process of this host has a uid of the range from ``base`` (real,
    effective, saved or filesystem; as the host sees it, so a sandbox's root is ``base``)."""
    with os.scandir(_PROC) as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"{entry.path}/status", "rb") as status:
                    for line in status:
                        if line.startswith(b"Uid:"):
                            if any(base <= int(uid) < base + RANGE for uid in line.split()[1:]):
                                return True
                            break
            except OSError:
                continue  # gone meanwhile
    return False


def _write(path: Path, text: str, *, exclusive: bool) -> None:
    if exclusive:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        return
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(staged, path)


def prepare(helper: Path, directory: Path) -> None:
    """ConfigError unless sandboxes can run in user namespaces here (`probe`, in the state
    directory ``directory``: the image layers are idmapped on its filesystem); makes
    `ROOTFS`. ProviderError when ``directory`` fails (read-only, full)."""
    try:
        works, why = probe(helper, directory)
    except OSError as exc:
        raise errors.ProviderError(
            f"the state directory failed at {exc.filename or directory}: {exc.strerror or exc}"
        ) from exc
    if not works:
        raise errors.ConfigError(
            f"sandboxes cannot run in user namespaces here: {why} (`sandman doctor`); "
            "LocalConfig(userns=False) runs them without one (root inside is then "
            "root on the host)"
        )
    try:
        ROOTFS.mkdir(mode=0o755, exist_ok=True)
    except OSError as exc:
        raise errors.ProviderError(f"cannot make {ROOTFS}: {exc.strerror}") from exc


def probe(helper: Path, directory: Path | None = None) -> tuple[bool, str]:
    """Whether sandboxes can run in user namespaces here: ``helper`` (sandmand) makes
    one and mounts an overlay of idmapped layers in ``directory`` (default: a temporary
    one), as a create does. Returns (works, why not); OSError when ``directory`` fails
    (read-only, full)."""
    if os.geteuid() != 0:
        return False, "needs root"
    scratch = Path(tempfile.mkdtemp(prefix=".userns-probe-", dir=directory))
    try:
        for name in ("lower", "upper", "work", "root"):
            (scratch / name).mkdir()
        (scratch / "lower" / "file").touch()
        (scratch / MOUNT_POINT).touch(mode=0o600)
        # The last range: never handed out (FIRST_ID + SLOTS * RANGE is past the slots).
        ids = f"--userns={FIRST_ID + SLOTS * RANGE}:{RANGE}:{scratch / MOUNT_POINT}"
        argv = [
            str(helper), "overlay-exec", ids, str(scratch / "lower"), str(scratch / "upper"),
            str(scratch / "work"), str(scratch / "root"), "--", "stat", "-c", "%u",
            str(scratch / "root" / "file"),
        ]  # fmt: skip
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return False, str(exc)
        if done.returncode != 0:
            return False, (done.stderr or done.stdout).strip().removeprefix("sandmand: ")
        if done.stdout.strip() != str(FIRST_ID + SLOTS * RANGE):
            return False, f"an idmapped file reads as uid {done.stdout.strip()} on the host"
        return True, ""
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
