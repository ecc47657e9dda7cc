"""The service's settings: API keys and their tenants, per-tenant limits, limits on requests,
and what happens at shutdown.

A plain object: the library never reads the environment. The CLI (``sandman serve``)
builds it from ``SANDMAN_*`` variables (`ServerSettings.from_env`); ``api_keys`` also accepts the string form
``"tenant-a:KEY1,tenant-b:KEY2"`` so that one variable can carry them all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from sandman import errors
from sandman.models import KubeObjectName, KubernetesOptions, SandboxSpec

__all__ = ["ApiKey", "ServerSettings", "TenantLimits", "WarmSpares"]

TENANT_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$"
"""Tenant names are label values (``sandman.io/tenant``): short, lowercase, no spaces."""


class ApiKey(BaseModel):
    """One API key, sent as ``Authorization: Bearer <key>``, and the tenant it acts for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = Field(pattern=TENANT_PATTERN)
    key: SecretStr = Field(min_length=16)
    """At least 16 characters; compare ``secrets.token_urlsafe(32)``."""


class WarmSpares(BaseModel):
    """``count`` ready spares of ``spec`` for ``tenant``: an acquire of that tenant for the
    same spec takes one at once (`Pool.warm`). They count against its ``max_sandboxes``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = Field(pattern=TENANT_PATTERN)
    spec: SandboxSpec
    count: int = Field(ge=0, le=100_000)


class TenantLimits(BaseModel):
    """What one tenant may hold at once (None is no limit), and which of the pods'
    settings (`SandboxSpec.kubernetes`) it may choose itself.

    A tenant's spec may always ask for smaller resource requests. The rest is the
    operator's to grant, since each reaches past the tenant's own sandboxes: a
    pull secret is someone's registry credential, a priority class preempts other
    jobs, a runtime class can be a weaker isolation than the pool's, and node
    selectors, tolerations and affinity put pods on nodes kept for others.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_sandboxes: int | None = Field(default=None, ge=0)
    """Sandboxes held (leased) plus acquires waiting; one more is refused with 429."""
    max_pending: int | None = Field(default=None, ge=0)
    """Acquires waiting at once; one more is refused with 429."""
    max_snapshots: int | None = Field(default=None, ge=0)
    """Snapshots kept at once (`AsyncSandbox.snapshot`; a fork makes one for a moment);
    one more is refused with 429."""
    image_pull_secrets: frozenset[KubeObjectName] = frozenset()
    """Secrets this tenant's specs may name in ``image_pull_secrets`` (none by default;
    the pool's own, `KubernetesConfig.image_pull_secrets`, apply to every pod)."""
    priority_classes: frozenset[KubeObjectName] = frozenset()
    """PriorityClasses this tenant's specs may name (none: the pool's)."""
    runtime_classes: frozenset[KubeObjectName] = frozenset()
    """RuntimeClasses this tenant's specs may name (none: the pool's)."""
    pod_placement: bool = False
    """Whether this tenant's specs may set ``node_selector``, ``tolerations`` and
    ``affinity`` (off: the pool's placement only)."""

    def refusal(self, options: KubernetesOptions) -> str | None:
        """Why these pod settings are not this tenant's to choose, or None."""
        asked: list[tuple[str, list[str | None], frozenset[str]]] = [
            ("image pull secrets", [*options.image_pull_secrets], self.image_pull_secrets),
            ("priority class", [options.priority_class_name], self.priority_classes),
            ("runtime class", [options.runtime_class_name], self.runtime_classes),
        ]
        for what, names, allowed in asked:
            refused = sorted({n for n in names if n is not None and n not in allowed})
            if refused:
                granted = ", ".join(sorted(allowed)) or "none"
                return f"{what} {', '.join(refused)} not allowed here (allowed: {granted})"
        if not self.pod_placement and (
            options.node_selector or options.tolerations or options.affinity is not None
        ):
            return "node_selector, tolerations and affinity are not allowed here"
        return None


def _parse_keys(value: object) -> object:
    """``"tenant:key,tenant:key"`` (whitespace and empty items ignored) -> a list of ApiKey data."""
    if not isinstance(value, str):
        return value
    keys: list[dict[str, str]] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        tenant, sep, key = item.partition(":")
        if not sep:
            raise ValueError("API keys are written tenant:key, separated by commas")
        keys.append({"tenant": tenant.strip(), "key": key.strip()})
    return keys


def _parse_names(value: object) -> object:
    """``"ops,sre"`` (whitespace and empty items ignored) -> a list of names."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


class ServerSettings(BaseModel):
    """How the HTTP service behaves. Times are seconds, sizes bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys: Annotated[list[ApiKey], BeforeValidator(_parse_keys)] = Field(default_factory=list)
    """Every key the service accepts. With none (and no ``anonymous_tenant``) every
    request but health and metrics is refused: the service fails closed."""
    anonymous_tenant: str | None = Field(default=None, pattern=TENANT_PATTERN)
    warm: list[WarmSpares] = Field(default_factory=list)
    """Spares kept ready from the start, each for one tenant (``sandman serve --warm``)."""
    """Requests without a key act as this tenant; for a single-user service on
    localhost only. None (the default) requires a key."""
    admin_tenants: Annotated[
        frozenset[Annotated[str, Field(pattern=TENANT_PATTERN)]], BeforeValidator(_parse_names)
    ] = frozenset()
    """Operator tenants: their keys see every tenant's sandboxes, images and errors on
    the dashboard (others see their own and one group of everyone else). Each needs an
    API key (or is the ``anonymous_tenant``); ``SANDMAN_ADMIN_TENANTS=ops,sre``."""
    default_limits: TenantLimits = Field(default_factory=TenantLimits)
    """Limits of every tenant not named in ``tenant_limits``."""
    tenant_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    """Largest request body of the JSON API (413 beyond). The daemon proxy route
    streams bodies and is bounded by ``max_proxy_body_bytes`` instead."""
    max_proxy_body_bytes: int = Field(default=1 << 30, gt=0)
    tenant_seccomp: list[str] = Field(default_factory=lambda: ["default"])
    """The ``SandboxSpec.seccomp`` values tenants may ask for. Only the default
    filter unless the operator adds ``"unconfined"`` or a profile path: a tenant
    must neither turn the filter off nor make the service read host files."""
    max_acquire_timeout: float = Field(default=600.0, gt=0)
    """An acquire waits at most this long, whatever the caller asks (and this long
    when it asks for no limit)."""
    max_waiting_requests: int = Field(default=1024, ge=0)
    """Acquire requests with a ``wait`` held open at once; beyond them such an acquire
    is answered ``202`` at once, and asked for again later (`sandman.server.tickets`):
    each open request costs the service about 37 KiB while it waits."""
    max_lease: float = Field(default=600.0, gt=0)
    """The longest session lease a client may ask for."""
    proxy_connect_timeout: float = Field(default=10.0, gt=0)
    recent_sandboxes: int = Field(default=1000, ge=0)
    """Sandboxes kept visible (state ``gone``, with their timeline) after deletion."""
    release_on_shutdown: bool = True
    """At shutdown, release every sandbox (True), or leave them running for the next
    instance of the same pool to adopt (False: ``PoolConfig.adopt_orphans``)."""
    shutdown_grace: float = Field(default=10.0, ge=0)
    """How long shutdown waits for acquires in flight to be answered before it cancels them."""
    close_pool: bool = True
    """Whether the app's lifespan starts the pool and closes it at shutdown. False when
    the caller owns the pool's lifetime."""
    metrics_key: SecretStr | None = Field(default=None, min_length=16)
    """With it, ``/metrics`` answers only ``Authorization: Bearer <metrics_key>`` (Prometheus:
    ``authorization: {credentials_file: ...}``) or an admin tenant's API key; 401
    otherwise. None (the default): ``/metrics`` is open, and then names no tenant."""
    metrics_tenant_labels: bool = False
    """Per-tenant series (``sandman_queue_depth{tenant=...}``); off, they are summed over
    tenants. Tenant names are other tenants' business: this needs ``metrics_key``."""
    run_code: Annotated[
        RunCodeSettings, BeforeValidator(lambda v: json.loads(v) if isinstance(v, str) else v)
    ] = Field(default_factory=lambda: RunCodeSettings())
    """``POST /run_code`` (SandboxFusion's API): languages and limits; JSON in
    ``SANDMAN_RUN_CODE``."""

    @model_validator(mode="after")
    def _unique_keys(self) -> ServerSettings:
        seen: set[str] = set()
        for api_key in self.api_keys:
            secret = api_key.key.get_secret_value()
            if secret in seen:
                raise ValueError(f"an API key is listed twice (tenant {api_key.tenant})")
            seen.add(secret)
        return self

    @model_validator(mode="after")
    def _known_admins(self) -> ServerSettings:
        # A typo here would silently show an operator only their own tenant.
        known = {k.tenant for k in self.api_keys} | {self.anonymous_tenant}
        unknown = sorted(self.admin_tenants - known)
        if unknown:
            raise ValueError(f"admin tenants without an API key: {', '.join(unknown)}")
        return self

    @model_validator(mode="after")
    def _tenant_labels_need_a_key(self) -> ServerSettings:
        # An open /metrics with tenant labels would list every tenant to anyone who asks.
        if self.metrics_tenant_labels and self.metrics_key is None:
            raise ValueError("metrics_tenant_labels names tenants: set metrics_key as well")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> ServerSettings:
        """Settings from ``SANDMAN_<FIELD>`` variables of ``environ`` (``SANDMAN_API_KEYS``,
        ``SANDMAN_MAX_LEASE``...), then ``overrides``. Nested fields
        (``default_limits``, ``tenant_limits``) are JSON; `ConfigError` on bad values."""
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = environ.get(f"SANDMAN_{name.upper()}")
            if raw is None:
                continue
            if name in ("default_limits", "tenant_limits"):
                try:
                    values[name] = json.loads(raw)
                except ValueError as exc:
                    raise errors.ConfigError(f"SANDMAN_{name.upper()} is not JSON: {exc}") from exc
            else:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in p['loc']) or 'settings'}: {p['msg']}"
                for p in exc.errors()[:5]
            )
            raise errors.ConfigError(f"invalid service settings: {problems}") from None

    def limits(self, tenant: str) -> TenantLimits:
        """The limits of ``tenant``."""
        return self.tenant_limits.get(tenant, self.default_limits)


class CodeLanguage(BaseModel):
    """One language of ``POST /run_code``: the image its sandboxes are made from and the
    shell commands that compile (optionally) and run the code, in the work directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str = Field(min_length=1)
    """An image the pool's provider knows (local: a name in its image store)."""
    source: str = Field(min_length=1, pattern=r"^[^/]+$")
    """The file the request's code is written to, in the work directory (``main.py``)."""
    compile: str | None = None
    """Run by ``/bin/sh -c`` before ``run``, under ``compile_timeout``; None: nothing to
    compile (``compile_result`` is then null, as in SandboxFusion)."""
    run: str = Field(min_length=1)
    """Run by ``/bin/sh -c`` with the request's stdin, under ``run_timeout``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of both commands (besides the image's)."""
    warm: int | None = Field(default=None, ge=0)
    """Ready spares kept per tenant once it has used this language (None:
    `RunCodeSettings.warm`)."""


def _default_languages() -> dict[str, CodeLanguage]:
    # Images built offline by debootstrap (docs/code-rewards.md): "fusion-python" is
    # Debian with python3, "fusion-polyglot" adds g++, golang-go, nodejs and a JDK.
    python, polyglot = "fusion-python", "fusion-polyglot"
    return {
        "python": CodeLanguage(image=python, source="main.py", run="exec python3 main.py"),
        "bash": CodeLanguage(image=python, source="main.sh", run="exec /bin/bash main.sh"),
        "cpp": CodeLanguage(
            image=polyglot,
            source="main.cpp",
            compile="g++ -std=c++17 -O2 main.cpp -o test -lpthread",
            run="exec ./test",
        ),
        "go": CodeLanguage(
            image=polyglot,
            source="main.go",
            compile="go build -o out main.go",
            run="exec ./out",
            env={"GOCACHE": "/tmp/go-cache", "GOPATH": "/tmp/go", "GO111MODULE": "off"},
        ),
        "nodejs": CodeLanguage(image=polyglot, source="main.js", run="exec node main.js"),
        "java": CodeLanguage(
            image=polyglot,
            source="Main.java",
            compile="javac -cp . Main.java",
            run="exec java -cp . -ea Main",
        ),
    }


class RunCodeSettings(BaseModel):
    """``POST /run_code``, SandboxFusion's API: the languages, and the operator's limits.

    Each request runs in a sandbox of its own, acquired for the caller's tenant and
    released at the end. Sizes are bytes, times seconds, memory MiB (as the API's).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    languages: dict[str, CodeLanguage] = Field(default_factory=_default_languages)
    """By the API's ``language`` name."""
    workdir: str = Field(default="/code", pattern=r"^/")
    """Where the code and ``files`` are written and the commands run."""
    max_run_timeout: float = Field(default=60.0, gt=0)
    """A larger ``run_timeout`` is refused (422, SandboxFusion's validation shape)."""
    max_compile_timeout: float = Field(default=60.0, gt=0)
    default_memory_mb: int = Field(default=1024, ge=32)
    """The sandbox's memory when a request says ``memory_limit_MB: -1`` (no limit)."""
    max_memory_mb: int = Field(default=8192, ge=32)
    """A larger ``memory_limit_MB`` is refused; one below 32 is raised to 32."""
    max_code_bytes: int = Field(default=256 * 1024, gt=0)
    max_files_bytes: int = Field(default=512 * 1024, gt=0)
    """The ``files`` together, decoded. The whole body is bounded by ``max_body_bytes``."""
    max_output_bytes: int = Field(default=1 << 20, gt=0)
    """Kept per stream (stdout, stderr); past it the answer is ``SandboxError``."""
    max_fetch_bytes: int = Field(default=4 << 20, gt=0)
    """The ``fetch_files`` together; past it the answer is ``SandboxError``."""
    network: str = Field(default="none", pattern=r"^(none|isolated|egress)$")
    """``SandboxSpec.network`` of every sandbox: none unless the operator allows it."""
    cpu: float = Field(default=1.0, gt=0)
    pids: int = Field(default=256, ge=16)
    warm: int = Field(default=2, ge=0)
    """Ready spares kept per tenant and language (at the default memory) once the
    tenant has used it; they count toward the tenant's ``max_sandboxes``."""
    acquire_timeout: float = Field(default=60.0, gt=0)
    """How long a request waits for its sandbox before answering ``SandboxError``."""
