"""Values Sandman hands back: results of commands, file stats, process and session state.

All are frozen; unknown fields from a newer daemon are ignored.
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "ArchiveResult",
    "Encoding",
    "ExecEvent",
    "ExecResult",
    "FileStat",
    "FileType",
    "Health",
    "ProcessInfo",
    "ProcessOutput",
    "SessionInfo",
    "SessionRunResult",
]

Encoding = Literal["utf-8", "base64"]
"""How command output travels: text (invalid bytes become U+FFFD) or base64 of the raw bytes."""

FileType = Literal["file", "directory", "symlink", "other"]


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


def _raw(text: str, encoding: Encoding) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode()


class Health(_Value):
    """What ``GET /v1/health`` says: the daemon is up and which version it is."""

    status: str
    version: str
    protocol: str
    pid: int
    uptime_seconds: float


class ExecResult(_Value):
    """The outcome of a command. A non-zero ``exit_code`` is data, not an error.

    ``exit_code`` is 128 + the signal number when a signal killed the command
    (``signal`` then names it), 127 when the command was not found.
    ``truncated`` says output past ``max_output`` was dropped.
    """

    exit_code: int
    signal: str | None = None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_seconds: float
    encoding: Encoding = "utf-8"

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def stdout_bytes(self) -> bytes:
        return _raw(self.stdout, self.encoding)

    @property
    def stderr_bytes(self) -> bytes:
        return _raw(self.stderr, self.encoding)


class ExecEvent(_Value):
    """One event of a streamed command: a piece of output, or the exit (the last event)."""

    event: Literal["stdout", "stderr", "exit"]
    data: str = ""
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool = False
    truncated: bool = False
    duration_seconds: float | None = None


class ProcessInfo(_Value):
    """A background process started in the sandbox; it outlives the call that started it."""

    id: str
    pid: int
    argv: list[str] | None = None
    cmd: str | None = None
    running: bool
    exit_code: int | None = None
    signal: str | None = None
    started_at: float
    ended_at: float | None = None
    stdin_open: bool = False


class ProcessOutput(_Value):
    """A slice of a background process's output.

    Offsets are absolute byte counts since the process started. Pass
    ``*_next_offset`` back to read on; ``*_offset`` is larger than asked
    when older output had already been dropped.
    """

    stdout: str
    stderr: str
    stdout_offset: int
    stderr_offset: int
    stdout_next_offset: int
    stderr_next_offset: int
    running: bool
    exit_code: int | None = None
    signal: str | None = None
    encoding: Encoding = "utf-8"


class SessionInfo(_Value):
    """A persistent shell: ``cd``, variables and functions persist between runs."""

    id: str
    pid: int
    shell: str
    alive: bool


class SessionRunResult(_Value):
    """The outcome of one command run in a shell session."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_seconds: float
    alive: bool
    encoding: Encoding = "utf-8"


class FileStat(_Value):
    """What the daemon knows of a path. ``mode`` is the permission bits in octal, e.g. ``"644"``."""

    path: str
    name: str
    type: FileType
    size: int
    mode: str
    mtime: float
    link_target: str | None = None


class ArchiveResult(_Value):
    """What an archive upload unpacked."""

    path: str
    files: int
    bytes: int
