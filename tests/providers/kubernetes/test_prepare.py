"""The pull pods of ``sandman prepare``, how their status settles a pull, and the
nodes it pulls onto (against a real HTTP server on loopback, through the provider's
own API client).

The statuses are what the harness's kubelet (1.36, containerd 1.6) reported
for a pull pod; tests/kube/test_prepare.py runs the whole thing for real.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from sandman import errors
from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.prepare import (
    NEVER_RUNS,
    check_images,
    check_pull_secrets,
    list_nodes,
    pull_outcome,
    pull_pod,
)
from tests.providers.kubernetes.conftest import kube_api, loopback

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


def test_check_pull_secrets_names_the_bad_one() -> None:
    check_pull_secrets(["regcred", "team.mirror-1"])
    with pytest.raises(errors.ConfigError, match="image pull secret: 'Reg_Cred' is not a"):
        check_pull_secrets(["regcred", "Reg_Cred"])


def test_check_images_names_the_bad_one() -> None:
    check_images(["busybox", "r.io:5000/a/b:1"])
    with pytest.raises(errors.ConfigError, match="'not an image'"):
        check_images(["busybox", "not an image"])


# -- the nodes to pull onto ----------------------------------------------------------------


def node(name: str, *, ready: str = "True", unschedulable: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


@dataclass
class NodeServer:
    """``GET /api/v1/nodes`` as the API server answers it: two a page, or an error Status."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    queries: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        if self.status != 200:
            message = {400: 'unable to parse requirement: found "=", expected: identifier',
                       403: 'nodes is forbidden: User "u" cannot list resource "nodes"',
                       500: "etcdserver: request timed out"}[self.status]  # fmt: skip
            body = {"kind": "Status", "code": self.status, "message": message}
            return web.json_response(body, status=self.status)
        start = int(request.query.get("continue", "0"))
        more = start + 2 < len(self.nodes)
        metadata = {"continue": str(start + 2)} if more else {}
        items = self.nodes[start : start + 2]
        return web.json_response({"kind": "NodeList", "items": items, "metadata": metadata})


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[NodeServer, KubeAPI]]:
    server = NodeServer()
    async with loopback({"/api/v1/nodes": server.handle}) as url, kube_api(url) as api:
        yield server, api


@pytest.mark.anyio
async def test_prepare_pulls_onto_the_ready_schedulable_nodes_of_the_selector(
    nodes: tuple[NodeServer, KubeAPI],
) -> None:
    server, api = nodes
    server.nodes = [node("a"), node("b", ready="False"), node("c", unschedulable=True),
                    node("d"), node("e", ready="Unknown")]  # fmt: skip
    listed = await list_nodes(api, "pool=gpu")
    assert [n["metadata"]["name"] for n in listed] == ["a", "d"]
    # Paged, the selector on every page, and read from etcd, not the watch cache as it
    # is (resourceVersion=0): a node labelled a moment ago is there.
    assert len(server.queries) == 3
    assert all(q["labelSelector"] == "pool=gpu" for q in server.queries)
    assert all("resourceVersion" not in q for q in server.queries)


@pytest.mark.anyio
async def test_a_bad_selector_and_a_missing_permission_say_so(
    nodes: tuple[NodeServer, KubeAPI],
) -> None:
    server, api = nodes
    server.status = 400
    with pytest.raises(errors.ConfigError, match="bad node selector 'a==': unable to parse"):
        await list_nodes(api, "a==")
    server.status = 403
    with pytest.raises(errors.ConfigError, match="prepare needs get/list on nodes"):
        await list_nodes(api)
    server.status = 500
    with pytest.raises(errors.ThrottledError, match="list nodes 'x': 500 etcdserver"):
        await list_nodes(api, "x")


@pytest.mark.anyio
async def test_an_api_server_that_is_away_is_a_provider_error() -> None:
    async with loopback({}) as url:
        pass  # gone: nothing listens there any more
    async with kube_api(url) as api:
        with pytest.raises(errors.ProviderError, match="API server unreachable"):
            await list_nodes(api)
