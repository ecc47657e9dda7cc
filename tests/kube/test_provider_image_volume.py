"""The daemon delivered by an image volume (``daemon_delivery="image-volume"``) on the
hack/kube cluster, as the ordinary identity ``sandman``.

The API server (1.36, ImageVolume GA) accepts such pods, and KWOK nodes make them
Ready, since they run nothing. The real node's containerd 2 mounts the daemon image
read-only at /.sandman: a sandbox there is created, runs commands and is deleted
like one with the init container. Where the real node runs a containerd that cannot
mount image volumes (``SANDMAN_KUBE_CONTAINERD=debian``: 1.6), the sandbox fails at
once with a ConfigError that says to use the init container, and no pod is left
(``tests/kube/test_provider_pods.py`` checks the same on recorded statuses, for
every runtime wording). Either way the kubelet pulls the volume's image before it
creates the container, so a daemon image that is missing is named as such.
Every test's pods are swept as admin at the end, and any left fail it.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

import pytest

import sandman
from sandman import errors
from sandman.models import SandboxSpec
from sandman.pool import PoolConfig
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import BUSYBOX, KWOK, POOL, Admin, config_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 120)]

# The kubelet reports a failure to create the container within seconds of the pod's
# binding, or at its next sync of the pod (~15 s); the start deadline is far beyond.
START_TIMEOUT = 300.0
FAILURE_WITHIN = 45.0


@pytest.fixture
async def provider(kube_cluster: KubeCluster) -> AsyncIterator[KubernetesProvider]:
    provider = KubernetesProvider(
        config_for(kube_cluster, daemon_delivery="image-volume", start_timeout=START_TIMEOUT)
    )
    try:
        yield provider
    finally:
        await provider.aclose()


async def runtime_mounts_image_volumes(admin: Admin, node: str) -> bool:
    """Whether the node's runtime is one that mounts image volumes (containerd >= 2.1)."""
    response = await admin.http.get(f"/api/v1/nodes/{node}")
    response.raise_for_status()
    runtime: str = response.json()["status"]["nodeInfo"]["containerRuntimeVersion"]
    match = re.fullmatch(r"containerd://v?(\d+)\.(\d+)\..*", runtime)
    assert match, f"the harness's real node runs containerd, not {runtime}"
    return (int(match[1]), int(match[2])) >= (2, 1)


async def test_kwok_nodes_take_an_image_volume_pod_ready_and_delete_it(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    config = config_for(
        kube_cluster, daemon_delivery="image-volume", readiness="pod", annotations=KWOK_NO_DELAY
    )
    provider = KubernetesProvider(config)
    try:
        info = await provider.create(
            SandboxSpec(image=BUSYBOX, kubernetes=KWOK), labels={POOL: pool_name}
        )
        assert info.state == "running"
        assert [i.id for i in await provider.list(labels={POOL: pool_name})] == [info.id]

        # What the API server stored: the daemon image as a volume, no init container.
        pod = await admin.pod(info.id)
        assert pod is not None
        spec = pod["spec"]
        assert "initContainers" not in spec
        assert spec["volumes"] == [{
            "name": "sandman",
            "image": {"reference": config.daemon_image, "pullPolicy": config.image_pull_policy},
        }]  # fmt: skip
        (main,) = spec["containers"]
        assert main["image"] == BUSYBOX
        assert main["command"] == ["/.sandman/sandmand"]
        assert main["volumeMounts"] == [
            {"name": "sandman", "mountPath": "/.sandman", "readOnly": True}
        ]
        assert any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"]
        )

        await provider.delete(info.id)
        await provider.delete(info.id)  # idempotent

        async def gone() -> bool:
            return await admin.pod(info.id) is None

        await wait_for("the deleted sandbox's pod to go", 30, gone)
        assert await provider.list(labels={POOL: pool_name}) == []
    finally:
        await provider.aclose()


async def test_a_sandbox_whose_daemon_is_an_image_volume_runs_on_the_real_node(
    kube_cluster: KubeCluster, real_node: str, admin: Admin, pool_name: str
) -> None:
    if not await runtime_mounts_image_volumes(admin, real_node):
        pytest.skip(f"{real_node}'s containerd cannot mount image volumes")
    config = config_for(kube_cluster, daemon_delivery="image-volume")
    async with sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client:
        async with client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb:
            pod = await admin.pod(sb.id)
            assert pod is not None
            assert pod["spec"]["nodeName"] == real_node
            assert "initContainers" not in pod["spec"]
            assert pod["spec"]["volumes"] == [{
                "name": "sandman",
                "image": {"reference": config.daemon_image, "pullPolicy": config.image_pull_policy},
            }]  # fmt: skip

            # The daemon runs from the volume, as PID 1, in the task image's file system.
            result = await sb.exec(
                "cat /proc/1/cmdline | tr '\\0' ' '; echo; busybox | head -n 1; ls /.sandman"
            )
            assert result.exit_code == 0, result
            assert result.stdout.startswith("/.sandman/sandmand"), result.stdout
            assert "BusyBox" in result.stdout
            assert "sandmand" in result.stdout.split()
            # The volume is the daemon image itself, read-only: nothing copied, nothing
            # the sandbox can replace.
            refused = await sb.exec("echo x > /.sandman/sandmand")
            assert refused.exit_code != 0
            assert "read-only" in refused.stderr.lower(), refused

            await sb.write_file("/tmp/note.txt", b"kept between calls")
            assert await sb.read_file("/tmp/note.txt") == b"kept between calls"
            sandbox_id = sb.id

        async def gone() -> bool:
            return await admin.pod(sandbox_id) is None

        await wait_for("the released sandbox's pod to go", 60, gone)
    assert await admin.names(pool_name) == []


async def test_a_runtime_that_cannot_mount_image_volumes_is_a_config_error_at_once(
    kube_cluster: KubeCluster, provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    node = kube_cluster.real_node
    if await runtime_mounts_image_volumes(admin, node):
        pytest.skip(f"{node}'s containerd mounts image volumes")
    started = time.monotonic()
    with pytest.raises(errors.ConfigError) as caught:
        await provider.create(real_node_spec(kube_cluster), labels={POOL: pool_name})
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert f"the container runtime of node {node} cannot mount image volumes" in message
    assert "daemon_delivery='init-container'" in message
    assert not caught.value.retryable
    # From the pod's status, long before the start deadline.
    assert elapsed < FAILURE_WITHIN, elapsed
    # The provider removed the pod it made (grace 0: the object is gone at once).
    assert await admin.names(pool_name) == []


async def test_a_missing_daemon_image_in_the_volume_is_named_as_such(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    provider = KubernetesProvider(
        config_for(
            kube_cluster, daemon_delivery="image-volume", daemon_image="sandman.local/nope:0",
            start_timeout=START_TIMEOUT,
        )
    )  # fmt: skip
    try:
        started = time.monotonic()
        with pytest.raises(
            errors.ImageError, match="daemon image sandman.local/nope:0: "
        ) as caught:
            await provider.create(real_node_spec(kube_cluster), labels={POOL: pool_name})
        assert time.monotonic() - started < FAILURE_WITHIN
        # Not the task image, which the node has.
        assert f"image {BUSYBOX}" not in str(caught.value)
        assert await admin.names(pool_name) == []
    finally:
        await provider.aclose()
