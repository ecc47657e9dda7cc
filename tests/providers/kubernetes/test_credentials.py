"""Kubeconfigs as kubectl reads them, without a cluster: several files merged, contexts,
relative paths, exec credential plugins (v1 and v1beta1, expiry-driven caching, failures,
interactive mode), one refresh and retry on a 401, and proxy-url."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from sandman import errors
from sandman.providers.kubernetes import credentials as credentials_module
from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.credentials import (
    Credentials,
    ExecPlugin,
    load_credentials,
    read_kubeconfigs,
)
from sandman.settings import KubernetesConfig
from tests.providers.kubernetes.conftest import loopback, plugin_script, runs

pytestmark = pytest.mark.anyio

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"


def kubeconfig(
    path: Path,
    *,
    clusters: dict[str, dict[str, Any]] | None = None,
    users: dict[str, dict[str, Any]] | None = None,
    contexts: dict[str, dict[str, Any]] | None = None,
    current: str | None = None,
) -> Path:
    doc: dict[str, Any] = {"apiVersion": "v1", "kind": "Config"}
    for kind, key, entries in (
        ("clusters", "cluster", clusters), ("users", "user", users),
        ("contexts", "context", contexts),
    ):  # fmt: skip
        if entries is not None:
            doc[kind] = [{"name": name, key: body} for name, body in entries.items()]
    if current is not None:
        doc["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def credential(version: str, token: str, expires_in: float | None = None) -> str:
    status: dict[str, Any] = {"token": token}
    if expires_in is not None:
        at = datetime.now(UTC) + timedelta(seconds=expires_in)
        status["expirationTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({"apiVersion": version, "kind": "ExecCredential", "status": status})


def exec_kubeconfig(tmp_path: Path, exec_: dict[str, Any], server: str = "https://k:6443") -> Path:
    return kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": server, "insecure-skip-tls-verify": True}},
        users={"u": {"exec": exec_}},
        contexts={"ctx": {"cluster": "c", "user": "u", "namespace": "ns"}},
        current="ctx",
    )


# -- several files, contexts, relative paths -----------------------------------------------


def test_several_files_merge_as_kubectl_merges_them(tmp_path: Path) -> None:
    first = kubeconfig(
        tmp_path / "a" / "config",
        clusters={"shared": {"server": "https://first:6443"}},
        users={"u1": {"token": "one"}},
        contexts={"c1": {"cluster": "shared", "user": "u1", "namespace": "n1"}},
    )  # no current-context: the next file's counts
    second = kubeconfig(
        tmp_path / "b" / "config",
        clusters={"shared": {"server": "https://second:6443"}, "own": {"server": "https://o"}},
        users={"u1": {"token": "ignored"}, "u2": {"token": "two"}},
        contexts={"c1": {"cluster": "own"}, "c2": {"cluster": "own", "user": "u2"}},
        current="c1",
    )
    third = kubeconfig(tmp_path / "c" / "config", current="c2")
    missing = tmp_path / "nowhere" / "config"
    merged = read_kubeconfigs([first, missing, second, third])
    # The first file to name a cluster, user or context wins, whole.
    assert merged["clusters"]["shared"]["server"] == "https://first:6443"
    assert merged["clusters"]["own"]["server"] == "https://o"
    assert merged["users"]["u1"]["token"] == "one"
    assert merged["contexts"]["c1"] == {"cluster": "shared", "user": "u1", "namespace": "n1"}
    # current-context: the first file that sets one (the second, not the last).
    assert merged["current-context"] == "c1"

    joined = ":".join(map(str, [first, missing, second, third]))  # a KUBECONFIG value
    credentials = load_credentials(KubernetesConfig(kubeconfig=Path(joined)))
    assert (credentials.server, credentials.namespace) == ("https://first:6443", "n1")
    assert credentials.bearer() == "one"
    # The same as a list, and another context than the current one.
    other = load_credentials(KubernetesConfig(kubeconfig=[first, second], context="c2"))
    assert (other.server, other.namespace, other.bearer()) == ("https://o", "default", "two")


def test_contexts_are_chosen_and_missing_things_named(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": "https://c:6443"}},
        users={"u": {"token": "t"}},
        contexts={
            "ctx": {"cluster": "c", "user": "u"},
            "anon": {"cluster": "c"},
            "broken": {"cluster": "c", "user": "nobody"},
        },
    )
    with pytest.raises(errors.ConfigError, match="no current-context"):
        load_credentials(KubernetesConfig(kubeconfig=path))
    assert load_credentials(KubernetesConfig(kubeconfig=path, context="ctx")).bearer() == "t"
    assert load_credentials(KubernetesConfig(kubeconfig=path, context="anon")).bearer() is None
    with pytest.raises(errors.ConfigError, match="no user named 'nobody'"):
        load_credentials(KubernetesConfig(kubeconfig=path, context="broken"))
    with pytest.raises(errors.ConfigError, match="no context named 'other'"):
        load_credentials(KubernetesConfig(kubeconfig=path, context="other"))
    # One file named alone must exist; in a list, a missing one is skipped, not all.
    with pytest.raises(errors.ConfigError, match="cannot read kubeconfig"):
        load_credentials(KubernetesConfig(kubeconfig=tmp_path / "missing"))
    with pytest.raises(errors.ConfigError, match="none of the kubeconfig files exists"):
        load_credentials(KubernetesConfig(kubeconfig=[tmp_path / "x", tmp_path / "y"]))
    (tmp_path / "bad").write_text("[1, 2")
    with pytest.raises(errors.ConfigError, match="cannot read kubeconfig"):
        load_credentials(KubernetesConfig(kubeconfig=tmp_path / "bad"))


def test_relative_paths_are_resolved_against_the_file_naming_them(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    ca_dir, user_dir = tmp_path / "cluster", tmp_path / "user"
    ca_dir.mkdir()
    (user_dir / "pki").mkdir(parents=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=test", "-keyout", str(user_dir / "pki" / "key.pem"),
         "-out", str(user_dir / "pki" / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.copy(user_dir / "pki" / "cert.pem", ca_dir / "ca.crt")
    (user_dir / "token").write_text("from-file\n")
    clusters = kubeconfig(
        ca_dir / "config",
        clusters={"c": {"server": "https://c:6443", "certificate-authority": "ca.crt"}},
        contexts={"ctx": {"cluster": "c", "user": "u"}},
        current="ctx",
    )
    users = kubeconfig(
        user_dir / "config",
        users={"u": {"client-certificate": "pki/cert.pem", "client-key": "pki/key.pem",
                     "tokenFile": "token", "exec": {"apiVersion": V1, "command": "./bin/p"}}},
    )  # fmt: skip
    merged = read_kubeconfigs([clusters, users])
    assert merged["clusters"]["c"]["certificate-authority"] == str(ca_dir / "ca.crt")
    user = merged["users"]["u"]
    assert user["client-certificate"] == str(user_dir / "pki" / "cert.pem")
    assert user["tokenFile"] == str(user_dir / "token")
    assert user["exec"]["command"] == str(user_dir / "bin" / "p")
    # And they load: the CA and the client certificate from their own directories.
    kubeconfig(
        users,
        users={"u": {"client-certificate": "pki/cert.pem", "client-key": "pki/key.pem",
                     "tokenFile": "token"}},
    )  # fmt: skip
    credentials = load_credentials(KubernetesConfig(kubeconfig=[clusters, users]))
    assert credentials.bearer() == "from-file"
    assert credentials.ssl_context.get_ca_certs()[0]["subject"] == ((("commonName", "test"),),)


def test_without_settings_the_default_kubeconfig_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(credentials_module, "SERVICE_ACCOUNT", tmp_path / "not-in-a-pod")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(errors.ConfigError, match="no Kubernetes credentials"):
        load_credentials(KubernetesConfig())
    kubeconfig(
        tmp_path / ".kube" / "config",
        clusters={"c": {"server": "https://home:6443"}},
        contexts={"x": {"cluster": "c"}},
        current="x",
    )
    assert load_credentials(KubernetesConfig()).server == "https://home:6443"


def test_proxy_and_tls_server_name_are_read_and_socks_refused(tmp_path: Path) -> None:
    cluster = {"server": "https://c:6443", "proxy-url": "http://proxy:3128",
               "tls-server-name": "kubernetes.default", "insecure-skip-tls-verify": True}  # fmt: skip
    path = kubeconfig(
        tmp_path / "config", clusters={"c": cluster}, contexts={"x": {"cluster": "c"}}, current="x"
    )
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    assert (credentials.proxy, credentials.tls_server_name) == (
        "http://proxy:3128", "kubernetes.default",
    )  # fmt: skip
    cluster["proxy-url"] = "socks5://proxy:1080"
    kubeconfig(path, clusters={"c": cluster}, contexts={"x": {"cluster": "c"}}, current="x")
    with pytest.raises(errors.ConfigError, match="only http:// and https:// proxies"):
        load_credentials(KubernetesConfig(kubeconfig=path))


def test_auth_providers_are_refused_clearly(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path / "config",
        clusters={"c": {"server": "https://c"}},
        users={"u": {"auth-provider": {"name": "oidc", "config": {}}}},
        contexts={"x": {"cluster": "c", "user": "u"}},
        current="x",
    )
    with pytest.raises(errors.ConfigError, match="auth-provider .* use an exec plugin"):
        load_credentials(KubernetesConfig(kubeconfig=path))


# -- exec plugins ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [V1, V1BETA1])
async def test_an_exec_plugin_gets_its_input_and_its_token_is_cached(
    tmp_path: Path, version: str
) -> None:
    script = plugin_script(
        tmp_path / "plugin",
        f'echo "$KUBERNETES_EXEC_INFO" > "{tmp_path}/info"\n'
        f'echo "$1 $2 $FROM_ENV" > "{tmp_path}/argv"\n'
        f"echo '{credential(version, 'tok', expires_in=3600)}'",
    )
    path = exec_kubeconfig(
        tmp_path,
        {"apiVersion": version, "command": str(script), "args": ["--a", "b"],
         "env": [{"name": "FROM_ENV", "value": "yes"}], "provideClusterInfo": True,
         "interactiveMode": "Never"},
    )  # fmt: skip
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    tokens = await asyncio.gather(*(credentials.authorization() for _ in range(20)))
    assert set(tokens) == {"tok"}
    assert await credentials.authorization() == "tok"
    assert runs(script) == 1  # one run for a burst and what follows, while fresh
    assert credentials.exec_plugin is not None and credentials.exec_plugin.runs == 1
    info = json.loads((tmp_path / "info").read_text())
    assert info["apiVersion"] == version and info["kind"] == "ExecCredential"
    assert info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == "https://k:6443"
    assert info["spec"]["cluster"]["insecure-skip-tls-verify"] is True
    assert (tmp_path / "argv").read_text().split() == ["--a", "b", "yes"]


async def test_an_exec_token_is_renewed_shortly_before_it_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = plugin_script(tmp_path / "plugin", f"echo '{credential(V1, 'tok', expires_in=100)}'")
    path = exec_kubeconfig(tmp_path, {"apiVersion": V1, "command": str(script)})
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    assert await credentials.authorization() == "tok"
    real = credentials_module._clock
    offset = 0.0
    monkeypatch.setattr(credentials_module, "_clock", lambda: real() + offset)
    # 100 s of life: renewed a fifth of it (20 s) early, so at 70 s still cached...
    offset = 70.0
    await credentials.authorization()
    assert runs(script) == 1
    # ...and at 85 s run again (the timestamp has whole seconds: 99 to 100 s of life).
    offset = 85.0
    await credentials.authorization()
    assert runs(script) == 2


async def test_an_exec_token_without_expiry_lasts_until_refused(tmp_path: Path) -> None:
    script = plugin_script(tmp_path / "plugin", f"echo '{credential(V1BETA1, 'tok')}'")
    path = exec_kubeconfig(tmp_path, {"apiVersion": V1BETA1, "command": str(script)})
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    for _ in range(3):
        assert await credentials.authorization() == "tok"
    assert runs(script) == 1
    assert await credentials.refresh("tok")  # a 401
    assert runs(script) == 2
    await credentials.refresh("an older token")  # refused, but renewed since: no new run
    assert runs(script) == 2


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("echo 'token endpoint said no' >&2; exit 3",
         r"exec plugin '.*plugin' failed \(exit 3\): token endpoint said no"),
        ("echo not json", "wrote no JSON ExecCredential"),
        (f"echo '{credential(V1BETA1, 'tok')}'", "answered with apiVersion .*v1beta1"),
        ("echo '{\"apiVersion\": \"" + V1 + "\", \"kind\": \"ExecCredential\", \"status\": {}}'",
         "answered with neither status.token nor status.clientCertificateData"),
    ],
)  # fmt: skip
async def test_a_failing_exec_plugin_is_a_clear_config_error(
    tmp_path: Path, body: str, match: str
) -> None:
    script = plugin_script(tmp_path / "plugin", body)
    path = exec_kubeconfig(tmp_path, {"apiVersion": V1, "command": str(script)})
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    with pytest.raises(errors.ConfigError, match=match) as caught:
        await credentials.authorization()
    assert "kubeconfig user 'u'" in str(caught.value)


async def test_a_missing_plugin_names_its_install_hint(tmp_path: Path) -> None:
    path = exec_kubeconfig(
        tmp_path,
        {"apiVersion": V1, "command": "sandman-no-such-plugin",
         "installHint": "install it with: apt install sandman-no-such-plugin"},
    )  # fmt: skip
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    with pytest.raises(errors.ConfigError, match="not found: install it with: apt install"):
        await credentials.authorization()


async def test_a_stuck_plugin_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(credentials_module, "_PLUGIN_TIMEOUT", 2.0)
    script = plugin_script(tmp_path / "plugin", f'sleep 300 & echo $! > "{tmp_path}/child"; wait')
    path = exec_kubeconfig(tmp_path, {"apiVersion": V1, "command": str(script)})
    credentials = load_credentials(KubernetesConfig(kubeconfig=path))
    with pytest.raises(errors.ConfigError, match=r"did not answer within 2 s"):
        await credentials.authorization()
    child = int((tmp_path / "child").read_text())
    deadline = asyncio.get_running_loop().time() + 10
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert asyncio.get_running_loop().time() < deadline, "the plugin's child lives on"
        await asyncio.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_interactive_mode_always_without_a_terminal_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", None)
    path = exec_kubeconfig(
        tmp_path, {"apiVersion": V1, "command": "kubelogin", "interactiveMode": "Always"}
    )
    with pytest.raises(errors.ConfigError, match="interactiveMode: Always but standard input"):
        load_credentials(KubernetesConfig(kubeconfig=path))
    bad = exec_kubeconfig(tmp_path, {"apiVersion": "client.authentication.k8s.io/v1alpha1",
                                     "command": "p"})  # fmt: skip
    with pytest.raises(errors.ConfigError, match="apiVersion .*v1alpha1.* is not supported"):
        load_credentials(KubernetesConfig(kubeconfig=bad))


# -- on the wire: 401 and proxy ---------------------------------------------------------------


def _pod_list(accepted: Callable[[str], bool], seen: list[str]) -> Any:
    async def handle(request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        seen.append(token)
        if not accepted(token):
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "PodList", "items": [], "metadata": {}})

    return handle


async def test_a_401_runs_the_plugin_once_and_retries_once(tmp_path: Path) -> None:
    # Each run hands out the next token; the server takes only the second one.
    script = plugin_script(
        tmp_path / "plugin",
        f'n=$(wc -l < "{tmp_path}/plugin.runs")\n'
        f'echo "{{\\"apiVersion\\": \\"{V1}\\", \\"kind\\": \\"ExecCredential\\", '
        f'\\"status\\": {{\\"token\\": \\"t$n\\"}}}}"',
    )
    seen: list[str] = []
    async with loopback(
        {"/api/v1/namespaces/ns/pods": _pod_list(lambda t: t == "t2", seen)}
    ) as url:
        path = exec_kubeconfig(tmp_path, {"apiVersion": V1, "command": str(script)}, server=url)
        api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)), timeout=5)
        try:
            assert await api.list_pods("a=b") == ([], "")
            assert seen == ["t1", "t2"] and runs(script) == 2
            assert await api.list_pods("a=b") == ([], "")  # the new token is cached
            assert seen == ["t1", "t2", "t2"] and runs(script) == 2
        finally:
            await api.aclose()
    # A server that refuses every token: one refresh, one retry, then the error.
    seen.clear()
    (tmp_path / "plugin.runs").unlink()
    async with loopback({"/api/v1/namespaces/ns/pods": _pod_list(lambda t: False, seen)}) as url:
        path = exec_kubeconfig(tmp_path, {"apiVersion": V1, "command": str(script)}, server=url)
        api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)), timeout=5)
        try:
            with pytest.raises(errors.ConfigError, match="401 Unauthorized .* our credentials"):
                await api.list_pods("a=b")
            assert seen == ["t1", "t2"] and runs(script) == 2
        finally:
            await api.aclose()


async def test_a_401_rereads_a_rotated_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("old")
    seen: list[str] = []
    async with loopback(
        {"/api/v1/namespaces/ns/pods": _pod_list(lambda t: t == "new", seen)}
    ) as url:
        credentials = Credentials(
            server=url, namespace="ns", ssl_context=ssl.create_default_context(),
            token_file=token_file,
        )  # fmt: skip
        api = KubeAPI(credentials, timeout=5)
        try:
            with pytest.raises(errors.ConfigError, match="401"):
                await api.list_pods("a=b")  # still the old token: no retry worth making
            assert seen == ["old"]
            token_file.write_text("new\n")  # rotated within the minute the file is cached
            assert await api.list_pods("a=b") == ([], "")
            assert seen == ["old", "old", "new"]
        finally:
            await api.aclose()


async def test_requests_go_through_the_proxy_url(tmp_path: Path) -> None:
    # The "proxy" is the fake API server itself: an HTTP proxy gets the absolute URL,
    # so the request reaches it only if it went through the proxy.
    seen: list[str] = []
    async with loopback({"/api/v1/namespaces/ns/pods": _pod_list(lambda t: True, seen)}) as url:
        path = kubeconfig(
            tmp_path / "config",
            clusters={"c": {"server": "http://api.invalid:6443", "proxy-url": url}},
            users={"u": {"token": "t"}},
            contexts={"x": {"cluster": "c", "user": "u", "namespace": "ns"}},
            current="x",
        )
        api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)), timeout=5)
        try:
            assert await api.list_pods("a=b") == ([], "")
            assert seen == ["t"]
        finally:
            await api.aclose()


def test_reprs_hide_tokens() -> None:
    plugin = ExecPlugin(
        command="p",
        user="u",
        api_version=V1,
        env={"AWS_SECRET_ACCESS_KEY": "secret-1"},
        token="secret-2",
    )
    credentials = Credentials(
        server="https://k", namespace="ns", ssl_context=ssl.create_default_context(),
        token="secret-3", exec_plugin=plugin,
    )  # fmt: skip
    assert "secret" not in repr(credentials)


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _issue(directory: Path, name: str, san: str | None = None) -> tuple[Path, Path]:
    """A P-256 key and certificate for CN ``name``, signed by ``directory``'s ca."""
    key, csr, crt = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", key, "-out", csr)  # fmt: skip
    extensions = directory / f"{name}.ext"
    extensions.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", csr, "-CA", directory / "ca.crt", "-CAkey",
             directory / "ca.key", "-CAcreateserial", "-days", "1", "-out", crt,
             "-extfile", extensions)  # fmt: skip
    return crt, key


async def test_an_exec_plugins_client_certificate_is_used_and_renewed_on_new_connections(
    tmp_path: Path,
) -> None:
    # Teleport's tsh answers with a client certificate. The server refuses the first one
    # (CN=old): the plugin runs again, and the retry presents the new one, which takes a
    # new connection (a TLS connection presents its certificate once, at the handshake).
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make certificates")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout", tmp_path / "ca.key",
             "-out", tmp_path / "ca.crt")  # fmt: skip
    server_crt, server_key = _issue(tmp_path, "server", san="IP:127.0.0.1")
    for name in ("old", "new"):
        _issue(tmp_path, name)
    script = tmp_path / "plugin"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, pathlib, sys\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "runs = d / 'plugin.runs'\n"
        "n = len(runs.read_text().splitlines()) if runs.exists() else 0\n"
        "runs.write_text('run\\n' * (n + 1))\n"
        "name = 'old' if n == 0 else 'new'\n"
        f"print(json.dumps({{'apiVersion': {V1!r}, 'kind': 'ExecCredential', 'status': {{\n"
        "    'clientCertificateData': (d / f'{name}.crt').read_text(),\n"
        "    'clientKeyData': (d / f'{name}.key').read_text()}}))\n"
    )
    script.chmod(0o755)
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(item[0] for item in (peer or {}).get("subject", ()))
        seen.append(subject.get("commonName", "?"))
        if subject.get("commonName") != "new":
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "PodList", "items": [], "metadata": {}})

    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tmp_path / "ca.crt"))
    tls.load_cert_chain(server_crt, server_key)
    tls.verify_mode = ssl.CERT_REQUIRED
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
        path = kubeconfig(
            tmp_path / "config",
            clusters={"c": {"server": f"https://127.0.0.1:{runner.addresses[0][1]}",
                            "certificate-authority": "ca.crt"}},
            users={"u": {"exec": {"apiVersion": V1, "command": "./plugin"}}},
            contexts={"x": {"cluster": "c", "user": "u", "namespace": "ns"}},
            current="x",
        )  # fmt: skip
        api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)), timeout=5)
        try:
            assert await api.list_pods("a=b") == ([], "")
            assert seen == ["old", "new"]
            assert runs(script) == 2
            assert await api.list_pods("a=b") == ([], "")  # cached, on the new connection
            assert seen == ["old", "new", "new"] and runs(script) == 2
        finally:
            await api.aclose()
    finally:
        await runner.cleanup()
