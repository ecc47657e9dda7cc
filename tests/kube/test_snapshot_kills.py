"""A pool's process SIGKILLed in the middle of a snapshot, a fork, a restore and a save
as an image, on the harness's real node (`tests.kube.snapshot_kills`): ``sandman gc
--kubernetes``, or the next pool of its name, leaves no pod, Lease, snapshot, scratch
directory or process of it (issue 26, faults)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.images import builders
from tests.images.registry_server import Registry, missing_tools, push, start_registry
from tests.kube import node_images
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.snapshot_kills import KillPlan, run_kill
from tests.kube.support import BUSYBOX, Admin

pytestmark = [
    pytest.mark.kube, pytest.mark.chaos, pytest.mark.anyio,
    pytest.mark.timeout(SETUP_TIMEOUT + 600),
]  # fmt: skip


@pytest.fixture(scope="module")
def registry_image(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Registry, str]]:
    """A registry on 127.0.0.1 and busybox in it (an image is made only of one that is)."""
    missing = missing_tools()
    if missing:
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("kill-registry")
    registry = start_registry(work / "registry")
    try:
        busybox = builders.busybox_rootfs_tar(work / "busybox.tar").read_bytes()
        oci = builders.OciLayout()
        config = builders.image_config([builders.sha256(busybox)], user="", working_dir="/")
        oci.index.append(oci.image([busybox], config=config, annotations={builders.REF_NAME: "1"}))
        reference = push(oci.write_dir(work / "layout"), "1", registry, "sandman-test/kill-base")
        yield registry, reference
    finally:
        registry.stop()
        node_images.remove(kube_cluster, f"{registry.host}/")


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(KillPlan("snapshot", "gc"), id="snapshot-gc"),
        pytest.param(KillPlan("snapshot", "pool"), id="snapshot-pool"),
        # At the create's start (its intent recorded), and at its pod seen: the pod
        # starting, its files not yet applied (a condition, not a delay it may outrun).
        pytest.param(KillPlan("fork", "pool"), id="fork-pool"),
        pytest.param(KillPlan("fork", "gc", pod_started=True), id="fork-gc"),
        pytest.param(KillPlan("restore", "gc", pod_started=True), id="restore-gc"),
        pytest.param(KillPlan("save-image", "gc"), id="save-image-gc"),
    ],
)
async def test_a_pool_killed_mid_step_leaves_nothing(
    plan: KillPlan,
    kube_cluster: KubeCluster,
    admin: Admin,
    daemon_image: str,
    registry_image: tuple[Registry, str],
    tmp_path: Path,
) -> None:
    registry, base = registry_image
    image = base if plan.op == "save-image" else BUSYBOX
    target = f"{registry.host}/sandman-test/kill-saved-{secrets.token_hex(4)}:1"
    outcome = await run_kill(
        plan, kube_cluster, admin, daemon_image=daemon_image, image=image, target=target,
        work=tmp_path,
    )  # fmt: skip
    assert not outcome.failed, outcome.details()
    assert not outcome.missed, outcome.details()  # else nothing was killed mid-step
