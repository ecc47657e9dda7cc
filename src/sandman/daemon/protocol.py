"""Protocol v1 of sandmand, the Python side: version, error codes, request building.

The contract is ``daemon/spec/openapi.json`` (prose: ``daemon/PROTOCOL.md``).
Pure functions only, so they are shared by every client and tested without I/O.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict
from urllib.parse import quote, urlencode

from sandman import errors
from sandman.models import Encoding

__all__ = [
    "ERROR_CLASSES",
    "PAUSE",
    "PROTOCOL_VERSION",
    "RESUME",
    "DaemonPaused",
    "ExecOptions",
    "command_fields",
    "error_from_response",
    "exec_fields",
    "output_fields",
    "quote_segment",
    "stdin_fields",
    "target",
    "tty_fields",
    "user_fields",
]

PROTOCOL_VERSION = "v1"

PAUSE = "/v1/pause"
RESUME = "/v1/resume"
"""The host's pause where no freezer cgroup is writable (Kubernetes): the daemon stops
every other process of its sandbox, and continues them (`sandman.daemon.pausing`)."""


class DaemonPaused(errors.DaemonError, errors.SandboxPaused):
    """``sandbox_paused``: the daemon of a paused sandbox refuses what would start, signal
    or feed a process until it is resumed. Caught as `SandboxPaused` too."""


# Stable wire codes to classes; a code this client does not know is a plain DaemonError.
ERROR_CLASSES: dict[str, type[errors.DaemonError]] = {
    "invalid_json": errors.InvalidRequest,
    "invalid_request": errors.InvalidRequest,
    "invalid_path": errors.InvalidRequest,
    "payload_too_large": errors.InvalidRequest,
    "invalid_archive": errors.InvalidRequest,
    "unknown_route": errors.ProtocolVersionError,
    "method_not_allowed": errors.ProtocolVersionError,
    "unauthorized": errors.Unauthorized,
    "permission_denied": errors.PermissionDenied,
    "no_space": errors.NoSpace,
    "not_found": errors.PathNotFound,
    "unknown_user": errors.UnknownUser,
    "already_exists": errors.PathExists,
    "directory_not_empty": errors.DirectoryNotEmpty,
    "is_a_directory": errors.IsADirectory,
    "not_a_directory": errors.NotADirectory,
    "unsafe_archive": errors.UnsafeArchive,
    "file_too_large": errors.FileTooLarge,
    "not_a_regular_file": errors.NotARegularFile,
    "shell_busy": errors.ShellBusy,
    "shell_closed": errors.ShellClosed,
    "stdin_closed": errors.StdinClosed,
    # Resizing a process without a terminal is the caller's mistake.
    "not_a_tty": errors.InvalidRequest,
    "pty_unavailable": errors.DaemonError,
    # A port nothing listens on (or that accepts nothing): never raised by `expose`,
    # whose connection to it is closed instead, the reason in `ExposedPort.last_failure`.
    "connection_refused": errors.DaemonError,
    "connect_timeout": errors.DaemonError,
    # A memory checkpoint refused: the sandbox's processes hold TCP sockets, or requests
    # are in flight (`sandman.daemon.checkpoint.prepare_checkpoint`); the message names them.
    "not_checkpointable": errors.DaemonError,
    # A paused sandbox's daemon refuses to start, signal or feed a process (`PAUSE`).
    "sandbox_paused": DaemonPaused,
    # A pause that could not stop every process in time (a fork bomb); nothing stays
    # stopped, and the message names the pids.
    "not_pausable": errors.DaemonError,
    # From the service's proxy route: what answers at the sandbox's socket is not its daemon.
    "untrusted_daemon": errors.UntrustedDaemon,
}


def error_from_response(status: int, body: bytes) -> errors.DaemonError:
    """Turn an error answer into the matching exception (never raises itself)."""
    try:
        payload = json.loads(body)
        code = str(payload["error"]["code"])
        message = str(payload["error"]["message"])
    except (ValueError, TypeError, KeyError):
        text = body[:200].decode("utf-8", "replace")
        return errors.DaemonError(f"HTTP {status}: {text}", code="internal", status=status)
    cls = ERROR_CLASSES.get(code, errors.DaemonError)
    return cls(message, code=code, status=status)


def target(endpoint: str, /, **params: object) -> str:
    """A request target: ``endpoint`` plus the query of the given non-None params."""
    query = {
        key: ("true" if value else "false") if isinstance(value, bool) else str(value)
        for key, value in params.items()
        if value is not None
    }
    return f"{endpoint}?{urlencode(query, quote_via=quote)}" if query else endpoint


def quote_segment(value: str) -> str:
    """Quote one path segment (a process or shell id) for a request target."""
    return quote(value, safe="")


class ExecOptions(TypedDict, total=False):
    """Exec's options, written once; `DaemonClient.exec`'s docstring says what each does.

    `DaemonClient.exec` and ``exec_stream`` take them as keywords
    (``**options: Unpack[ExecOptions]``), and so do `AsyncSandbox`'s and `Sandbox`'s,
    derived from those; `exec_fields` puts them on the wire. A new option is a field
    here, its line in `exec_fields` and in ``exec``'s docstring, and the daemon's side:
    the list is in ``docs/architecture.md`` ("A new exec option").
    """

    cwd: str | None
    env: Mapping[str, str] | None
    stdin: str | bytes | None
    timeout: float | None
    kill_grace: float | None
    max_output: int | None
    shell: str | None
    encoding: Encoding
    user: str | int | None
    merge_stderr: bool


def exec_fields(command: str | Sequence[str], options: ExecOptions) -> dict[str, Any]:
    """The body of ``POST /v1/exec`` (and ``/v1/exec/stream``) for ``command`` and ``options``.

    A key that is not an `ExecOptions` field is a TypeError, as an unknown keyword is.
    """
    unknown = options.keys() - ExecOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unexpected keyword argument {min(unknown)!r}: not an exec option")
    fields = command_fields(
        command,
        shell=options.get("shell"),
        cwd=options.get("cwd"),
        env=options.get("env"),
        user=options.get("user"),
        merge_stderr=options.get("merge_stderr", False),
    )
    fields.update(
        output_fields(
            max_output=options.get("max_output"),
            encoding=options.get("encoding", "utf-8"),
            timeout=options.get("timeout"),
        )
    )
    fields.update(stdin_fields(options.get("stdin")))
    kill_grace = options.get("kill_grace")
    if kill_grace is not None:
        fields["kill_grace"] = kill_grace
    return fields


def command_fields(
    command: str | Sequence[str],
    *,
    shell: str | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    user: str | int | None = None,
    merge_stderr: bool = False,
) -> dict[str, Any]:
    """The fields that say what to run (a string runs in a shell, a sequence as
    argv), as whom, and where its output goes."""
    fields: dict[str, Any]
    if isinstance(command, str):
        fields = {"cmd": command}
        if shell is not None:
            fields["shell"] = shell
    else:
        argv = list(command)
        if not argv:
            raise errors.ConfigError("argv must not be empty")
        if shell is not None:
            raise errors.ConfigError("shell applies only to a command string")
        fields = {"argv": argv}
    if cwd is not None:
        fields["cwd"] = cwd
    if env:
        fields["env"] = dict(env)
    fields.update(user_fields(user))
    if merge_stderr:
        fields["merge_stderr"] = True
    return fields


def user_fields(user: str | int | None) -> dict[str, Any]:
    """The ``user`` field: a name or uid, optionally ``:group`` (name or gid)."""
    if user is None:
        return {}
    if isinstance(user, bool) or (isinstance(user, int) and user < 0):
        raise errors.ConfigError(f"user must be a name or a uid, got {user!r}")
    return {"user": str(user)}


def stdin_fields(stdin: str | bytes | None) -> dict[str, Any]:
    """The stdin of a one-shot command: text as it is, bytes as base64."""
    if stdin is None:
        return {}
    if isinstance(stdin, str):
        return {"stdin": stdin}
    return {"stdin": base64.b64encode(stdin).decode("ascii"), "stdin_encoding": "base64"}


def tty_fields(*, tty: bool, rows: int | None, cols: int | None) -> dict[str, Any]:
    """The fields of a process on a pseudo-terminal; a size without ``tty`` is a mistake."""
    if not tty:
        if rows is not None or cols is not None:
            raise errors.ConfigError("rows and cols need tty=True")
        return {}
    fields: dict[str, Any] = {"tty": True}
    if rows is not None:
        fields["rows"] = rows
    if cols is not None:
        fields["cols"] = cols
    return fields


def output_fields(
    *, max_output: int | None, encoding: Encoding, timeout: float | None
) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if max_output is not None:
        fields["max_output"] = max_output
    if encoding != "utf-8":
        fields["encoding"] = encoding
    if timeout is not None:
        fields["timeout"] = timeout
    return fields
