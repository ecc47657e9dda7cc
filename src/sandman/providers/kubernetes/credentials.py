"""Where the API server is and who we are to it: kubeconfigs, explicit files, or in-cluster.

Kubeconfigs are read as kubectl reads them:

- several files (a ``KUBECONFIG``-style list, split at ``os.pathsep``) are merged:
  the first file to name a cluster, user or context wins, ``current-context``
  comes from the first file that sets one, missing files in a list are skipped;
- relative paths (certificate-authority, client-certificate/-key, tokenFile, and
  an exec command with a ``/`` in it) are resolved against the file naming them;
- any context, not only the current one; ``proxy-url`` (http/https) and
  ``tls-server-name``;
- a bearer token inline or in a ``tokenFile`` (re-read every minute and at once
  after a 401: rotating OIDC and service-account tokens), client certificates;
- exec credential plugins (``client.authentication.k8s.io/v1`` and ``v1beta1``
  ``ExecCredential``: ``aws eks get-token``, ``gke-gcloud-auth-plugin``,
  ``kubelogin``): run once, their token (or client certificate) cached until
  shortly before its ``expirationTimestamp``, and run again once when the API
  server answers 401.

Why not ``kubernetes_asyncio``'s loader: importing it imports its whole
generated client (768 model modules: +0.34 CPU-s and +38 MB RSS over aiohttp
and PyYAML, +48 MB installed, plus six and python-dateutil), and it differs from
kubectl where it matters here: ``current-context`` from the *last* file; exec
tokens renewed only by a separate ``refresh_token`` task polling every 60 s
(a token living less than that expires in use) and counted expired 5 minutes
early; no ``interactiveMode`` (``spec.interactive`` is whether stdout is a
terminal, and the plugin inherits stdin) or ``provideClusterInfo``; no refresh
on a 401; ``tokenFile`` read once; ``datetime.utcnow()`` (deprecated). The
protocol is small; the hot path stays on our aiohttp client (`api`).

An exec plugin may answer with a client certificate (Teleport's ``tsh``): it is
loaded into the TLS context, and the API client opens new connections with it.

Refused with a clear error: ``auth-provider`` (removed from kubectl for gcp and
azure; use the exec plugin, e.g. kubelogin, for oidc), ``socks5`` proxies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import ssl
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sandman import errors
from sandman.settings import KubernetesConfig

__all__ = ["Credentials", "ExecPlugin", "load_credentials", "read_kubeconfigs"]

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_TOKEN_TTL = 60.0  # bound service-account tokens rotate; re-read the file this often
_EXEC_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
_INTERACTIVE_MODES = ("Never", "IfAvailable", "Always")
_EARLY = 30.0  # run a plugin again this long before its token expires (at most)
_PLUGIN_TIMEOUT = 60.0  # a non-interactive plugin that takes longer is stuck
_STDERR_LIMIT = 2000  # how much of a failed plugin's stderr an error quotes
_clock = time.monotonic  # when exec tokens are fresh until (a test moves it on)


@dataclass
class ExecPlugin:
    """An exec credential plugin and its cached answer: a token, or a client
    certificate and key (PEM), or both.

    `current` runs the plugin when it has not run or its answer expires within
    ``min(30 s, a fifth of its lifetime)``; concurrent callers share one run.
    `refresh` runs it again after a 401, unless another caller already did.
    """

    command: str
    user: str
    """The kubeconfig user it belongs to (for messages)."""
    api_version: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold secrets
    interactive_mode: str = "IfAvailable"
    install_hint: str | None = None
    cluster: dict[str, Any] | None = None
    """``spec.cluster`` of its input, when the kubeconfig says ``provideClusterInfo``."""
    runs: int = 0
    """How often it was run (the cache's effect, for tests and logs)."""
    generation: int = 0
    """How many answers it gave; the current one is this one."""
    token: str | None = field(default=None, repr=False)
    certificate: tuple[bytes, bytes] | None = field(default=None, repr=False)
    """The client certificate chain and key of its answer, PEM."""
    _fresh_until: float = field(default=0.0, repr=False)  # time.monotonic()
    _locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )

    def _lock(self) -> asyncio.Lock:
        # One per event loop: an asyncio.Lock belongs to the loop that first waited on it.
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            lock = self._locks[loop] = asyncio.Lock()
        return lock

    async def current(self) -> int:
        """Make the answer current (from the cache while it is fresh); its generation."""
        if self.generation and _clock() < self._fresh_until:
            return self.generation
        async with self._lock():
            if not self.generation or _clock() >= self._fresh_until:
                await self._run()
            return self.generation

    async def refresh(self, refused: int) -> None:
        """The API server refused the answer of generation ``refused``: run the plugin
        again (once for all the requests that were refused with it)."""
        async with self._lock():
            if self.generation == refused:
                await self._run()

    def interactive(self) -> bool:
        """Whether the plugin gets the terminal; ConfigError if it must and there is none."""
        if self.interactive_mode == "Never":
            return False
        tty = sys.stdin is not None and sys.stdin.isatty()
        if self.interactive_mode == "Always" and not tty:
            raise errors.ConfigError(
                f"kubeconfig user {self.user!r}: exec plugin {self.command!r} has "
                "interactiveMode: Always but standard input is not a terminal; run it "
                "once in a terminal to log in, or configure it to work without one"
            )
        return tty

    async def _run(self) -> None:
        interactive = self.interactive()
        spec: dict[str, Any] = {"interactive": interactive}
        if self.cluster is not None:
            spec["cluster"] = self.cluster
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        what = f"kubeconfig user {self.user!r}: exec plugin {self.command!r}"
        self.runs += 1
        try:
            # Interactive: the terminal is the plugin's (a login prompt, a device code);
            # else no stdin, stderr kept for the error, and its own process group, so
            # a stuck plugin goes with all its children.
            proc = await asyncio.create_subprocess_exec(
                self.command, *self.args, env=env,
                stdin=None if interactive else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=None if interactive else asyncio.subprocess.PIPE,
                start_new_session=not interactive,
            )  # fmt: skip
        except FileNotFoundError:
            hint = f": {self.install_hint.strip()}" if self.install_hint else ""
            raise errors.ConfigError(f"{what} not found{hint}") from None
        except OSError as exc:
            raise errors.ConfigError(f"{what} cannot run: {exc}") from exc
        try:
            async with asyncio.timeout(None if interactive else _PLUGIN_TIMEOUT):
                stdout, stderr = await proc.communicate()
        except TimeoutError:
            raise errors.ConfigError(
                f"{what} did not answer within {_PLUGIN_TIMEOUT:g} s"
            ) from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: leave nothing behind
                with contextlib.suppress(ProcessLookupError):
                    if interactive:
                        proc.kill()
                    else:
                        os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        said = (stderr or b"").decode(errors="replace").strip()[-_STDERR_LIMIT:]
        if proc.returncode != 0:
            raise errors.ConfigError(
                f"{what} failed (exit {proc.returncode})" + (f": {said}" if said else "")
            )
        if said:
            logger.debug("%s said: %s", what, said)
        self._accept(stdout, what)

    def _accept(self, stdout: bytes, what: str) -> None:
        try:
            answer = json.loads(stdout)
        except ValueError:
            raise errors.ConfigError(
                f"{what} wrote no JSON ExecCredential: {stdout[:200]!r}"
            ) from None
        if not isinstance(answer, dict) or answer.get("kind") != "ExecCredential":
            raise errors.ConfigError(f"{what} wrote no ExecCredential: {stdout[:200]!r}")
        if answer.get("apiVersion") != self.api_version:
            raise errors.ConfigError(
                f"{what} answered with apiVersion {answer.get('apiVersion')!r}, "
                f"the kubeconfig asks for {self.api_version!r}"
            )
        status = answer.get("status")
        if not isinstance(status, dict):
            raise errors.ConfigError(f"{what} answered with no status")
        token = status.get("token")
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        texts = all(value is None or isinstance(value, str) for value in (token, cert, key))
        if not texts or bool(cert) != bool(key):
            raise errors.ConfigError(
                f"{what} answered with a malformed status (strings; clientCertificateData "
                "and clientKeyData go together)"
            )
        if not token and not cert:
            raise errors.ConfigError(
                f"{what} answered with neither status.token nor status.clientCertificateData"
            )
        self.token = token or None
        self.certificate = (cert.encode(), key.encode()) if cert and key else None
        self.generation += 1
        expires = status.get("expirationTimestamp")
        if not expires:
            self._fresh_until = float("inf")  # until the API server refuses it
            return
        try:
            at = datetime.fromisoformat(str(expires)).timestamp()
        except ValueError:
            raise errors.ConfigError(
                f"{what}: expirationTimestamp {expires!r} is not an RFC 3339 time"
            ) from None
        lifetime = at - time.time()
        # Early enough that requests under way do not race the expiry; never more
        # often than once a second (a plugin answering with expired tokens).
        self._fresh_until = _clock() + max(1.0, lifetime - min(_EARLY, lifetime / 5))


@dataclass
class Credentials:
    """How to talk to one API server: its URL, TLS settings, proxy and bearer token."""

    server: str
    namespace: str
    ssl_context: ssl.SSLContext
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    exec_plugin: ExecPlugin | None = None
    proxy: str | None = None
    """An http(s) proxy every request goes through (the cluster's ``proxy-url``)."""
    tls_server_name: str | None = None
    """The name the server's certificate is checked against, if not the URL's host."""
    tls_generation: int = 0
    """Bumped when an exec plugin's new client certificate went into ``ssl_context``:
    connections made before still present the old one (`api.KubeAPI` makes new ones)."""
    generation: int = field(default=0, repr=False)
    """The exec plugin answer the last `authorization` gave."""
    _certificate_from: int = field(default=0, repr=False)  # that generation's cert is loaded
    _read_at: float = field(default=0.0, repr=False)

    def bearer(self) -> str | None:
        """The current static token; a token file is re-read at most once a minute."""
        if self.token_file is not None and time.monotonic() - self._read_at > _TOKEN_TTL:
            try:
                self.token = self.token_file.read_text().strip()
            except OSError as exc:
                raise errors.ConfigError(
                    f"cannot read token file {self.token_file}: {exc}"
                ) from exc
            self._read_at = time.monotonic()
        return self.token

    async def authorization(self) -> str | None:
        """The bearer token for the next request (an exec plugin's, run if need be; its
        client certificate, if it gave one, loaded into ``ssl_context``)."""
        plugin = self.exec_plugin
        if plugin is None:
            return self.bearer()
        self.generation = await plugin.current()
        if plugin.certificate is not None and self._certificate_from != self.generation:
            _load_pem_pair(self.ssl_context, *plugin.certificate, f"exec plugin {plugin.command!r}")
            self._certificate_from = self.generation
            self.tls_generation += 1
        return plugin.token

    async def refresh(self, refused: str | None, generation: int | None = None) -> bool:
        """The API server answered 401 to ``refused`` (and, with an exec plugin, to its
        answer of ``generation``): get new credentials. True if there may be some worth
        a retry (a plugin run again, a token file that changed)."""
        if self.exec_plugin is not None:
            await self.exec_plugin.refresh(self.generation if generation is None else generation)
            return True
        if self.token_file is not None:
            self._read_at = 0.0
            return self.bearer() != refused
        return False


def load_credentials(config: KubernetesConfig) -> Credentials:
    """Credentials from the config: kubeconfig(s), else server + files, else in-cluster,
    else ``~/.kube/config``."""
    if config.kubeconfig is not None:
        return _from_kubeconfig(config)
    if config.server is not None:
        context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
        return Credentials(
            server=config.server.rstrip("/"),
            namespace=config.namespace or "default",
            ssl_context=context,
            token_file=config.token_file,
        )
    if (SERVICE_ACCOUNT / "token").is_file():
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise errors.ConfigError("in-cluster, but KUBERNETES_SERVICE_HOST is not set")
        namespace = config.namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        host = f"[{host}]" if ":" in host else host
        return Credentials(
            server=f"https://{host}:{port}",
            namespace=namespace,
            ssl_context=ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt")),
            token_file=SERVICE_ACCOUNT / "token",
        )
    default = Path.home() / ".kube" / "config"
    if default.is_file():  # where kubectl looks last (and `aws eks update-kubeconfig` writes)
        return _from_kubeconfig(config.model_copy(update={"kubeconfig": default}))
    raise errors.ConfigError(
        "no Kubernetes credentials: set kubeconfig, or server (+ token_file, ca_file), "
        "or run in a pod with a service account, or write ~/.kube/config"
    )


def _paths(kubeconfig: Path | list[Path]) -> list[Path]:
    given = kubeconfig if isinstance(kubeconfig, list) else [kubeconfig]
    paths: list[Path] = []
    for entry in given:
        for part in str(entry).split(os.pathsep):  # a KUBECONFIG value: a:b:c
            path = Path(part).expanduser()
            if part and path not in paths:
                paths.append(path)
    return paths


def read_kubeconfigs(paths: list[Path]) -> dict[str, Any]:
    """The kubeconfig files merged as kubectl merges ``KUBECONFIG``.

    The result maps ``clusters``, ``users`` and ``contexts`` to ``{name: entry}``
    (the first file to name one wins; relative paths in it already resolved
    against its file) and ``current-context`` to the first one set. With more
    than one path, missing files are skipped; one path must exist.
    """
    try:
        import yaml
    except ImportError:
        raise errors.ConfigError(
            "reading a kubeconfig needs PyYAML: pip install 'sandman-rl[kubernetes]'"
        ) from None
    merged: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": None}
    read = 0
    for path in paths:
        try:
            text = path.read_text()
        except FileNotFoundError as exc:
            if len(paths) > 1:
                continue
            raise errors.ConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        except OSError as exc:
            raise errors.ConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise errors.ConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        read += 1
        if doc is None:
            continue  # an empty file, as kubectl allows
        if not isinstance(doc, dict):
            raise errors.ConfigError(f"kubeconfig {path} is not a mapping")
        for kind, key in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            entries = doc.get(kind) or []
            if not isinstance(entries, list):
                raise errors.ConfigError(f"kubeconfig {path}: {kind} is not a list")
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise errors.ConfigError(f"kubeconfig {path}: a {key} without a name")
                body = entry.get(key) or {}
                if not isinstance(body, dict):
                    raise errors.ConfigError(
                        f"kubeconfig {path}: {key} {entry['name']!r} is not a mapping"
                    )
                if entry["name"] not in merged[kind]:
                    merged[kind][entry["name"]] = _resolved(kind, body, path)
        if merged["current-context"] is None and doc.get("current-context"):
            merged["current-context"] = str(doc["current-context"])
    if not read:
        raise errors.ConfigError(
            "none of the kubeconfig files exists: " + os.pathsep.join(map(str, paths))
        )
    return merged


def _resolved(kind: str, body: dict[str, Any], path: Path) -> dict[str, Any]:
    """``body`` with its file paths made absolute against ``path``'s directory."""
    base = path.parent.absolute()
    body = dict(body)
    keys = {
        "clusters": ("certificate-authority",),
        "users": ("client-certificate", "client-key", "tokenFile"),
    }.get(kind, ())
    for key in keys:
        if body.get(key):
            body[key] = str(base / Path(str(body[key])).expanduser())
    exec_ = body.get("exec")
    if kind == "users" and isinstance(exec_, dict):
        command = str(exec_.get("command") or "")
        # As kubectl: a command with a slash is a path (relative to the file), without
        # one it is looked up on PATH.
        if os.sep in command and not os.path.isabs(command):
            body["exec"] = dict(exec_, command=str(base / command))
    return body


def _from_kubeconfig(config: KubernetesConfig) -> Credentials:
    assert config.kubeconfig is not None
    paths = _paths(config.kubeconfig)
    where = os.pathsep.join(map(str, paths))
    doc = read_kubeconfigs(paths)
    name = config.context or doc["current-context"]
    if not name:
        raise errors.ConfigError(f"kubeconfig {where}: no current-context; set a context")
    context = _named(doc, "contexts", name, where, "context")
    cluster = _named(doc, "clusters", context.get("cluster"), where, "cluster")
    user_name = context.get("user")
    user = _named(doc, "users", user_name, where, "user") if user_name else {}
    server = cluster.get("server")
    if not server:
        raise errors.ConfigError(
            f"kubeconfig {where}: cluster {context['cluster']!r} has no server"
        )
    ca_data: bytes | None = None
    if cluster.get("insecure-skip-tls-verify"):
        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    else:
        try:
            if data := cluster.get("certificate-authority-data"):
                ca_data = base64.b64decode(data)
            elif ca := cluster.get("certificate-authority"):
                ca_data = Path(ca).read_bytes()
            tls = ssl.create_default_context(cadata=ca_data.decode() if ca_data else None)
        except (OSError, ValueError, ssl.SSLError) as exc:
            raise errors.ConfigError(
                f"kubeconfig {where}: cluster {context['cluster']!r}: bad CA: {exc}"
            ) from exc
    if "auth-provider" in user:
        raise errors.ConfigError(
            f"kubeconfig {where}: user {user_name!r}: auth-provider credentials are not "
            "supported (kubectl dropped gcp and azure); use an exec plugin "
            "(gke-gcloud-auth-plugin, kubelogin), a token or a client certificate"
        )
    _load_client_cert(tls, user, where)
    proxy = cluster.get("proxy-url") or None
    if proxy and not str(proxy).startswith(("http://", "https://")):
        raise errors.ConfigError(
            f"kubeconfig {where}: proxy-url {proxy!r}: only http:// and https:// proxies "
            "are supported"
        )
    exec_plugin = None
    if "exec" in user:
        exec_plugin = _exec_plugin(user["exec"], str(user_name), cluster, ca_data, where)
        exec_plugin.interactive()  # interactiveMode: Always without a terminal: say so now
    return Credentials(
        server=str(server).rstrip("/"),
        namespace=config.namespace or context.get("namespace") or "default",
        ssl_context=tls,
        token=user.get("token"),
        token_file=Path(user["tokenFile"]) if user.get("tokenFile") else None,
        exec_plugin=exec_plugin,
        proxy=str(proxy) if proxy else None,
        tls_server_name=cluster.get("tls-server-name") or None,
    )


def _exec_plugin(
    spec: object, user: str, cluster: dict[str, Any], ca_data: bytes | None, where: str
) -> ExecPlugin:
    what = f"kubeconfig {where}: user {user!r}: exec"
    if not isinstance(spec, dict) or not spec.get("command"):
        raise errors.ConfigError(f"{what} has no command")
    version = spec.get("apiVersion")
    if version not in _EXEC_VERSIONS:
        raise errors.ConfigError(
            f"{what}: apiVersion {version!r} is not supported (one of {', '.join(_EXEC_VERSIONS)})"
        )
    mode = spec.get("interactiveMode") or "IfAvailable"
    if mode not in _INTERACTIVE_MODES:
        raise errors.ConfigError(f"{what}: interactiveMode {mode!r} is not one of Never, "
                                 "IfAvailable, Always")  # fmt: skip
    args = spec.get("args") or []
    env = spec.get("env") or []
    if not isinstance(args, list) or not isinstance(env, list):
        raise errors.ConfigError(f"{what}: args and env must be lists")
    try:
        variables = {str(item["name"]): str(item["value"]) for item in env}
    except (KeyError, TypeError):
        raise errors.ConfigError(f"{what}: each env entry needs a name and a value") from None
    info = None
    if spec.get("provideClusterInfo"):
        # ExecCredential's spec.cluster, as client-go fills it.
        info = {"server": cluster.get("server")}
        for key in ("tls-server-name", "insecure-skip-tls-verify", "proxy-url",
                    "disable-compression"):  # fmt: skip
            if cluster.get(key):
                info[key] = cluster[key]
        if ca_data:
            info["certificate-authority-data"] = base64.b64encode(ca_data).decode()
        for extension in cluster.get("extensions") or []:
            if isinstance(extension, dict) and (
                extension.get("name") == "client.authentication.k8s.io/exec"
            ):
                info["config"] = extension.get("extension")
    return ExecPlugin(
        command=str(spec["command"]),
        user=user,
        api_version=str(version),
        args=[str(arg) for arg in args],
        env=variables,
        interactive_mode=str(mode),
        install_hint=spec.get("installHint") or None,
        cluster=info,
    )


def _named(doc: dict[str, Any], kind: str, name: object, where: str, key: str) -> dict[str, Any]:
    entry = doc[kind].get(name) if isinstance(name, str) else None
    if entry is None:
        raise errors.ConfigError(f"kubeconfig {where}: no {key} named {name!r}")
    result: dict[str, Any] = entry
    return result


def _load_client_cert(tls: ssl.SSLContext, user: dict[str, Any], where: str) -> None:
    try:
        cert, key = user.get("client-certificate"), user.get("client-key")
        if cert and key:
            tls.load_cert_chain(cert, key)
            return
        cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
        if cert_data and key_data:
            decoded = base64.b64decode(cert_data), base64.b64decode(key_data)
            _load_pem_pair(tls, *decoded, f"kubeconfig {where}")
    except errors.ConfigError:
        raise
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise errors.ConfigError(f"kubeconfig {where}: bad client certificate: {exc}") from exc


def _load_pem_pair(tls: ssl.SSLContext, cert: bytes, key: bytes, what: str) -> None:
    # ssl loads certificates from files only: write them privately, load, remove.
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            for target, data in ((cert_path, cert), (key_path, key)):
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
            try:
                tls.load_cert_chain(str(cert_path), str(key_path))
            finally:
                with contextlib.suppress(OSError):
                    key_path.unlink()
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise errors.ConfigError(f"{what}: bad client certificate: {exc}") from exc
