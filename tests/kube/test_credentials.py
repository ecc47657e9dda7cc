"""Exec credential plugins against the hack/kube API server, as EKS, GKE and AKS
kubeconfigs use them: a plugin hands out the ordinary identity's token with an expiry
of a few seconds, and the provider keeps working across several expiries, running the
plugin once per token (not per request); a 401 runs it once more and retries once; a
plugin that fails is a ConfigError naming it and quoting its stderr."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml

import sandman
from sandman import errors
from sandman.pool import PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.credentials import load_credentials
from sandman.settings import KubernetesConfig
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, real_node_spec
from tests.providers.kubernetes.conftest import plugin_script as plugin
from tests.providers.kubernetes.conftest import runs
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

V1 = "client.authentication.k8s.io/v1"
LIFETIME = 3  # seconds of each token the plugin hands out


# Prints an ExecCredential with $TOKEN (or, for the first $BAD_RUNS runs, a wrong one)
# that expires in $1 seconds.
HAND_OUT = """\
n=$(wc -l < "$0.runs")
token=$TOKEN
if [ "$n" -le "${BAD_RUNS:-0}" ]; then token=not-a-valid-token; fi
expires=$(date -u -d "+$1 seconds" +%Y-%m-%dT%H:%M:%SZ)
printf '{"apiVersion": "%s", "kind": "ExecCredential", "status": {"token": "%s", \
"expirationTimestamp": "%s"}}\\n' "$VERSION" "$token" "$expires"
"""


def exec_kubeconfig(
    cluster: KubeCluster, directory: Path, script: Path, *, bad_runs: int = 0
) -> Path:
    """A kubeconfig as `aws eks update-kubeconfig` writes one: the user is an exec plugin.
    The plugin lies next to it and is named relative to it."""
    env = [{"name": "TOKEN", "value": cluster.token}, {"name": "VERSION", "value": V1},
           {"name": "BAD_RUNS", "value": str(bad_runs)}]  # fmt: skip
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "harness", "cluster": {
            "server": cluster.server, "certificate-authority": str(cluster.ca)}}],
        "users": [{"name": "plugin", "user": {"exec": {
            "apiVersion": V1, "command": f"./{script.name}", "args": [str(LIFETIME)],
            "env": env, "interactiveMode": "Never", "provideClusterInfo": True}}}],
        "contexts": [{"name": "harness", "context": {
            "cluster": "harness", "user": "plugin", "namespace": cluster.namespace}}],
        "current-context": "harness",
    }  # fmt: skip
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


@pytest.mark.timeout(SETUP_TIMEOUT + 240)
async def test_the_provider_keeps_working_across_token_expiries(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, tmp_path: Path
) -> None:
    script = plugin(tmp_path / "token-plugin", HAND_OUT)
    config = KubernetesConfig(kubeconfig=exec_kubeconfig(kube_cluster, tmp_path, script))
    async with sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client:
        started = time.monotonic()
        async with client.sandbox(real_node_spec(kube_cluster), timeout=180) as sb:
            pod = await admin.pod(sb.id)
            assert pod is not None and pod["metadata"]["labels"][POOL] == pool_name
            assert (await sb.exec("echo first")).stdout == "first\n"
            provider = KubernetesProvider(config)
            try:
                # Several expiries later, the API server still takes every request (the
                # lease renewals, the watch and these lists among them)...
                first = runs(script)

                async def renewed_thrice() -> bool:
                    await provider.list()
                    return runs(script) >= first + 3

                await wait_for("three more plugin runs", 12 * LIFETIME, renewed_thrice)
                # ...and a burst of requests shares one token: one run among them at
                # most, unless the burst outlives a token (a run at most once a second).
                before, burst = runs(script), time.monotonic()
                await asyncio.gather(*(provider.api.list_pods(f"{POOL}={pool_name}")
                                       for _ in range(30)))  # fmt: skip
                assert runs(script) - before <= 1 + (time.monotonic() - burst)
            finally:
                await provider.aclose()
            assert (await sb.exec("echo again")).stdout == "again\n"
            sandbox_id = sb.id

        # Deleted with a token handed out well after the one it was created with.
        async def gone() -> bool:
            return await admin.pod(sandbox_id) is None

        await wait_for(f"pod {sandbox_id} deleted", 60, gone)
    elapsed = time.monotonic() - started
    # Refreshed as tokens expired, not per request: two providers, each with its own
    # cache holding a token at least a second (it lives 2 to 3 s, renewed a fifth early).
    assert runs(script) >= 3
    assert runs(script) <= 2 * (elapsed + 1), (runs(script), elapsed)


async def test_a_401_runs_the_plugin_once_more_and_retries_once(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    # The first token the plugin hands out is refused: one more run, one retry.
    script = plugin(tmp_path / "token-plugin", HAND_OUT)
    path = exec_kubeconfig(kube_cluster, tmp_path, script, bad_runs=1)
    api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)))
    try:
        pods, _ = await api.list_pods("sandman.io/pool=nobody-has-this")
        assert pods == [] and runs(script) == 2
    finally:
        await api.aclose()
    # Every token refused: still only one refresh and one retry, then a ConfigError.
    Path(f"{script}.runs").unlink()
    path = exec_kubeconfig(kube_cluster, tmp_path, script, bad_runs=100)
    api = KubeAPI(load_credentials(KubernetesConfig(kubeconfig=path)))
    try:
        with pytest.raises(errors.ConfigError, match="401 Unauthorized"):
            await api.list_pods("sandman.io/pool=nobody-has-this")
        assert runs(script) == 2
    finally:
        await api.aclose()


async def test_a_failing_plugin_is_a_config_error_naming_it(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    script = plugin(
        tmp_path / "token-plugin",
        "echo 'error: the SSO session has expired; run aws sso login' >&2; exit 255",
    )
    provider = KubernetesProvider(
        KubernetesConfig(kubeconfig=exec_kubeconfig(kube_cluster, tmp_path, script))
    )
    try:
        with pytest.raises(errors.ConfigError) as caught:
            await provider.list()
    finally:
        await provider.aclose()
    message = str(caught.value)
    assert f"exec plugin '{script}' failed (exit 255)" in message
    assert "the SSO session has expired; run aws sso login" in message
