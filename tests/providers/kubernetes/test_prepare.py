"""The pull pods of ``sandman prepare`` and how their status settles a pull.

The statuses are what the harness's kubelet (1.36, containerd 1.6) reported
for a pull pod; tests/kube/test_prepare.py runs the whole thing for real.
"""

from __future__ import annotations

from typing import Any

import pytest

from sandman import errors
from sandman.providers.kubernetes.prepare import NEVER_RUNS, check_images, pull_outcome, pull_pod

IMAGE_ID = "127.0.0.1:5123/t/busybox@sha256:" + "42" * 32


def pod(*containers: dict[str, Any], phase: str = "Pending", **status: Any) -> dict[str, Any]:
    return {"status": {"phase": phase, "containerStatuses": list(containers), **status}}


def container(state: dict[str, Any], image_id: str = "") -> dict[str, Any]:
    return {"name": "pull", "image": "127.0.0.1:5123/t/busybox:1", "imageID": image_id,
            "state": state}  # fmt: skip


def test_pull_pod_runs_nothing_and_stays_on_its_node() -> None:
    body = pull_pod("p-0-0", "r.io/task:1", "node-7", "run1", pull_secrets=["regcred"])
    spec = body["spec"]
    assert spec["nodeName"] == "node-7"
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    [main] = spec["containers"]
    assert main["image"] == "r.io/task:1"
    assert main["command"] == [NEVER_RUNS]
    assert "args" not in main
    assert body["metadata"]["labels"]["sandman.io/prepare"] == "run1"
    assert "imagePullSecrets" not in pull_pod("p", "r.io/t:1", "n", "r")["spec"]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        # The image is there and the missing command failed the start: pulled.
        (pod(container({"terminated": {"exitCode": 128, "reason": "StartError"}}, IMAGE_ID),
             phase="Failed"), (True, f"pulled {IMAGE_ID}")),
        (pod(container({"running": {}}, IMAGE_ID), phase="Running"), (True, f"pulled {IMAGE_ID}")),
        # The kubelet builds the container's config only after the pull (here: the
        # image's user is not in its passwd).
        (pod(container({"waiting": {"reason": "CreateContainerConfigError", "message": "no user"}})),
         (True, "pulled 127.0.0.1:5123/t/busybox:1")),
        (pod(container({"waiting": {"reason": "ErrImageSomethingNew", "message": "m"}})),
         (False, "ErrImageSomethingNew: m")),
        (pod(container({"waiting": {"reason": "ErrImagePull", "message": "not found"}})),
         (False, "ErrImagePull: not found")),
        (pod(container({"waiting": {"reason": "ImagePullBackOff"}})), (False, "ImagePullBackOff")),
        (pod(container({"waiting": {"reason": "InvalidImageName", "message": "bad"}})),
         (False, "InvalidImageName: bad")),
        (pod(phase="Failed", reason="OutOfmemory", message="Node didn't have enough memory"),
         (False, "OutOfmemory: Node didn't have enough memory")),
        # Still open: no status yet, creating, pulling.
        ({"status": {}}, None),
        ({}, None),
        (pod(container({"waiting": {"reason": "ContainerCreating"}})), None),
        (pod(phase="Pending"), None),
    ],
)  # fmt: skip
def test_pull_outcome(status: dict[str, Any], expected: tuple[bool, str] | None) -> None:
    assert pull_outcome(status) == expected


def test_check_images_names_the_bad_one() -> None:
    check_images(["busybox", "r.io:5000/a/b:1"])
    with pytest.raises(errors.ConfigError, match="'not an image'"):
        check_images(["busybox", "not an image"])
