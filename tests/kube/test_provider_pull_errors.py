"""Image pull failures on the real node, from a fault-injecting registry on 127.0.0.1.

The node's containerd pulls plain HTTP from a loopback registry without any
configuration (tests/kube/test_prepare.py pulls from a real one that way).
Here an aiohttp server stands in for a registry that answers every request
with one status: 503 (a sick registry, which the kubelet retries with
back-off: the sandbox waits until its deadline, and the timeout names the
503) or 404 (a missing image: an ImageError at once). Every pod is gone
afterwards, and so is the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from sandman import errors
from sandman.providers.kubernetes import KubernetesProvider
from sandman.providers.kubernetes.prepare import prepare_images
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import POOL, Admin, config_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio, pytest.mark.timeout(SETUP_TIMEOUT + 180)]

# Long enough for the kubelet's second pull (its back-off starts at 10 s), short for a test.
START_TIMEOUT = 35.0
ATTEMPT_GAP = 3.0  # one pull's requests come together; the kubelet's retries come >= 10 s apart
GONE_TIMEOUT = 60.0
# A permanent failure fails at the kubelet's first report of it, which can wait for its
# next sync of the pod (~15 s after the pull); the deadline is 300 s.
FAILURE_WITHIN = 45.0


@dataclass
class SickRegistry:
    """What the fault injector saw: (monotonic time, method, path) of every request."""

    host: str
    requests: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def image(self) -> str:
        return f"{self.host}/sandman-test/sick:1"

    @property
    def pulls(self) -> int:
        """Pull attempts: manifest requests, those close together counted as one."""
        times = [at for at, _, path in self.requests if "/manifests/" in path]
        return sum(1 for i, at in enumerate(times) if i == 0 or at - times[i - 1] > ATTEMPT_GAP)


@contextlib.asynccontextmanager
async def sick_registry(status: int) -> AsyncIterator[SickRegistry]:
    """A "registry" on a free port of 127.0.0.1 that answers every request with ``status``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    registry = SickRegistry(f"127.0.0.1:{sock.getsockname()[1]}")

    async def answer(request: web.Request) -> web.Response:
        registry.requests.append((time.monotonic(), request.method, request.path))
        return web.Response(status=status, text=f"injected {status}\n")

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        yield registry
    finally:
        await runner.cleanup()
        sock.close()


@pytest.fixture
async def provider(kube_cluster: KubeCluster, real_node: str) -> AsyncIterator[KubernetesProvider]:
    provider = KubernetesProvider(config_for(kube_cluster, start_timeout=START_TIMEOUT))
    try:
        yield provider
    finally:
        await provider.aclose()


async def wait_gone(admin: Admin, name: str) -> None:
    async def gone() -> bool:
        return await admin.pod(name) is None

    await wait_for(f"pod {name} to go", GONE_TIMEOUT, gone)


async def test_a_sick_registry_is_waited_out_and_the_timeout_names_its_answer(
    kube_cluster: KubeCluster, provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    name = f"sb-sick-{secrets.token_hex(4)}"
    async with sick_registry(503) as registry:
        spec = real_node_spec(kube_cluster).model_copy(update={"image": registry.image})
        started = time.monotonic()
        create = asyncio.create_task(
            provider.create(spec, sandbox_id=name, labels={POOL: pool_name})
        )
        try:

            async def pull_failed() -> bool:
                if create.done():
                    return True
                pod = await admin.pod(name)
                statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
                waiting = [(s.get("state") or {}).get("waiting") or {} for s in statuses]
                return any("503 Service Unavailable" in w.get("message", "") for w in waiting)

            # The kubelet reported the 503 in the pod's status, which the provider watches...
            await wait_for("the pod to report the 503", START_TIMEOUT, pull_failed)
            assert not create.done(), f"create ended at the first 503: {create.exception()!r}"

            async def pulled_again() -> bool:
                return create.done() or registry.pulls >= 2

            # ...and it waited on while the kubelet retried.
            await wait_for("a second pull", START_TIMEOUT, pulled_again)
            assert not create.done(), f"create ended after a 503: {create.exception()!r}"
            # What the start waits on, for the pool's timeout error, names it too.
            assert "503 Service Unavailable" in (provider.progress(name) or "")
            with pytest.raises(errors.CreateTimeout) as caught:
                await create
        finally:
            if not create.done():
                create.cancel()
            with contextlib.suppress(BaseException):
                await create
    assert time.monotonic() - started >= START_TIMEOUT
    message = str(caught.value)
    assert f"did not start within {START_TIMEOUT} s" in message
    assert f"image {registry.image}" in message
    assert "503 Service Unavailable" in message
    assert registry.pulls >= 2
    assert provider.progress(name) is None
    await wait_gone(admin, name)


async def test_a_missing_image_is_an_image_error_well_before_the_deadline(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str, real_node: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster, start_timeout=300))
    name = f"sb-absent-{secrets.token_hex(4)}"
    try:
        async with sick_registry(404) as registry:
            spec = real_node_spec(kube_cluster).model_copy(update={"image": registry.image})
            started = time.monotonic()
            with pytest.raises(errors.ImageError, match="not found") as caught:
                await provider.create(spec, sandbox_id=name, labels={POOL: pool_name})
            elapsed = time.monotonic() - started
    finally:
        await provider.aclose()
    assert registry.image in str(caught.value)
    assert registry.pulls >= 1  # the node did ask this registry
    assert elapsed < FAILURE_WITHIN, f"took {elapsed:.1f} s of the 300 s deadline"
    await wait_gone(admin, name)


async def test_prepare_reports_a_pull_that_kept_failing_as_transient(
    provider: KubernetesProvider, admin: Admin, real_node: str
) -> None:
    async with sick_registry(503) as registry:
        [result] = await prepare_images(provider.api, [registry.image], [real_node], timeout=20)
    assert not result.ok
    assert result.detail.startswith("timed out after 20 s, still failing (transient): ")
    assert "503 Service Unavailable" in result.detail
    assert registry.pulls >= 1
    response = await admin.http.get(admin.pods, params={"labelSelector": "sandman.io/prepare"})
    response.raise_for_status()
    left = [
        pod["metadata"]["name"]
        for pod in response.json()["items"]
        if pod["spec"]["containers"][0]["image"] == registry.image
    ]
    assert left == []
