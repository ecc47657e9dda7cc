"""Sandbox pods under Pod Security admission on the hack/kube cluster (issue 12).

The test namespace is labelled ``pod-security.kubernetes.io/enforce`` for the test
(the API server's PodSecurity admission is on by default) and unlabelled after. The
daemon must work inside the securityContext the provider gives its pods: seccomp
RuntimeDefault, no privilege escalation, the local capability set (baseline), or
none and a non-root user (restricted).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from sandman import errors
from sandman.client import AsyncClient, InProcessBackend
from sandman.pool import Pool, PoolConfig
from sandman.providers.kubernetes import KubernetesProvider, pods
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

ENFORCE = "pod-security.kubernetes.io/enforce"


@contextlib.asynccontextmanager
async def enforced(admin: Admin, level: str) -> AsyncIterator[None]:
    """The test namespace enforces Pod Security ``level`` until the block ends."""
    path = f"/api/v1/namespaces/{admin.cluster.namespace}"
    headers = {"Content-Type": "application/merge-patch+json"}

    async def label(value: str | None) -> None:
        patch = {"metadata": {"labels": {ENFORCE: value}}}
        response = await admin.http.patch(path, json=patch, headers=headers)
        response.raise_for_status()

    await label(level)
    try:
        yield
    finally:
        await label(None)


def _caps(status: str, field: str) -> int:
    line = next(x for x in status.splitlines() if x.startswith(field + ":"))
    return int(line.split()[1], 16)


# The capability numbers of pods.CAPABILITIES (linux/capability.h).
_NUMBERS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
            "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "SYS_CHROOT": 18,
            "AUDIT_WRITE": 29, "SETFCAP": 31}  # fmt: skip


@pytest.mark.timeout(SETUP_TIMEOUT + 240)
async def test_a_root_image_runs_under_baseline_enforcement(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster))
    pool = Pool(provider, PoolConfig(name=pool_name))
    try:
        async with enforced(admin, "baseline"), AsyncClient(InProcessBackend(pool)) as client:
            # The enforcement is real: a pod that asks for NET_RAW is refused by admission.
            denied = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{pool_name}-raw", "labels": {POOL: pool_name}},
                "spec": {"containers": [{
                    "name": "c", "image": "sandman.local/busybox:1.35",
                    "securityContext": {"capabilities": {"add": ["NET_RAW"]}},
                }]},
            }  # fmt: skip
            response = await admin.http.post(admin.pods, json=denied)
            assert response.status_code == 403, response.text
            assert "violates PodSecurity" in response.text

            async with client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb:
                pod = await admin.pod(sb.id)
                assert pod is not None
                assert pod["spec"]["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
                status = (await sb.exec("cat /proc/1/status")).stdout
                # The daemon (PID 1) runs as root with exactly the documented capabilities,
                # no_new_privs and a seccomp filter.
                expected = sum(1 << _NUMBERS[c] for c in pods.CAPABILITIES)
                assert _caps(status, "CapBnd") == expected
                assert _caps(status, "CapEff") == expected
                assert "NoNewPrivs:\t1" in status
                assert "Seccomp:\t2" in status
                # What a root task image does: files given to another owner.
                result = await sb.exec(
                    "touch /tmp/f && chown 1000:1000 /tmp/f && stat -c %u /tmp/f"
                )
                assert result.exit_code == 0, result
                assert result.stdout == "1000\n"
                # No raw sockets (NET_RAW dropped).
                ping = await sb.exec("ping -c 1 -W 1 127.0.0.1")
                assert ping.exit_code != 0
                await sb.write_file("/tmp/x", b"ok")
                assert await sb.read_file("/tmp/x") == b"ok"
    finally:
        await provider.aclose()


@pytest.mark.timeout(SETUP_TIMEOUT + 240)
async def test_restricted_runs_a_non_root_sandbox_and_baseline_pods_are_refused_there(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    baseline = KubernetesProvider(config_for(kube_cluster))
    restricted = KubernetesProvider(config_for(kube_cluster, pod_security="restricted"))
    pool = Pool(restricted, PoolConfig(name=pool_name))
    try:
        async with enforced(admin, "restricted"):
            # The default (baseline) context is not enough here: refused, saying why.
            with pytest.raises(errors.ConfigError, match="violates PodSecurity"):
                await baseline.create(real_node_spec(kube_cluster), labels={POOL: pool_name})
            async with AsyncClient(InProcessBackend(pool)) as client:
                spec = real_node_spec(kube_cluster, user="65534:65534")
                async with client.sandbox(spec, timeout=120) as sb:
                    status = (await sb.exec("cat /proc/1/status")).stdout
                    assert _caps(status, "CapEff") == 0 and _caps(status, "CapBnd") == 0
                    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status
                    assert (await sb.exec("id -u")).stdout.strip() == "65534"
                    result = await sb.exec("echo hi > /tmp/mine && cat /tmp/mine")
                    assert result.stdout == "hi\n", result
    finally:
        await baseline.aclose()
        await restricted.aclose()
