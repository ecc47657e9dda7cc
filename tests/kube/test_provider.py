"""The Kubernetes provider on the hack/kube cluster, as the ordinary identity ``sandman``.

Sandboxes on the real node run the harness's unmodified busybox image with
sandmand delivered by the init container; the SDK talks to the daemon over
the pod IP. Every test labels its pods with its own pool name and, whatever
happens, deletes them as admin at the end, then fails if it had to.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

import sandman
from sandman import errors
from sandman.client import AsyncClient, InProcessBackend
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.providers.base import SandboxInfo
from sandman.providers.kubernetes import KubernetesProvider, pods
from sandman.providers.kubernetes.pods import KWOK_NO_DELAY
from sandman.providers.kubernetes.watch import PodWatch
from tests.kube.conftest import SETUP_TIMEOUT, KubeCluster
from tests.kube.support import BUSYBOX, KWOK, POOL, Admin, config_for, provider_for, real_node_spec
from tests.support import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.anyio]


@pytest.fixture
async def provider(kube_cluster: KubeCluster) -> AsyncIterator[KubernetesProvider]:
    async with provider_for(kube_cluster) as provider:
        yield provider


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_a_sandbox_from_an_unmodified_image_keeps_files_and_processes(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    # The public entry point: the provider's settings as a config, its own pool name.
    config = config_for(kube_cluster)
    async with sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client:
        async with client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb:
            pod = await admin.pod(sb.id)
            assert pod is not None
            assert pod["metadata"]["labels"][POOL] == pool_name
            assert "sandman.io/expires-at" in pod["metadata"]["annotations"]
            spec = pod["spec"]
            assert spec["containers"][0]["image"] == BUSYBOX
            assert spec["restartPolicy"] == "Never"
            assert spec["automountServiceAccountToken"] is False
            assert spec["enableServiceLinks"] is False
            assert spec["containers"][0]["resources"]["limits"]["ephemeral-storage"]

            result = await sb.exec(
                "echo hello from $(hostname); cat /proc/1/cmdline | tr '\\0' ' '"
            )
            assert result.exit_code == 0
            assert f"hello from {sb.id}" in result.stdout
            assert "/.sandman/sandmand" in result.stdout  # the daemon is PID 1
            # The daemon took its token out of the environment before starting anything.
            assert "SANDMAND_TOKEN" not in (await sb.exec("env")).stdout

            await sb.write_file("/tmp/note.txt", b"kept between calls")
            assert await sb.read_file("/tmp/note.txt") == b"kept between calls"

            process = await sb.spawn(["sleep", "300"])
            later = await sb.exec(["cat", f"/proc/{process.pid}/cmdline"])
            assert later.stdout.replace("\0", " ").strip() == "sleep 300"
            assert (await sb.poll(process.id)).running
            sandbox_id = sb.id

        async def gone() -> bool:
            return await admin.pod(sandbox_id) is None

        await wait_for("the released sandbox's pod to go", 60, gone)


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_a_port_in_a_pod_through_its_daemon(
    kube_cluster: KubeCluster, pool_name: str
) -> None:
    """Issue 16, gap 6: ``expose`` over the pod IP, to a server on the pod's loopback."""
    config = config_for(kube_cluster)
    async with sandman.kubernetes(config, pool=PoolConfig(name=pool_name)) as client:
        async with client.sandbox(real_node_spec(kube_cluster), timeout=120) as sb:
            await sb.write_file("/tmp/www/index.html", "hello from a pod\n")
            await sb.spawn(["busybox", "httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/tmp/www"])
            exposed = await sb.expose(8080)
            async with httpx.AsyncClient() as http:
                with anyio.fail_after(60):
                    while True:
                        try:
                            answer = await http.get(exposed.url + "/index.html")
                            break
                        except httpx.TransportError:
                            await anyio.sleep(0.05)
            assert answer.text == "hello from a pod\n"
        assert exposed.closed and exposed.connections == 0


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_a_missing_image_is_an_image_error_at_once(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster, start_timeout=300))
    try:
        spec = real_node_spec(kube_cluster).model_copy(
            update={"image": "sandman.local/no-such-image:1"}
        )
        started = time.monotonic()
        with pytest.raises(errors.ImageError, match="no-such-image"):
            await provider.create(spec, labels={POOL: pool_name})
        # Typed from the pod's status, long before the 300 s start deadline.
        assert time.monotonic() - started < 60
        # The provider removed the pod it made.
        assert await admin.names(pool_name) == []
    finally:
        await provider.aclose()


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_a_missing_daemon_image_is_named_as_such(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    provider = KubernetesProvider(config_for(kube_cluster, daemon_image="sandman.local/nope:0"))
    try:
        with pytest.raises(errors.ImageError, match="daemon image sandman.local/nope:0"):
            await provider.create(real_node_spec(kube_cluster), labels={POOL: pool_name})
        assert await admin.names(pool_name) == []
    finally:
        await provider.aclose()


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_resources_no_node_has_are_a_capacity_error(
    kube_cluster: KubeCluster, provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    spec = SandboxSpec(image=BUSYBOX, cpu=900)
    with pytest.raises(errors.CapacityError, match="unschedulable") as caught:
        await provider.create(spec, labels={POOL: pool_name})
    assert caught.value.retryable
    assert await admin.names(pool_name) == []


@pytest.mark.timeout(SETUP_TIMEOUT + 180)
async def test_a_vanished_pod_is_a_lost_sandbox_on_the_next_call(
    kube_cluster: KubeCluster, provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    pool = Pool(provider, PoolConfig(name=pool_name))
    async with AsyncClient(InProcessBackend(pool)) as client:
        sb = await client.acquire(real_node_spec(kube_cluster), timeout=120)
        assert (await sb.exec("true")).exit_code == 0
        await admin.delete(sb.id)  # evicted, or deleted by someone else
        with pytest.raises(errors.SandboxNotFound):
            await provider.inspect(sb.id)  # grace 0: the object is gone at once

        async def lost() -> bool:
            try:
                await sb.exec("true", timeout=5)
            except errors.SandboxNotFound as exc:
                assert "gone" in str(exc)
                return True
            return False  # the container may take a moment to be killed

        await wait_for("the next call to say the sandbox is lost", 90, lost)
        await sb.release()


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_list_selects_by_label_page_by_page(
    kube_cluster: KubeCluster, admin: Admin, pool_name: str
) -> None:
    # Pod readiness on KWOK nodes: listing needs pods, not running daemons.
    provider = KubernetesProvider(
        config_for(kube_cluster, readiness="pod", annotations=KWOK_NO_DELAY)
    )
    spec = SandboxSpec(image=BUSYBOX, kubernetes=KWOK)
    try:

        async def create(session: str) -> None:
            await provider.create(spec, labels={POOL: pool_name, "sandman.io/session": session})

        async with anyio.create_task_group() as group:
            for i in range(5):
                group.start_soon(create, f"s{i % 2}")
        everything = await provider.list(labels={POOL: pool_name})
        assert len(everything) == 5
        assert {info.state for info in everything} == {"running"}
        assert all(info.endpoint is None for info in everything)  # no daemon in pod mode
        session0 = await provider.list(labels={POOL: pool_name, "sandman.io/session": "s0"})
        assert len(session0) == 3
        items, version = await provider.api.list_pods(f"{POOL}={pool_name}", page=2)
        assert sorted(p["metadata"]["name"] for p in items) == sorted(e.id for e in everything)
        assert version
        # The real API server pages it (at resourceVersion=0 it would answer all 5 at once).
        pages = [
            len(chunk) async for chunk, _ in provider.api.pod_pages(f"{POOL}={pool_name}", page=2)
        ]
        assert pages == [2, 2, 1], pages
        with pytest.raises(errors.ConfigError, match="invalid value"):
            await provider.list(labels={POOL: "not a label value"})
        # Relabelled as the identity (it may patch pods): a new list sees it.
        await provider.relabel(session0[0].id, {"sandman.io/session": "s9", "k": None})
        moved = await wait_for(
            "the relabel to reach the list", 10,
            lambda: _listed(provider, {POOL: pool_name, "sandman.io/session": "s9"}),
        )  # fmt: skip
        assert [info.id for info in moved] == [session0[0].id]
        with pytest.raises(errors.SandboxNotFound):
            await provider.relabel("sb-none", {"k": "v"})
        for info in everything:
            await provider.delete(info.id)
            await provider.delete(info.id)  # idempotent: 404 is fine
        assert await provider.list(labels={POOL: pool_name}) == []
    finally:
        await provider.aclose()


@pytest.mark.timeout(SETUP_TIMEOUT + 120)
async def test_the_watch_resumes_where_the_server_ended_it(
    kube_cluster: KubeCluster, provider: KubernetesProvider, admin: Admin, pool_name: str
) -> None:
    # A watch the server ends every second: each time it goes on from the last
    # resourceVersion, without listing again, and still sees every transition.
    watch = PodWatch(provider.api, f"{POOL}={pool_name}", timeout_seconds=1)
    seen: list[str] = []
    try:
        await watch.ensure_started()
        assert watch.relists == 1

        async def restarted() -> bool:
            return watch.restarts >= 2

        await wait_for("the server to end the watch twice", 30, restarted)
        name = f"{pool_name}-w"
        watch.add(name, lambda kind, pod: seen.append(kind))
        spec = SandboxSpec(image=BUSYBOX, kubernetes=KWOK)
        body = pods.pod_manifest(
            name=name, spec=spec, labels={POOL: pool_name}, token="t",
            config=config_for(kube_cluster, annotations=KWOK_NO_DELAY),
        )  # fmt: skip
        await provider.api.create_pod(body)
        await provider.delete(name)

        async def deleted() -> bool:
            return "DELETED" in seen

        await wait_for("the watch to see the pod come and go", 30, deleted)
        assert seen[0] == "ADDED"
        assert watch.relists == 1
    finally:
        await watch.aclose()


async def _listed(provider: KubernetesProvider, labels: dict[str, str]) -> list[SandboxInfo] | None:
    return await provider.list(labels=labels) or None
