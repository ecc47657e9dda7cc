"""Where the API server is and who we are to it: a kubeconfig, explicit files, or in-cluster.

Only what Sandman needs of a kubeconfig is read: the server, its CA (file or
data, or ``insecure-skip-tls-verify``), a bearer token (inline or file) or a
client certificate, and the context's namespace. Exec and auth-provider
plugins are refused with a clear error.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandman import errors
from sandman.settings import KubernetesConfig

__all__ = ["Credentials", "load_credentials"]

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_TOKEN_TTL = 60.0  # bound service-account tokens rotate; re-read the file this often


@dataclass
class Credentials:
    """How to talk to one API server: its URL, TLS settings and bearer token."""

    server: str
    namespace: str
    ssl_context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    _read_at: float = field(default=0.0, repr=False)

    def bearer(self) -> str | None:
        """The current token; a token file is re-read at most once a minute."""
        if self.token_file is not None and time.monotonic() - self._read_at > _TOKEN_TTL:
            try:
                self.token = self.token_file.read_text().strip()
            except OSError as exc:
                raise errors.ConfigError(
                    f"cannot read token file {self.token_file}: {exc}"
                ) from exc
            self._read_at = time.monotonic()
        return self.token


def load_credentials(config: KubernetesConfig) -> Credentials:
    """Credentials from the config: kubeconfig, else server + files, else in-cluster."""
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
    raise errors.ConfigError(
        "no Kubernetes credentials: set kubeconfig, or server (+ token_file, ca_file), "
        "or run in a pod with a service account"
    )


def _from_kubeconfig(config: KubernetesConfig) -> Credentials:
    try:
        import yaml
    except ImportError:
        raise errors.ConfigError(
            "reading a kubeconfig needs PyYAML: pip install 'sandman-rl[kubernetes]'"
        ) from None
    assert config.kubeconfig is not None
    path = config.kubeconfig.expanduser()
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise errors.ConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise errors.ConfigError(f"kubeconfig {path} is not a mapping")
    name = config.context or doc.get("current-context")
    context = _named(doc, "contexts", name, path, "context")
    cluster = _named(doc, "clusters", context.get("cluster"), path, "cluster")
    user = _named(doc, "users", context.get("user"), path, "user")
    server = cluster.get("server")
    if not server:
        raise errors.ConfigError(f"kubeconfig {path}: cluster has no server")
    base = path.parent
    if cluster.get("insecure-skip-tls-verify"):
        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
    elif data := cluster.get("certificate-authority-data"):
        tls = ssl.create_default_context(cadata=base64.b64decode(data).decode())
    elif ca := cluster.get("certificate-authority"):
        tls = ssl.create_default_context(cafile=str(base / ca))
    else:
        tls = ssl.create_default_context()
    if "exec" in user or "auth-provider" in user:
        raise errors.ConfigError(
            f"kubeconfig {path}: exec and auth-provider credentials are not supported; "
            "use a token or a client certificate"
        )
    _load_client_cert(tls, user, base)
    token_file = base / user["tokenFile"] if user.get("tokenFile") else None
    return Credentials(
        server=str(server).rstrip("/"),
        namespace=config.namespace or context.get("namespace") or "default",
        ssl_context=tls,
        token=user.get("token"),
        token_file=token_file,
    )


def _named(doc: dict[str, Any], kind: str, name: object, path: Path, key: str) -> dict[str, Any]:
    for entry in doc.get(kind) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if isinstance(value, dict):
                return value
    raise errors.ConfigError(f"kubeconfig {path}: no {key} named {name!r}")


def _load_client_cert(tls: ssl.SSLContext, user: dict[str, Any], base: Path) -> None:
    cert, key = user.get("client-certificate"), user.get("client-key")
    if cert and key:
        tls.load_cert_chain(str(base / cert), str(base / key))
        return
    cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
    if not (cert_data and key_data):
        return
    # ssl loads certificates from files only: write them privately, load, remove.
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        for target, data in ((cert_path, cert_data), (key_path, key_data)):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(base64.b64decode(data))
        try:
            tls.load_cert_chain(str(cert_path), str(key_path))
        finally:
            with contextlib.suppress(OSError):
                key_path.unlink()
