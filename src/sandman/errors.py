"""Every error Sandman raises, in one tree.

```
SandboxError
├── ConfigError                 (ValueError)  bad settings or arguments
├── ProviderError                             the backend refused
│   ├── CapacityError           retryable: quota, unschedulable
│   ├── ThrottledError          retryable: rate-limited (429); `retry_after` says when
│   └── ImageError              permanent: pull or import failed
│       └── ImageNotFound       (LookupError)  no such image in the store or registry
├── SandboxNotFound             released, expired, evicted
│   ├── SandboxLost             it died under its holder; `reason` says why (oom, killed...)
│   └── SessionExpired          the client's session is over (the client opens a new one)
├── SnapshotNotFound            (LookupError)  no such snapshot (deleted, expired, another tenant's)
├── SandboxPaused               the sandbox is paused: resume it first
├── DaemonError                 the in-sandbox daemon answered with an error
│   ├── DaemonUnavailable       retryable: cannot connect, connection lost
│   ├── UntrustedDaemon         the peer at the daemon's socket is another process
│   ├── ProtocolVersionError    the daemon speaks another protocol
│   ├── Unauthorized            wrong or missing token
│   ├── InvalidRequest          (ValueError)  the daemon refused the request
│   ├── PathNotFound            (FileNotFoundError)  also a missing process or shell
│   ├── UnknownUser             (LookupError)  no such user or group in the sandbox
│   ├── PathExists              (FileExistsError)
│   ├── IsADirectory            (IsADirectoryError)
│   ├── NotADirectory           (NotADirectoryError)
│   ├── DirectoryNotEmpty       (OSError)
│   ├── PermissionDenied        (PermissionError)
│   ├── NoSpace                 (OSError)  the sandbox's disk is full
│   ├── UnsafeArchive           (ValueError)  tar entry escapes its target
│   ├── FileTooLarge            a read or download went past its size or entry limit
│   ├── NotARegularFile         (OSError)  reading a device, fifo or socket is refused
│   ├── ShellBusy               a run is already in progress in that shell (was SessionBusy)
│   ├── ShellClosed             the shell has exited (was SessionClosed)
│   └── StdinClosed             the process has no open stdin
├── CommandFailed               exec(check=True) and the exit code was not 0
├── SandboxTimeout              (TimeoutError)
│   ├── CreateTimeout
│   └── ExecTimeout
└── PoolClosed
```

`retryable` says whether trying the same call again can help. ``SessionBusy`` and
``SessionClosed`` are deprecated names of `ShellBusy` and `ShellClosed` (the daemon's
shells were called sessions, a word the client's lease session keeps).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "CapacityError",
    "CommandFailed",
    "ConfigError",
    "CreateTimeout",
    "DaemonError",
    "DaemonUnavailable",
    "DirectoryNotEmpty",
    "ExecTimeout",
    "FileTooLarge",
    "ImageError",
    "ImageNotFound",
    "InvalidRequest",
    "IsADirectory",
    "NoSpace",
    "NotADirectory",
    "NotARegularFile",
    "PathExists",
    "PathNotFound",
    "PermissionDenied",
    "PoolClosed",
    "ProtocolVersionError",
    "ProviderError",
    "SandboxError",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxTimeout",
    "SessionBusy",
    "SessionClosed",
    "SessionExpired",
    "ShellBusy",
    "ShellClosed",
    "SnapshotNotFound",
    "StdinClosed",
    "ThrottledError",
    "Unauthorized",
    "UnknownUser",
    "UnsafeArchive",
    "UntrustedDaemon",
]


class SandboxError(Exception):
    """Root of every error Sandman raises."""

    retryable: ClassVar[bool] = False


class ConfigError(SandboxError, ValueError):
    """Invalid settings or arguments, found before anything was started."""


class ProviderError(SandboxError):
    """The backend refused or failed an operation."""


class CapacityError(ProviderError):
    """The backend has no room now (quota, unschedulable); retry later."""

    retryable = True


class ThrottledError(ProviderError):
    """The backend is rate-limiting us (HTTP 429, API priority and fairness); retry later.

    ``retry_after`` is the pause in seconds the backend asked for, or None
    when it did not say.
    """

    retryable = True

    def __init__(self, message: str = "throttled", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ImageError(ProviderError):
    """The image cannot be pulled or imported."""


class ImageNotFound(ImageError, LookupError):
    """No such image: not in the local store, or not in the registry pulled from."""


class SandboxNotFound(SandboxError):
    """The sandbox is gone: released, expired or lost."""


class SandboxLost(SandboxNotFound):
    """The sandbox died under its holder: its daemon (the sandbox's first process) is
    gone, and with it every process and file in it. Acquire a new one.

    ``reason`` says why, one of `REASONS` (a newer backend may add others):

    - ``oom``: out of memory (the kernel's OOM killer, a pod ``OOMKilled``);
    - ``killed``: a signal from outside (the host, an operator);
    - ``evicted``: the node reclaimed it (memory or disk pressure, a drain);
    - ``preempted``: a pod of higher priority took its place;
    - ``node_lost``: its node went away;
    - ``deleted``: removed behind the pool's back;
    - ``daemon_exit``: the daemon ended by itself (a crash);
    - ``unknown``: the backend did not say.
    """

    REASONS: ClassVar[tuple[str, ...]] = (
        "oom", "killed", "evicted", "preempted", "node_lost", "deleted", "daemon_exit", "unknown",
    )  # fmt: skip

    def __init__(self, message: str, *, reason: str = "unknown") -> None:
        super().__init__(message)
        self.reason = reason

    @classmethod
    def of(cls, sandbox_id: str, reason: str, detail: str = "") -> SandboxLost:
        """The error for sandbox ``sandbox_id`` lost for ``reason`` (``detail``: what the
        backend said of it)."""
        said = f": {detail}" if detail else ""
        return cls(f"sandbox {sandbox_id} is gone, lost ({reason}){said}", reason=reason)


class SessionExpired(SandboxNotFound):
    """The client's session with the pool or the service is over (not a daemon's shell):
    its lease passed without a heartbeat, or it was closed, and the sandboxes it held
    went with it. `AsyncClient` opens a new session by itself and says what was lost."""


class SnapshotNotFound(SandboxError, LookupError):
    """No such snapshot: never made, deleted, past its time to live, or another tenant's."""


class SandboxPaused(SandboxError):
    """The sandbox is paused (`AsyncSandbox.pause`): its processes are stopped until
    `AsyncSandbox.resume`."""


class DaemonError(SandboxError):
    """The in-sandbox daemon answered with an error.

    `code` is the daemon's stable error code (see the protocol document),
    `status` the HTTP status (0 when no answer came at all).
    """

    default_code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, code: str | None = None, status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status = status

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


class DaemonUnavailable(DaemonError):
    """The daemon cannot be reached, or the connection broke mid-request."""

    default_code = "unavailable"
    retryable = True


class UntrustedDaemon(DaemonError):
    """The process answering at the sandbox's socket is not the sandbox's daemon.

    Never retried: something took its place, and nothing (the token least of
    all) is sent to it.
    """

    default_code = "untrusted_daemon"


class ProtocolVersionError(DaemonError):
    """The daemon does not speak the protocol version this client needs."""

    default_code = "protocol_version"


class Unauthorized(DaemonError):
    """The daemon refused the token."""

    default_code = "unauthorized"


class InvalidRequest(DaemonError, ValueError):
    """The daemon refused the request as malformed or invalid."""

    default_code = "invalid_request"


class PathNotFound(DaemonError, FileNotFoundError):
    """The path, process or session does not exist."""

    default_code = "not_found"


class UnknownUser(DaemonError, LookupError):
    """The ``user`` asked for is not in the sandbox's ``/etc/passwd`` (or its group
    not in ``/etc/group``); nothing was started.

    The message says it as docker does: ``unable to find user NAME: no
    matching entries in passwd file``.
    """

    default_code = "unknown_user"


class PathExists(DaemonError, FileExistsError):
    """The target exists and overwriting was not asked for."""

    default_code = "already_exists"


class IsADirectory(DaemonError, IsADirectoryError):
    """A file was expected, a directory found."""

    default_code = "is_a_directory"


class NotADirectory(DaemonError, NotADirectoryError):
    """A directory was expected, something else found."""

    default_code = "not_a_directory"


class DirectoryNotEmpty(DaemonError, OSError):
    """Removing a non-empty directory needs ``recursive=True``."""

    default_code = "directory_not_empty"


class PermissionDenied(DaemonError, PermissionError):
    """The operating system inside the sandbox refused the operation."""

    default_code = "permission_denied"


class NoSpace(DaemonError, OSError):
    """The sandbox's disk (or its quota) is full; the write did not happen."""

    default_code = "no_space"


class UnsafeArchive(DaemonError, ValueError):
    """A tar entry would land outside its target directory; nothing was kept."""

    default_code = "unsafe_archive"


class FileTooLarge(DaemonError):
    """A read or download went past its limit (bytes or archive entries).

    Raised before anything is buffered past the limit; a refused download
    leaves nothing of itself behind. Pass a larger ``max_bytes`` (or use the
    streaming form) to read more.
    """

    default_code = "file_too_large"


class NotARegularFile(DaemonError, OSError):
    """The path (after following symlinks) is a device, fifo or socket: never read."""

    default_code = "not_a_regular_file"


class ShellBusy(DaemonError):
    """A command is already running in this shell (`DaemonClient.run_in_shell`)."""

    default_code = "shell_busy"


class ShellClosed(DaemonError):
    """The shell has exited (``exit``, a timeout, or a kill)."""

    default_code = "shell_closed"


# Deprecated names, from when the daemon's shells were called sessions.
SessionBusy = ShellBusy
SessionClosed = ShellClosed


class StdinClosed(DaemonError):
    """The process was started without stdin, or its stdin was closed."""

    default_code = "stdin_closed"


class CommandFailed(SandboxError):
    """``check=True`` was given and the command exited with a non-zero code."""

    def __init__(self, message: str, *, exit_code: int, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr


class SandboxTimeout(SandboxError, TimeoutError):
    """An operation did not finish within its deadline."""


class CreateTimeout(SandboxTimeout):
    """The sandbox was not ready within the deadline."""

    retryable = True


class ExecTimeout(SandboxTimeout):
    """A command ran past its timeout and was killed."""


class PoolClosed(SandboxError):
    """The pool is closed: no more sandboxes are handed out."""
