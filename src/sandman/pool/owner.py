"""Who owns a sandbox: the process of the pool that made it, named so that anyone on
the same host can tell whether that process still lives.

Every sandbox a pool creates carries ``sandman.io/owner=<owner>``. The owner is
the pool's process, by its pid and its start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot), so that a pid the kernel has
since given to another process is not mistaken for it; and by the boot and the
pid namespace it was read in, so that the check is made only where that pid
means the same process. The value is a valid Kubernetes label value (at most 63
of ``[A-Za-z0-9-_.]``, alphanumeric at both ends)::

    p.<boot id, 12 hex>.<pid namespace inode>.<pid>.<start time>

`status` says ``alive``, ``dead`` or ``unknown``: another boot (or host), another
pid namespace, or a value this version does not read. Only ``dead`` is a
reason to reap a sandbox; ``unknown`` leaves it to the other rules (expiry, a
sandbox that does not run).

A provider that keeps owner records on its backend (`KeepsOwners`: Kubernetes, one
Lease per pool process) names owners its own way (``k.<lease name>``), and only it can
judge them: `Liveness` asks it (`BackendOwners`) for those values.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from sandman.providers.base import BackendOwners, OwnerStatus

__all__ = ["LABEL_OWNER", "Liveness", "OwnerStatus", "current", "describe", "of_process", "status"]

LABEL_OWNER = "sandman.io/owner"

_PROC = Path("/proc")
# pid namespace inodes are 32-bit, pids at most 2**22, start times (ticks) 64-bit: <= 54 chars.
_VALUE = re.compile(r"^p\.([0-9a-f]{12})\.(\d{1,10})\.(\d{1,7})\.(\d{1,20})$")


def _boot() -> str:
    return (_PROC / "sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]


def _pid_namespace() -> int:
    return os.stat(_PROC / "self/ns/pid").st_ino


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and start time; None when there is no such process."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold anything, ")" too.
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[19])


def of_process(pid: int) -> str:
    """The owner value of a process of this host (ProcessLookupError if there is none)."""
    found = _stat(pid)
    if found is None:
        raise ProcessLookupError(pid)
    return f"p.{_boot()}.{_pid_namespace()}.{pid}.{found[1]}"


_current: tuple[int, str] | None = None


def current() -> str:
    """This process as an owner (a forked child is an owner of its own)."""
    global _current
    pid = os.getpid()
    if _current is None or _current[0] != pid:
        _current = (pid, of_process(pid))
    return _current[1]


def status(owner: str) -> OwnerStatus:
    """Whether ``owner``'s process still runs; ``unknown`` when that cannot be told here."""
    match = _VALUE.match(owner)
    if match is None:
        return "unknown"
    boot, namespace, pid, started = match.groups()
    try:
        if boot != _boot() or int(namespace) != _pid_namespace():
            return "unknown"
        found = _stat(int(pid))
    except OSError:
        return "unknown"
    if found is None:
        return "dead"
    state, start = found
    # Another process with the pid since (the kernel reuses them), or a zombie.
    return "alive" if start == int(started) and state not in ("Z", "X") else "dead"


def describe(owner: str) -> str:
    """A few words for logs: ``process 1234``, ``lease sandman-owner-...`` or the raw value."""
    match = _VALUE.match(owner)
    if match:
        return f"process {match.group(3)}"
    if owner.startswith("k.") and len(owner) > 2:
        return f"lease {owner[2:]}"
    return repr(owner)


class Liveness:
    """`status` with each owner asked once: a pass over many sandboxes of few pools.
    Owners of ``backend`` 's form are judged by it (one moment's judgement)."""

    def __init__(self, backend: BackendOwners | None = None) -> None:
        self._known: dict[str, OwnerStatus] = {}
        self._backend = backend

    def __call__(self, owner: str) -> OwnerStatus:
        if self._backend is not None and self._backend.knows(owner):
            return self._backend(owner)
        if owner not in self._known:
            self._known[owner] = status(owner)
        return self._known[owner]
