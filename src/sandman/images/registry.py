"""Pulling images from a registry with skopeo, and pushing them, through OCI layouts.

``skopeo copy docker://REF oci:image:TAG`` does a download (Debian package
``skopeo``), ``skopeo copy --preserve-digests oci:push:push docker://REF`` an upload
(of a layout `sandman.images.export` wrote). Credentials go to skopeo in a temporary
containers-auth.json file (mode 0600), never on its command line, where ``ps`` would
show them; or they are the caller's own auth file (`Credentials`). Before skopeo
starts, the registry's port is probed with a short connect timeout, so an unreachable
registry fails at once instead of after the system's TCP timeouts. skopeo's
complaints are turned into `ImageError`s that say what went wrong in our words; no
password ever appears in them or in the log.

The pure parts (`parse_reference`, `skopeo_command`, `skopeo_push_command`,
`auth_file`, `registry_error`) are separate from the I/O (`probe_registry`,
`run_skopeo`, `push_with_skopeo`).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import shutil
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias, overload

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, SecretStr

from sandman.errors import ConfigError, ImageError, ImageNotFound
from sandman.images.names import normalize_name, tag_of

__all__ = [
    "AUTH_REMEDY",
    "PROBE_TIMEOUT",
    "TLS_REMEDY",
    "Credentials",
    "Reference",
    "RegistryAuth",
    "auth_file",
    "fetch_manifest",
    "parse_reference",
    "probe_registry",
    "pull_error",
    "push_error",
    "push_with_skopeo",
    "registry_error",
    "run_skopeo",
    "skopeo_command",
    "skopeo_inspect_command",
    "skopeo_push_command",
]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0
"""Seconds to wait for the registry's TCP port before calling it unreachable."""

LAYOUT_DIR = "image"
"""Where skopeo writes the OCI layout, inside the pull's scratch directory."""

PUSH_DIR = "push"
"""Where the layout to push is, inside the push's scratch directory."""
PUSH_TAG = "push"

AUTH_FILE = "auth.json"

TLS_REMEDY = "pass tls_verify=False"
"""How an error tells the caller to allow plain HTTP (the CLI says ``--insecure``)."""
AUTH_REMEDY = "pass auth=RegistryAuth(...)"
"""How an error tells the caller to give credentials (the CLI names its options)."""

DOCKER_HUB = "docker.io"
_DOCKER_HUB_ENDPOINT = "registry-1.docker.io"
_INSTALL_HINT = "install it with `apt-get install -y skopeo` (Debian/Ubuntu)"
_UNREACHABLE_MARKERS = (
    "connection refused",
    "no such host",
    "i/o timeout",
    "network is unreachable",
    "no route to host",
    "connection reset",
    "server misbehaving",
)


class RegistryAuth(BaseModel):
    """Credentials for a registry. The password is a `SecretStr`: it never shows in a repr."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    username: str
    password: SecretStr


Credentials: TypeAlias = RegistryAuth | Path
"""What a pull or a push authenticates with: a user and password (`RegistryAuth`,
written to a private auth file for skopeo), or the path of a containers-auth.json
file (as ``skopeo login`` or ``podman login`` write it), handed to skopeo as it is."""


@dataclass(frozen=True)
class Reference:
    """An image reference, taken apart.

    `name` is the store's name for it (``busybox:1.0``, ``localhost:5000/x:1``),
    `registry` the registry as credentials are keyed (``docker.io``,
    ``localhost:5000``), `tag` None for references by digest.
    """

    name: str
    registry: str
    tag: str | None

    @property
    def source(self) -> str:
        """skopeo's source argument."""
        return f"docker://{self.name}"

    def endpoints(self, tls_verify: bool) -> list[tuple[str, int]]:
        """The (host, port) pairs skopeo may connect to for this registry."""
        if self.registry == DOCKER_HUB:
            return [(_DOCKER_HUB_ENDPOINT, 443)]
        host, port = _split_host_port(self.registry)
        if port is not None:
            return [(host, port)]
        # Without a port, skopeo tries HTTPS, and plain HTTP when TLS is not verified.
        return [(host, 443)] if tls_verify else [(host, 443), (host, 80)]


def parse_reference(reference: str) -> Reference:
    """Take `reference` apart; raises `ImageError` for what is not an image reference."""
    name = normalize_name(reference)
    first, slash, _ = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry = first
    else:
        registry = DOCKER_HUB
    return Reference(name=name, registry=registry, tag=tag_of(name))


def _split_host_port(registry: str) -> tuple[str, int | None]:
    if registry.startswith("["):  # [::1]:5000
        host, _, rest = registry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    host, colon, port = registry.rpartition(":")
    if colon and port.isdigit():
        return host, int(port)
    return registry, None


def auth_file(reference: Reference, auth: RegistryAuth) -> bytes:
    """A containers-auth.json document holding `auth` for the reference's registry."""
    token = f"{auth.username}:{auth.password.get_secret_value()}".encode()
    document = {"auths": {reference.registry: {"auth": base64.b64encode(token).decode()}}}
    return json.dumps(document).encode()


def skopeo_command(
    skopeo: str, reference: Reference, *, tls_verify: bool, authfile: str | None
) -> list[str]:
    """The ``skopeo copy`` command line; it runs in the pull's scratch directory.

    The destination is relative, since skopeo's ``oci:PATH:TAG`` cannot hold
    a path with a colon in it.
    """
    command = [skopeo, "copy", "--retry-times", "0", "--remove-signatures"]
    command.append(f"--src-tls-verify={'true' if tls_verify else 'false'}")
    if authfile is not None:
        command += ["--src-authfile", authfile]
    destination = f"oci:{LAYOUT_DIR}" + (f":{reference.tag}" if reference.tag else "")
    return [*command, reference.source, destination]


def skopeo_inspect_command(
    skopeo: str, reference: Reference, *, tls_verify: bool, authfile: str | None, digest: str | None
) -> list[str]:
    """The ``skopeo inspect --raw`` command line that fetches the manifest (no blob) of
    `reference`, or of the image `digest` in its repository."""
    command = [skopeo, "inspect", "--raw", "--retry-times", "0"]
    command.append(f"--tls-verify={'true' if tls_verify else 'false'}")
    if authfile is not None:
        command += ["--authfile", authfile]
    source = reference.source
    if digest is not None:
        repository = reference.name.partition("@")[0]
        if reference.tag is not None:
            repository = repository.removesuffix(f":{reference.tag}")
        source = f"docker://{repository}@{digest}"
    return [*command, source]


def skopeo_push_command(
    skopeo: str, reference: Reference, *, tls_verify: bool, authfile: str | None
) -> list[str]:
    """The ``skopeo copy`` command line that uploads the layout ``push`` (relative: it
    runs in the push's scratch directory) to `reference`. ``--preserve-digests``: the
    manifest and blobs go as they are, never converted or compressed again, so the
    digests are those the layout has: skopeo asks the registry for each blob by it and
    uploads only what it lacks, and the manifest's digest is the one we computed."""
    command = [skopeo, "copy", "--retry-times", "0", "--preserve-digests"]
    command.append(f"--dest-tls-verify={'true' if tls_verify else 'false'}")
    if authfile is not None:
        command += ["--dest-authfile", authfile]
    return [*command, f"oci:{PUSH_DIR}:{PUSH_TAG}", reference.source]


def registry_error(
    reference: Reference,
    stderr: str,
    *,
    auth: Credentials | None,
    tls_verify: bool,
    action: Literal["pull", "push"],
) -> ImageError:
    """The error to raise for a failed ``skopeo`` `action` on `reference` that printed
    `stderr`, in our words, no password in it."""
    detail = _last_message(_scrub(stderr, auth))
    lowered = detail.lower()
    where = "from" if action == "pull" else "to"
    what = f"cannot {action} {reference.name} {where} {reference.registry}"
    if "pinging container registry" in lowered and any(
        marker in lowered for marker in _UNREACHABLE_MARKERS
    ):
        return ImageError(
            f"cannot {action} {reference.name}: the registry {reference.registry} is "
            f"unreachable ({detail})"
        )
    if "manifest unknown" in lowered or "name unknown" in lowered or "not found" in lowered:
        if action == "push":
            return ImageError(
                f"{what}: the registry does not know this repository, or is no registry ({detail})"
            )
        return ImageNotFound(
            f"{what}: no such repository or tag in the registry ({detail})"
            if reference.tag
            else f"{what}: no such repository or digest in the registry ({detail})"
        )
    if "unauthorized" in lowered or "authentication required" in lowered or "denied" in lowered:
        if auth is None:
            return ImageError(
                f"{what}: authentication failed: the registry wants credentials "
                f"({AUTH_REMEDY}), or the repository does not exist ({detail})"
            )
        who = (
            f"with the credentials in {auth}"
            if isinstance(auth, Path)
            else f"for user {auth.username!r}"
        )
        access = "access to" if action == "pull" else "right to push to"
        return ImageError(
            f"{what}: authentication failed {who}: wrong credentials, or no {access} "
            f"this repository ({detail})"
        )
    if "server gave http response to https client" in lowered:
        return ImageError(
            f"{what}: the registry speaks plain HTTP; {TLS_REMEDY} if you trust it ({detail})"
        )
    if tls_verify and ("x509" in lowered or "certificate" in lowered):
        return ImageError(
            f"{what}: the registry's TLS certificate was refused; {TLS_REMEDY} only "
            f"for a registry you trust ({detail})"
        )
    return ImageError(f"{what}: skopeo failed: {detail or 'no error message'}")


def pull_error(
    reference: Reference, stderr: str, *, auth: Credentials | None, tls_verify: bool
) -> ImageError:
    """The error to raise for a failed pull (`registry_error`)."""
    return registry_error(reference, stderr, auth=auth, tls_verify=tls_verify, action="pull")


def push_error(
    reference: Reference, stderr: str, *, auth: Credentials | None, tls_verify: bool
) -> ImageError:
    """The error to raise for a failed push (`registry_error`)."""
    return registry_error(reference, stderr, auth=auth, tls_verify=tls_verify, action="push")


def _last_message(stderr: str) -> str:
    """skopeo's fatal message (``level=fatal msg="..."``), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1]
    start = line.find('msg="')
    if start >= 0:
        message = line[start + 5 :]
        end = message.rfind('"')
        line = message[:end] if end >= 0 else message
        line = line.replace('\\"', '"')
    return line[:2000]


def _scrub(text: str, auth: Credentials | None) -> str:
    """Remove the password (plain and inside the auth token) from text we show."""
    if not isinstance(auth, RegistryAuth):
        return text
    password = auth.password.get_secret_value()
    token = base64.b64encode(f"{auth.username}:{password}".encode()).decode()
    for secret in (token, password):
        if secret:
            text = text.replace(secret, "***")
    return text


def _proxied(host: str) -> bool:
    """Whether the environment sends connections to `host` through a proxy."""
    if host == "localhost" or _is_loopback(host):
        return False  # as Go (skopeo) does: never through a proxy
    proxies = urllib.request.getproxies()
    return bool(proxies.get("https") or proxies.get("http")) and not (
        urllib.request.proxy_bypass(host)
    )


async def probe_registry(
    reference: Reference, *, tls_verify: bool, timeout: float, action: str = "pull"
) -> None:
    """Raise `ImageError` unless some endpoint of the registry accepts a TCP connection.

    Skipped when a proxy is configured for the registry: then only skopeo
    (through the proxy) can tell.
    """
    endpoints = reference.endpoints(tls_verify)
    if _proxied(endpoints[0][0]):
        return
    problems = []
    for host, port in endpoints:
        try:
            with anyio.fail_after(timeout):
                stream = await anyio.connect_tcp(host, port)
        except TimeoutError:
            problems.append(f"{host}:{port}: no answer within {timeout:g}s")
            continue
        except OSError as exc:
            # anyio says "All connection attempts failed"; the cause says why.
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
            problems.append(f"{host}:{port}: {_reason(cause)}")
            continue
        await stream.aclose()
        return
    raise ImageError(
        f"cannot {action} {reference.name}: the registry {reference.registry} is unreachable "
        f"({'; '.join(problems)})"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reason(error: OSError) -> str:
    if isinstance(error, socket.gaierror) or not error.errno:
        return error.strerror or str(error)
    return os.strerror(error.errno).lower()


def find_skopeo() -> str:
    """The path of the skopeo binary; `ImageError` with the install command when missing."""
    found = shutil.which("skopeo")
    if found is None:
        raise ImageError(
            f"pulling and pushing images needs skopeo, which is not on PATH: {_INSTALL_HINT}"
        )
    return found


async def run_skopeo(
    reference: Reference,
    scratch: Path,
    *,
    auth: Credentials | None,
    tls_verify: bool,
    timeout: float,
) -> Path:
    """Download `reference` into an OCI layout under `scratch` (an empty, private dir).

    Probes the registry, writes the auth file (if any), runs skopeo within
    `timeout` seconds and kills it on timeout or cancellation. The auth file
    is gone when this returns or raises. Returns the layout's path.
    """
    if timeout <= 0:
        raise ConfigError(f"timeout must be positive, not {timeout}")
    skopeo = find_skopeo()
    started = time.monotonic()
    returncode, stderr = -1, ""
    with anyio.move_on_after(timeout) as deadline:
        await probe_registry(reference, tls_verify=tls_verify, timeout=min(PROBE_TIMEOUT, timeout))
        try:
            authfile = await _authfile(reference, auth, scratch)
            command = skopeo_command(skopeo, reference, tls_verify=tls_verify, authfile=authfile)
            logger.info("pulling %s with skopeo", reference.name)
            returncode, stderr = await _run(command, scratch)
        finally:
            (scratch / AUTH_FILE).unlink(missing_ok=True)
    if deadline.cancelled_caught:
        raise ImageError(
            f"pulling {reference.name} timed out after {timeout:g}s; skopeo was killed"
        )
    if returncode != 0:
        error = pull_error(reference, stderr, auth=auth, tls_verify=tls_verify)
        logger.info("pull of %s failed: %s", reference.name, error)
        raise error
    logger.info("pulled %s in %.1fs", reference.name, time.monotonic() - started)
    return scratch / LAYOUT_DIR


async def fetch_manifest(
    reference: Reference,
    scratch: Path,
    *,
    auth: Credentials | None,
    tls_verify: bool,
    timeout: float,
) -> bytes:
    """The image manifest of `reference` for this host, fetched with ``skopeo inspect
    --raw`` (no blob is downloaded); for a multi-platform image, the manifest of its
    linux image for this machine (or the index itself when it has none)."""
    from sandman.images.formats import choose_platform

    if timeout <= 0:
        raise ConfigError(f"timeout must be positive, not {timeout}")
    skopeo = find_skopeo()
    returncode, stderr, stdout = -1, "", b""
    with anyio.move_on_after(timeout) as deadline:
        await probe_registry(reference, tls_verify=tls_verify, timeout=min(PROBE_TIMEOUT, timeout))
        try:
            authfile = await _authfile(reference, auth, scratch)
            digest: str | None = None
            for _ in range(2):
                command = skopeo_inspect_command(
                    skopeo, reference, tls_verify=tls_verify, authfile=authfile, digest=digest
                )
                returncode, stderr, stdout = await _run(command, scratch, stdout=True)
                if returncode != 0 or digest is not None:
                    break
                digest = choose_platform(stdout)
                if digest is None:
                    break
        finally:
            (scratch / AUTH_FILE).unlink(missing_ok=True)
    if deadline.cancelled_caught:
        raise ImageError(
            f"fetching the manifest of {reference.name} timed out after {timeout:g}s; "
            "skopeo was killed"
        )
    if returncode != 0:
        error = pull_error(reference, stderr, auth=auth, tls_verify=tls_verify)
        logger.info("manifest of %s: %s", reference.name, error)
        raise error
    return stdout


async def push_with_skopeo(
    reference: Reference,
    scratch: Path,
    *,
    auth: Credentials | None,
    tls_verify: bool,
    timeout: float,
) -> None:
    """Upload the OCI layout ``push`` in `scratch` (tagged ``push``) to `reference`.

    skopeo asks the registry for each blob by digest first and uploads only those it
    lacks. Writes the auth file (if any), runs skopeo within `timeout` seconds and kills
    it on timeout or cancellation; the auth file is gone when this returns or raises.
    The registry is not probed here: the caller does that before it exports anything.
    """
    if timeout <= 0:
        raise ConfigError(f"timeout must be positive, not {timeout}")
    skopeo = find_skopeo()
    started = time.monotonic()
    returncode, stderr = -1, ""
    with anyio.move_on_after(timeout) as deadline:
        try:
            authfile = await _authfile(reference, auth, scratch)
            command = skopeo_push_command(
                skopeo, reference, tls_verify=tls_verify, authfile=authfile
            )
            logger.info("pushing %s with skopeo", reference.name)
            returncode, stderr = await _run(command, scratch)
        finally:
            (scratch / AUTH_FILE).unlink(missing_ok=True)
    if deadline.cancelled_caught:
        raise ImageError(
            f"pushing {reference.name} timed out after {timeout:g}s; skopeo was killed"
        )
    if returncode != 0:
        error = push_error(reference, stderr, auth=auth, tls_verify=tls_verify)
        logger.info("push of %s failed: %s", reference.name, error)
        raise error
    logger.info("pushed %s in %.1fs", reference.name, time.monotonic() - started)


async def _authfile(reference: Reference, auth: Credentials | None, scratch: Path) -> str | None:
    """skopeo's auth file argument for `auth`: the caller's own file (absolute: skopeo
    runs in `scratch`), or ``auth.json`` written in `scratch` (mode 0600) from a user
    and password; None without credentials."""
    if auth is None:
        return None
    if isinstance(auth, Path):
        path = anyio.Path(auth)
        if not await path.is_file():
            raise ConfigError(f"the registry auth file {auth} does not exist or is no file")
        return str(await path.absolute())
    await anyio.to_thread.run_sync(_write_private, scratch / AUTH_FILE, auth_file(reference, auth))
    return AUTH_FILE


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


@overload
async def _run(command: list[str], cwd: Path) -> tuple[int, str]: ...
@overload
async def _run(
    command: list[str], cwd: Path, *, stdout: Literal[True]
) -> tuple[int, str, bytes]: ...
async def _run(
    command: list[str], cwd: Path, *, stdout: bool = False
) -> tuple[int, str] | tuple[int, str, bytes]:
    """Run `command`; its exit status and stderr (and stdout, when asked). Killed (and
    reaped) if we are cancelled."""
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if stdout else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as exc:
        raise ImageError(f"cannot run skopeo ({exc}): {_INSTALL_HINT}") from exc
    try:
        out, stderr = await process.communicate()
        returncode = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()
    if stdout:
        return returncode, stderr.decode(errors="replace"), out or b""
    return returncode, stderr.decode(errors="replace")
