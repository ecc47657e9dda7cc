"""Values Sandman hands back: results of commands, file stats, process and shell state.

All are frozen; unknown fields from a newer daemon are ignored.
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from sandman.egress import Egress

__all__ = [
    "ArchiveResult",
    "Encoding",
    "ExecEvent",
    "ExecResult",
    "FileStat",
    "FileType",
    "Health",
    "KubeObjectName",
    "KubernetesOptions",
    "NetworkMode",
    "OnTimeout",
    "ProcessInfo",
    "ProcessOutput",
    "SandboxSpec",
    "SessionInfo",
    "SessionRunResult",
    "ShellInfo",
    "ShellRunResult",
    "Snapshot",
    "Usage",
    "check_object_name",
    "explain",
    "parse_bytes",
]

Encoding = Literal["utf-8", "base64"]
"""How command output travels: text (invalid bytes become U+FFFD) or base64 of the raw bytes."""

FileType = Literal["file", "directory", "symlink", "other"]

OnTimeout = Literal["kill", "interrupt"]
"""What a run in a shell does when it times out: ``kill`` the shell, or
``interrupt`` the command line (SIGINT, as Ctrl-C) and keep the shell."""

NetworkMode = Literal["none", "isolated", "egress"]
"""``none``: loopback only. ``isolated``: reachable from the host only.
``egress``: also NAT to the outside (`Egress` for rules on where to)."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


def _parse_bytes(value: object) -> object:
    """Accept 512 * 2**20, "512Mi", "1G", "1.5Gi" (Kubernetes-style quantities)."""
    if not isinstance(value, str):
        return value
    return parse_bytes(value)


def parse_bytes(value: str) -> int:
    """Bytes of a quantity such as ``"512Mi"``, ``"1G"``, ``"1.5Gi"``; ValueError if it is none."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?)?[bB]?\s*", value)
    if match is None:
        raise ValueError(f"not a byte quantity: {value!r} (try 512Mi or 2Gi)")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


Bytes = Annotated[int, BeforeValidator(_parse_bytes)]


def _quantity(value: object, field: str) -> str:
    """A bound as a person writes it: 16Mi for a byte field's 16777216."""
    if field in _BYTE_FIELDS and isinstance(value, int) and value >= 2**10:
        for unit in ("Ti", "Gi", "Mi", "Ki"):
            if value % _UNITS[unit.lower()] == 0:
                return f"{value // _UNITS[unit.lower()]}{unit}"
    return f"{value:g}" if isinstance(value, float) else str(value)


_BYTE_FIELDS = frozenset({"memory", "disk", "memory_request", "ephemeral_storage"})

# Pydantic's error types, in plain words: the bound (``ctx``) is filled in.
_PLAIN: dict[str, str] = {
    "greater_than": "must be more than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "too_short": "has {actual_length} characters; use at least {min_length}",
    "too_long": "has {actual_length} characters; use at most {max_length}",
    "string_too_short": "must have at least {min_length} character(s)",
    "extra_forbidden": "is not a setting here",
    "missing": "is required",
}


def explain(exc: ValidationError) -> list[tuple[str, str]]:
    """Each problem of ``exc`` as (field, what is wrong in plain words), e.g.
    ``("cpu", "must be more than 0, not 0")``: no validator jargon, and the value
    given only where it helps (never a secret's)."""
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        name = str(error["loc"][-1]) if error["loc"] else ""
        ctx = error.get("ctx") or {}
        template = _PLAIN.get(error["type"])
        if template is not None:
            words = template.format(**{k: _quantity(v, name) for k, v in ctx.items()})
            given = error.get("input")
            if error["type"].startswith(("greater", "less")) and not isinstance(given, str):
                words += f", not {_quantity(given, name)}"
        elif error["type"] == "value_error":
            words = str(ctx.get("error", error["msg"]))
        else:
            words = error["msg"].removeprefix("Input ")
            words = words[:1].lower() + words[1:]
        problems.append((field, words))
    return problems


_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_object_name(value: str) -> str:
    """``value`` if it can name a Kubernetes object (a DNS-1123 subdomain), else ValueError."""
    if len(value) > 253 or not _SUBDOMAIN.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a Kubernetes object name (a DNS-1123 subdomain: at most 253 of "
            "lowercase letters, digits, '-' and '.', starting and ending alphanumeric)"
        )
    return value


KubeObjectName = Annotated[str, AfterValidator(check_object_name)]
"""The name of a Secret, PriorityClass...: checked here, not by a 422 at pod creation."""

RESERVED_LABEL_PREFIX = "sandman.io/"
"""Labels Sandman sets itself (pool, session, tenant, expiry); a spec may not."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


def _raw(text: str, encoding: Encoding) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode()


class KubernetesOptions(BaseModel):
    """Pod settings only the Kubernetes provider uses (other providers ignore them).

    Requests default to the spec's limits (``cpu``, ``memory``); ask for less
    to pack sandboxes tighter. ``tolerations`` and ``affinity`` are the
    Kubernetes objects as dicts, passed on unchanged.

    ``image_pull_secrets`` are added to the pool's (`KubernetesConfig.image_pull_secrets`);
    ``priority_class_name`` replaces the pool's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_request: float | None = Field(default=None, gt=0, le=1024)
    memory_request: Bytes | None = Field(default=None, ge=2**20)
    ephemeral_storage: Bytes | None = Field(default=None, ge=2**20)
    """Limit (and request) of the pod's writable layer, logs and emptyDirs."""
    runtime_class_name: str | None = None
    """E.g. ``gvisor`` or ``kata``: a RuntimeClass of the cluster."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    image_pull_secrets: list[KubeObjectName] = Field(default_factory=list)
    """Names of ``kubernetes.io/dockerconfigjson`` Secrets in the pods' namespace, for a
    private registry (the kubelet reads them; Sandman never does)."""
    priority_class_name: KubeObjectName | None = None
    """A PriorityClass of the cluster: who preempts whom when nodes are full."""


def _network(value: object) -> object:
    """A dict (JSON) is `Egress` rules: one clear error for a bad rule, not one per member
    of the union."""
    if isinstance(value, dict):
        return Egress(**value)
    if isinstance(value, str) and value not in ("none", "isolated", "egress"):
        raise ValueError(f"should be 'none', 'isolated', 'egress' or an Egress, not {value!r}")
    return value


class SandboxSpec(BaseModel):
    """What sandbox to make: the task image and the limits it runs under.

    Resources are hard limits: ``cpu`` in cores (a CFS quota), ``memory`` in
    bytes (``"2Gi"`` works; no swap beyond it), ``pids`` the most tasks.
    ``env``, ``workdir`` and ``user`` override the image's own. ``disk``
    bounds what the sandbox can write (its own layer over the image): past it,
    writes fail with ENOSPC. ``seccomp`` is the system-call filter:
    ``"default"`` (Docker's default profile semantics: no new user
    namespaces, no mount, no kernel keyring, no io_uring, ...),
    ``"unconfined"``, or the absolute path of an OCI ``linux.seccomp`` JSON
    profile. Labels under ``sandman.io/`` are Sandman's own and refused here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(min_length=1)
    cpu: float = Field(default=1.0, gt=0, le=1024)
    memory: Bytes = Field(default=2**30, ge=16 * 2**20)
    pids: int = Field(default=1024, ge=16, le=2**22)
    network: Annotated[NetworkMode | Egress, BeforeValidator(_network)] = "none"
    """``none``, ``isolated``, ``egress`` (anywhere but the walls), or `Egress` with
    allow and deny rules (which is ``egress`` too)."""
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    disk: Bytes | None = Field(default=None, ge=16 * 2**20)
    """Bytes the sandbox may write; None: the provider's default."""
    seccomp: str = "default"
    kubernetes: KubernetesOptions = Field(default_factory=KubernetesOptions)
    snapshot: str | None = Field(default=None, pattern=r"^sn-[a-z0-9]{1,60}$")
    """Start from this snapshot's files (`Snapshot.id`) instead of the bare image; the
    image must be the snapshot's. None: from the image."""

    @property
    def network_mode(self) -> NetworkMode:
        """The network mode: ``egress`` for an `Egress` value."""
        return "egress" if isinstance(self.network, Egress) else self.network

    @property
    def egress(self) -> Egress | None:
        """The egress rules: ``Egress()`` (anywhere) for ``network="egress"``; None without
        egress."""
        if isinstance(self.network, Egress):
            return self.network
        return Egress() if self.network == "egress" else None

    @field_validator("labels")
    @classmethod
    def _no_reserved_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        reserved = sorted(key for key in labels if key.startswith(RESERVED_LABEL_PREFIX))
        if reserved:
            raise ValueError(
                f"labels under {RESERVED_LABEL_PREFIX} are reserved for Sandman: {reserved}"
            )
        return labels

    @field_validator("seccomp")
    @classmethod
    def _seccomp_kind(cls, value: str) -> str:
        if value not in ("default", "unconfined") and not value.startswith("/"):
            raise ValueError(
                f"seccomp must be 'default', 'unconfined' or an absolute path to a profile, got {value!r}"
            )
        return value


class Snapshot(_Value):
    """A sandbox's state, kept to make new sandboxes from (``client.sandbox(snapshot=...)``,
    `AsyncSandbox.fork`) or to reset one to (`AsyncSandbox.restore`).

    Files are always in it; with ``memory`` its processes are too. It belongs to the
    tenant whose sandbox it was made of, and is deleted at ``expires_at`` at the latest.
    """

    id: str
    image: str
    """The image the sandbox was made from: a sandbox made from the snapshot is too."""
    created_at: float
    expires_at: float
    size: int
    """Bytes it holds beyond the image (what the sandbox had written)."""
    memory: bool = False
    source: str | None = None
    """The id of the sandbox it was made of."""
    spec: SandboxSpec | None = None
    """The spec of that sandbox: a fork's, unless told otherwise."""

    def fork_spec(self, **changes: Any) -> SandboxSpec:
        """The spec of a sandbox made from this snapshot (``changes``: other limits...)."""
        base = self.spec.model_dump() if self.spec is not None else {"image": self.image}
        base.update(changes)
        base["image"], base["snapshot"] = self.image, self.id
        return SandboxSpec(**base)


class Usage(_Value):
    """What a sandbox has used so far (or in all, once released): the cost of a rollout.

    Read from the kernel's own accounting (the local provider: the sandbox's cgroups,
    its disk layer's quota group and its network interface). A figure the backend
    cannot tell is None.
    """

    cpu_seconds: float | None = None
    """CPU time of every process it ran, user and system."""
    memory_peak_bytes: int | None = None
    """The most memory it held at once."""
    memory_bytes: int | None = None
    """What it holds now (at release: just before its deletion)."""
    memory_average_bytes: int | None = None
    """What it held on average while it lived (sampled every few seconds)."""
    disk_bytes: int | None = None
    """What its writable layer holds (written, less what it removed again)."""
    net_rx_bytes: int | None = None
    """Bytes it received over its network (none without one)."""
    net_tx_bytes: int | None = None
    """Bytes it sent."""
    at: float = 0.0
    """When it was read (wall clock)."""


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
    tty: bool = False
    """Runs on a pseudo-terminal: its output (echo included) is all stdout."""
    uid: int
    """The uid it was started as: ``spawn(user=...)``'s, else the daemon's own."""
    gid: int
    """Its primary gid."""
    user: str | None = None
    """The uid's name in the sandbox's ``/etc/passwd``; None when it lists none."""


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


class ShellInfo(_Value):
    """A persistent shell: ``cd``, variables and functions persist between runs."""

    id: str
    pid: int
    shell: str
    alive: bool
    uid: int
    """The uid the shell runs as: ``create_shell(user=...)``'s, else the daemon's own."""
    gid: int
    """Its primary gid."""
    user: str | None = None
    """The uid's name in the sandbox's ``/etc/passwd``; None when it lists none."""


class ShellRunResult(_Value):
    """The outcome of one command run in a shell (`DaemonClient.run_in_shell`)."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_seconds: float
    alive: bool
    encoding: Encoding = "utf-8"


# Deprecated names, from when the daemon's shells were called sessions.
SessionInfo = ShellInfo
SessionRunResult = ShellRunResult


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
