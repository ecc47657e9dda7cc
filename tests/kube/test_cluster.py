"""The hack/kube cluster behaves like a real one for Sandman's identity.

Everything goes through the API server as the ordinary user ``sandman``
(token auth, a Role in one namespace, not exempt from Priority and
Fairness), except clean-up of what a test made, which the harness does as
admin so that a failed test leaves nothing for the next one.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]

BUSYBOX = "sandman.local/busybox:1.35"


def _client(cluster: KubeCluster, token: str, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=cluster.server,
        verify=ssl.create_default_context(cafile=str(cluster.ca)),
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
        **kwargs,
    )


@pytest.fixture
async def user(kube_cluster: KubeCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(
        kube_cluster, kube_cluster.token, limits=httpx.Limits(max_connections=200)
    ) as client:
        yield client


@pytest.fixture
async def admin(kube_cluster: KubeCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(kube_cluster, kube_cluster.admin_token) as client:
        yield client


def _pod(name: str, labels: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"terminationGracePeriodSeconds": 1, "restartPolicy": "Never", **spec},
    }


@pytest.mark.timeout(SETUP_TIMEOUT + 60)
async def test_identity_is_ordinary_and_least_privileged(
    kube_cluster: KubeCluster, user: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    ns = kube_cluster.namespace
    resp = await user.get(f"/api/v1/namespaces/{ns}/pods")
    assert resp.status_code == 200, resp.text
    exempt = await admin.get("/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas/exempt")
    exempt.raise_for_status()
    # Priority and Fairness names the flow schema that classified the request.
    assert resp.headers["X-Kubernetes-PF-FlowSchema-UID"] != exempt.json()["metadata"]["uid"]

    async def can(verb: str, resource: str, namespace: str, sub: str = "") -> bool:
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "verb": verb,
                    "resource": resource,
                    "subresource": sub,
                    "namespace": namespace,
                }
            },
        }
        r = await user.post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", json=review)
        r.raise_for_status()
        return bool(r.json()["status"]["allowed"])

    for verb in ("create", "get", "list", "watch", "delete", "patch"):
        assert await can(verb, "pods", ns), verb
    assert await can("create", "pods", ns, "exec")
    assert await can("list", "events", ns)
    assert not await can("list", "pods", "default")
    assert not await can("get", "secrets", ns)
    assert not await can("update", "pods", ns)  # labels are patched, never replaced
    assert not await can("deletecollection", "pods", ns)
    assert not await can("list", "nodes", "")


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_real_node_runs_a_pod_execs_in_it_and_deletes_it(
    kube_cluster: KubeCluster, user: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    ns = kube_cluster.namespace
    name = f"real-{uuid.uuid4().hex[:8]}"
    pod = _pod(
        name,
        {"sandman.io/test": "real-node"},
        {
            "nodeSelector": {"kubernetes.io/hostname": kube_cluster.real_node},
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX,
                    "imagePullPolicy": "Never",  # imported offline by hack/kube/up
                    "command": ["/bin/sleep", "3600"],
                }
            ],
        },
    )
    resp = await user.post(f"/api/v1/namespaces/{ns}/pods", json=pod)
    assert resp.status_code == 201, resp.text
    try:

        async def running() -> dict[str, Any] | None:
            r = await user.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            r.raise_for_status()
            body: dict[str, Any] = r.json()
            return body if body["status"].get("phase") == "Running" else None

        try:
            status = (await wait_for("the pod to run", 120, running))["status"]
        except AssertionError:
            events = await user.get(
                f"/api/v1/namespaces/{ns}/events",
                params={"fieldSelector": f"involvedObject.name={name}"},
            )
            messages = [e["message"] for e in events.json()["items"]]
            raise AssertionError(f"pod {name} did not run; events: {messages}") from None
        assert ipaddress.ip_address(status["podIP"]) in ipaddress.ip_network(
            kube_cluster.pod_subnet
        )

        # exec through the API server (kubectl speaks its websocket protocol),
        # as the ordinary identity.
        result = await anyio.run_process(
            [
                str(kube_cluster.kubectl),
                "--kubeconfig",
                str(kube_cluster.kubeconfig),
                "exec",
                name,
                "--",
                "/bin/sh",
                "-c",
                "echo hello from $(hostname); cat /proc/1/cmdline | tr '\\0' ' '; exit 7",
            ],
            check=False,
            env={**os.environ, "KUBECONFIG": str(kube_cluster.kubeconfig)},
        )
        out = result.stdout.decode()
        assert f"hello from {name}" in out, (out, result.stderr.decode())
        assert "/bin/sleep 3600" in out
        assert result.returncode == 7  # the command's exit status comes back

        resp = await user.delete(f"/api/v1/namespaces/{ns}/pods/{name}")
        assert resp.status_code == 200, resp.text

        async def gone() -> bool:
            r = await user.get(f"/api/v1/namespaces/{ns}/pods/{name}")
            return r.status_code == 404

        # The object goes only once the kubelet has stopped the containers.
        await wait_for("the pod to be deleted", 60, gone)
    finally:
        await admin.delete(f"/api/v1/namespaces/{ns}/pods/{name}", params={"gracePeriodSeconds": 0})


@pytest.mark.timeout(SETUP_TIMEOUT + 600)
async def test_a_thousand_pods_run_on_kwok_nodes(
    kube_cluster: KubeCluster, user: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    ns = kube_cluster.namespace
    count, concurrency = 1000, 64
    run = uuid.uuid4().hex[:8]
    labels = {"sandman.io/test": "kwok", "sandman.io/run": run}
    selector = f"sandman.io/run={run}"
    spec = {
        "nodeSelector": {"type": "kwok"},
        "tolerations": [
            {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
        ],
        "automountServiceAccountToken": False,
        "containers": [{"name": "main", "image": BUSYBOX}],
    }
    throttled = 0
    sem = anyio.Semaphore(concurrency)

    async def create(i: int) -> None:
        nonlocal throttled
        async with sem:
            body = _pod(f"kwok-{run}-{i:04d}", labels, spec)
            for _ in range(50):
                r = await user.post(f"/api/v1/namespaces/{ns}/pods", json=body)
                if r.status_code == 201:
                    return
                if r.status_code != 429:
                    raise AssertionError(f"create {i}: {r.status_code} {r.text}")
                throttled += 1
                await anyio.sleep(float(r.headers.get("Retry-After", "1")))
            raise AssertionError(f"create {i}: still throttled after 50 tries")

    started = time.monotonic()
    try:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(create, i)
        created = time.monotonic() - started

        async def all_running() -> bool:
            r = await user.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
            r.raise_for_status()
            items = r.json()["items"]
            return len(items) == count and all(p["status"].get("phase") == "Running" for p in items)

        await wait_for(f"{count} pods to run", 300, all_running)
        print(  # noqa: T201
            f"\n{count} pods created in {created:.1f}s ({throttled} x 429), "
            f"all Running after {time.monotonic() - started:.1f}s"
        )
        r = await user.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
        nodes = {p["spec"]["nodeName"] for p in r.json()["items"]}
        assert nodes <= {f"kwok-node-{i}" for i in range(kube_cluster.kwok_nodes)}
        assert len(nodes) > 1  # the scheduler spread them
    finally:
        await admin.delete(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})

        async def none_left() -> bool:
            r = await admin.get(f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector})
            return r.status_code == 200 and not r.json()["items"]

        await wait_for("KWOK to delete the pods", 120, none_left)


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_priority_and_fairness_throttles_the_identity(
    kube_cluster: KubeCluster, user: httpx.AsyncClient, admin: httpx.AsyncClient
) -> None:
    """A burst from ``sandman`` gets 429s once its priority level is full.

    The default ``global-default`` level queues a few hundred requests per
    flow, more than a Python test sends at once on two cores; so the test
    gives ``sandman`` a small level of its own, as a busy shared cluster would.
    """
    api = "/apis/flowcontrol.apiserver.k8s.io/v1"
    name = f"sandman-test-{uuid.uuid4().hex[:8]}"
    level = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {
            "type": "Limited",
            "limited": {
                "nominalConcurrencyShares": 1,
                "lendablePercent": 0,
                "limitResponse": {
                    "type": "Queue",
                    "queuing": {"queues": 1, "handSize": 1, "queueLengthLimit": 2},
                },
            },
        },
    }
    schema = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "priorityLevelConfiguration": {"name": name},
            "matchingPrecedence": 500,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [{"kind": "User", "user": {"name": "sandman"}}],
                    "resourceRules": [
                        {
                            "verbs": ["*"],
                            "apiGroups": ["*"],
                            "resources": ["*"],
                            "namespaces": ["*"],
                        }
                    ],
                }
            ],
        },
    }
    (await admin.post(f"{api}/prioritylevelconfigurations", json=level)).raise_for_status()
    try:
        (await admin.post(f"{api}/flowschemas", json=schema)).raise_for_status()
        ns = kube_cluster.namespace

        async def classified() -> bool:
            fs = await admin.get(f"{api}/flowschemas/{name}")
            r = await user.get(f"/api/v1/namespaces/{ns}/pods")
            uid: str = fs.json()["metadata"]["uid"]
            return bool(r.headers.get("X-Kubernetes-PF-FlowSchema-UID") == uid)

        await wait_for("the flow schema to apply", 30, classified)

        codes: list[int] = []

        async def one() -> None:
            r = await user.get(f"/api/v1/namespaces/{ns}/events")
            codes.append(r.status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(300):
                tg.start_soon(one)
        assert set(codes) <= {200, 429}, set(codes)
        assert codes.count(429) > 0, "no 429 from a 300-request burst"
        assert codes.count(200) > 0
        print(f"\nburst of {len(codes)}: {codes.count(429)} x 429")  # noqa: T201
    finally:
        await admin.delete(f"{api}/flowschemas/{name}")
        await admin.delete(f"{api}/prioritylevelconfigurations/{name}")
