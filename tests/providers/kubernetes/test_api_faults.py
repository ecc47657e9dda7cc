"""The pod watch and the API client against a real HTTP server on loopback: 410 Gone
(both ways the API server says it) means "list again" and PodWatch lists and goes on;
a garbled stream is resumed; a TLS mismatch is a configuration error.

A fresh harness cluster cannot be made to answer 410 on demand (its watch
cache still holds every version from its start), so this runs beside the
cluster tests in tests/kube, which cover the watch's resume and bookmarks.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from sandman import errors
from sandman.providers.kubernetes import KubernetesProvider, pods
from sandman.providers.kubernetes.api import KubeAPI, WatchExpired
from sandman.providers.kubernetes.credentials import Credentials
from sandman.providers.kubernetes.watch import PodWatch
from sandman.settings import KubernetesConfig
from tests.providers.kubernetes.conftest import kube_api, loopback

pytestmark = pytest.mark.anyio

GONE = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}


def pod(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version}}


@dataclass
class PodServer:
    """Lists answer with `listed` at `list_version`; each watch plays the next script."""

    listed: list[dict[str, Any]] = field(default_factory=list)
    list_version: str = "10"
    scripts: list[str | list[dict[str, Any]]] = field(default_factory=list)
    """Per watch: "http410" (a 410 answer), "event410" (a 200 stream whose first event is a
    410 ERROR, as the API server sends it), "garbage" (a line that is not JSON), "hang"
    (no events until the test ends), or a list of events (sent, then "hang")."""
    watched_from: list[str] = field(default_factory=list)
    lists: int = 0
    listed_from: list[str | None] = field(default_factory=list)
    url: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "1":
            self.lists += 1
            self.listed_from.append(request.query.get("resourceVersion"))
            body = {"kind": "PodList", "items": self.listed,
                    "metadata": {"resourceVersion": self.list_version}}  # fmt: skip
            return web.json_response(body)
        self.watched_from.append(request.query["resourceVersion"])
        script = self.scripts.pop(0) if self.scripts else "hang"
        if script == "http410":
            return web.json_response(GONE, status=410)
        response = web.StreamResponse()
        await response.prepare(request)
        if script == "event410":
            await response.write(json.dumps({"type": "ERROR", "object": GONE}).encode() + b"\n")
            return response
        if script == "garbage":
            await response.write(b"<html>bad gateway</html>\n")
            return response
        for event in script if isinstance(script, list) else []:
            await response.write(json.dumps(event).encode() + b"\n")
        await self.done.wait()  # "hang": until the test ends
        return response


@pytest.fixture
async def server() -> AsyncIterator[PodServer]:
    fake = PodServer()
    async with loopback({"/api/v1/namespaces/ns/pods": fake.handle}) as fake.url:
        try:
            yield fake
        finally:
            fake.done.set()  # the hanging watches end, so the server can stop


@pytest.fixture
async def api(server: PodServer) -> AsyncIterator[KubeAPI]:
    async with kube_api(server.url) as client:
        yield client


@pytest.mark.parametrize("script", ["http410", "event410"])
async def test_a_watch_from_an_expired_version_says_list_again(
    server: PodServer, api: KubeAPI, script: str
) -> None:
    server.scripts = [script]
    with pytest.raises(WatchExpired):
        async for _ in api.watch_pods("sandman.io/pool=p", "1", timeout_seconds=5):
            pass
    assert server.watched_from == ["1"]


async def test_the_pod_watch_lists_again_on_410_and_hands_the_listed_pods_on(
    server: PodServer, api: KubeAPI
) -> None:
    server.listed = [pod("a", "9")]
    server.scripts = ["event410", "http410"]
    watch = PodWatch(api, "sandman.io/pool=p")
    seen: list[tuple[str, str]] = []
    watch.add("a", lambda kind, p: seen.append((kind, p["metadata"]["name"])))
    try:
        await watch.ensure_started()
        server.list_version = "20"

        async def relisted_twice() -> None:
            while watch.relists < 3 or len(server.watched_from) < 3:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(relisted_twice(), 10)
    finally:
        await watch.aclose()
    # Each 410 led to a list, and the next watch began at that list's version.
    assert server.lists == 3
    assert server.watched_from == ["10", "20", "20"]
    assert seen == [("LISTED", "a")] * 3


async def test_a_garbled_watch_is_resumed_not_fatal(server: PodServer, api: KubeAPI) -> None:
    server.scripts = ["garbage"]
    watch = PodWatch(api, "sandman.io/pool=p")
    try:
        await watch.ensure_started()

        async def resumed() -> None:
            while len(server.watched_from) < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(resumed(), 10)
        assert watch.restarts >= 1
        assert watch._task is not None and not watch._task.done()
    finally:
        await watch.aclose()


async def test_a_tls_mismatch_is_configuration_not_throttling(server: PodServer) -> None:
    # TLS to a server that speaks plain HTTP: a wrong server URL or CA must be one clear
    # ConfigError, not a ThrottledError the pool would retry and slow down for.
    credentials = Credentials(
        server=server.url.replace("http://", "https://"), namespace="ns",
        ssl_context=ssl.create_default_context(),
    )  # fmt: skip
    client = KubeAPI(credentials, timeout=5)
    try:
        with pytest.raises(errors.ConfigError, match="SSL"):
            await client.list_pods("sandman.io/pool=p")
    finally:
        await client.aclose()


async def test_every_list_is_consistent_so_the_api_server_honours_its_limit(
    server: PodServer, api: KubeAPI
) -> None:
    """At resourceVersion=0 the API server answers every object at once from its cache,
    whatever the limit: 50,000 pods in one answer. Without one it pages."""
    server.listed = [pod("a", "9")]
    assert [p["metadata"]["name"] for p in (await api.list_pods("x=y"))[0]] == ["a"]
    assert server.listed_from == [None]


def _sandbox_pod(name: str, phase: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": "11", "labels": {"sandman.io/pool": "p"}},
        "spec": {"containers": [{"name": "sandbox", "image": "x"}]},
        "status": {"phase": phase, **status},
    }


async def test_the_provider_tells_of_a_watched_pods_loss_from_its_watch(
    server: PodServer,
) -> None:
    oom = {"containerStatuses": [
        {"name": "sandbox", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    ]}  # fmt: skip
    server.listed = [_sandbox_pod(n, "Running") for n in ("sb-1", "sb-2", "sb-3")]
    server.scripts = [[
        {"type": "MODIFIED", "object": _sandbox_pod("sb-3", "Failed", **oom)},  # not watched
        {"type": "MODIFIED", "object": _sandbox_pod("sb-1", "Failed", **oom)},
        {"type": "DELETED", "object": _sandbox_pod("sb-2", "Running")},  # behind our back
    ]]  # fmt: skip
    provider = KubernetesProvider(KubernetesConfig(server=server.url, namespace="ns"))
    try:
        reports = provider.lost()  # starts the watch on first use
        for name in ("sb-1", "sb-2"):
            provider.watch_lost(pods.pod_info(_sandbox_pod(name, "Running"), provider="k", port=1))
        async with asyncio.timeout(10):
            got = [await anext(reports), await anext(reports)]
        assert [(lost.sandbox_id, lost.reason) for lost in got] == [
            ("sb-1", "oom"), ("sb-2", "deleted"),
        ]  # fmt: skip
        await reports.aclose()
    finally:
        await provider.aclose()


async def test_a_429_is_waited_out_by_a_list_but_handed_to_the_pacer_by_a_create() -> None:
    """A list (or a Lease, a delete...) on a busy cluster waits as client-go does; a pod's
    create answers ThrottledError at once, for the pool's pacer to slow down on."""
    throttled = {"GET": 2, "POST": 1}
    calls: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        calls.append(request.method)
        if throttled[request.method] > 0:
            throttled[request.method] -= 1
            return web.json_response(
                {"kind": "Status", "code": 429}, status=429, headers={"Retry-After": "0"}
            )
        return web.json_response({"kind": "PodList", "items": [], "metadata": {}})

    async with loopback({"/api/v1/namespaces/ns/pods": handle}) as url, kube_api(url) as api:
        items, _ = await api.list_pods("sandman.io/pool=p")
        assert items == []
        assert calls == ["GET"] * 3
        with pytest.raises(errors.ThrottledError):
            await api.create_pod({"metadata": {"name": "p1"}})
        assert calls[3:] == ["POST"]


async def test_a_relabel_is_a_merge_patch_that_waits_out_a_429() -> None:
    """An acquire's relabel on a busy cluster waits as a list does (it failed the acquire
    before), and is sent as a JSON merge patch, so that None removes a label."""
    got: list[tuple[int, str, dict[str, Any]]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        got.append((len(got), request.content_type, json.loads(await request.read())))
        if len(got) == 1:
            return web.json_response(
                {"kind": "Status", "code": 429}, status=429, headers={"Retry-After": "0"}
            )
        return web.json_response({"kind": "Pod"})

    async with loopback({"/api/v1/namespaces/ns/pods/{name}": handle}) as url, kube_api(url) as api:
        await api.patch_pod_labels("sb-1", {"sandman.io/held": "yes", "gone": None})
    patch = {"metadata": {"labels": {"sandman.io/held": "yes", "gone": None}}}
    assert got == [(i, "application/merge-patch+json", patch) for i in (0, 1)]


async def test_pod_pages_hand_over_one_page_at_a_time_with_the_lists_version() -> None:
    """A reconcile of 50,000 keeps SandboxInfos, never every pod object at once: each page
    reaches the caller before the next is asked for, and the continue token is followed."""
    asked: list[dict[str, str]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        asked.append(dict(request.query))
        token = request.query.get("continue")
        name, follow = ("b", "") if token else ("a", "next")
        metadata = {"resourceVersion": "7", "continue": follow}
        return web.json_response({"items": [{"metadata": {"name": name}}], "metadata": metadata})

    async with loopback({"/api/v1/namespaces/ns/pods": handle}) as url, kube_api(url) as api:
        seen = []
        async for chunk, version in api.pod_pages("x=y", page=1):
            seen.append(([p["metadata"]["name"] for p in chunk], version, len(asked)))
        assert seen == [(["a"], "7", 1), (["b"], "7", 2)]
        assert asked[0] == {"labelSelector": "x=y", "limit": "1"}
        assert asked[1] == {"labelSelector": "x=y", "limit": "1", "continue": "next"}
        assert await api.list_pods("x=y", page=1) == (
            [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}],
            "7",
        )


async def test_calls_wait_for_a_connection_outside_their_timeout() -> None:
    """A pool closing 50,000 sandboxes deletes them all at once: the calls queue for a
    connection, and that wait must not count against each call's timeout (it did, in
    aiohttp's pool: thousands timed out, were retried, and deletes crawled at 4/s). The
    watch's connections stay free."""
    active, most = 0, 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await asyncio.sleep(0.05)  # the API server's time for one delete
        active -= 1
        return web.json_response({"kind": "Status", "status": "Success"})

    async with loopback({"/api/v1/namespaces/ns/pods/{name}": handle}) as url:
        credentials = Credentials(
            server=url, namespace="ns", ssl_context=ssl.create_default_context()
        )
        api = KubeAPI(credentials, timeout=0.3, max_connections=4)
        try:
            # 40 x 50 ms over 4 connections: the last would wait 0.5 s > 0.3 s for one.
            await asyncio.gather(*(api.delete_pod(f"sb-{i}") for i in range(40)))
        finally:
            await api.aclose()
    assert most == 2  # 4 connections, 2 kept for watch streams


async def test_a_lease_renewal_does_not_queue_behind_a_pools_deletes() -> None:
    """While every slot is taken by deletes the API server has not answered, this process's
    owner Lease is still renewed: else other pools would judge it dead and reap its pods."""
    answer, full = asyncio.Event(), asyncio.Event()
    patched: list[str] = []
    waiting = 0

    async def delete(request: web.Request) -> web.StreamResponse:
        nonlocal waiting
        waiting += 1
        if waiting == 2:  # both slots of 4 connections taken
            full.set()
        await answer.wait()
        return web.json_response({"kind": "Status", "status": "Success"})

    async def renew(request: web.Request) -> web.StreamResponse:
        patched.append(request.match_info["name"])
        return web.json_response({"kind": "Lease"})

    routes = {
        "/api/v1/namespaces/ns/pods/{name}": delete,
        "/apis/coordination.k8s.io/v1/namespaces/ns/leases/{name}": renew,
    }
    async with loopback(routes) as url:
        credentials = Credentials(
            server=url, namespace="ns", ssl_context=ssl.create_default_context()
        )
        api = KubeAPI(credentials, timeout=30, max_connections=4)
        try:
            deletes = asyncio.gather(*(api.delete_pod(f"sb-{i}") for i in range(10)))
            async with asyncio.timeout(10):
                await full.wait()
                await api.patch_lease("owner", {"spec": {"renewTime": "now"}})
            assert patched == ["owner"]
            answer.set()
            await deletes
        finally:
            answer.set()
            await api.aclose()


def _at(pod: dict[str, Any], version: str, **labels: str) -> dict[str, Any]:
    metadata = {**pod["metadata"], "resourceVersion": version}
    metadata["labels"] = {**metadata["labels"], **labels}
    return {**pod, "metadata": metadata}


async def test_the_watch_keeps_each_pods_facts_and_never_goes_back(
    server: PodServer, api: KubeAPI
) -> None:
    """What a list takes from the watch (`PodWatch.facts`): each pod as its latest event
    says, none once deleted; a write's answer (`saw`) at once, and an event older than
    it (sent before the write) does not undo it."""
    oom = {"containerStatuses": [
        {"name": "sandbox", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    ]}  # fmt: skip
    a, b = _sandbox_pod("sb-a", "Running"), _sandbox_pod("sb-b", "Running")
    server.listed = [a, b]
    server.scripts = [[
        {"type": "MODIFIED", "object": _at(_sandbox_pod("sb-a", "Failed", **oom), "12")},
        {"type": "DELETED", "object": _at(b, "13")},
    ]]  # fmt: skip
    watch = PodWatch(api, "sandman.io/pool=p", keep_facts=True)
    try:
        await watch.ensure_started()
        assert watch.current

        async def told() -> None:
            while "sb-b" in watch.facts or watch.facts["sb-a"].state != "stopped":
                await asyncio.sleep(0.01)

        await asyncio.wait_for(told(), 10)
        facts = watch.facts["sb-a"]
        assert (facts.version, facts.image, facts.lost and facts.lost.reason) == (12, "x", "oom")
        watch.saw(_at(a, "11", n="old"))  # older than what the watch told: ignored
        assert watch.facts["sb-a"] is facts
        watch.saw(_at(a, "14", n="new"))
        assert watch.facts["sb-a"].labels == {"sandman.io/pool": "p", "n": "new"}
    finally:
        await watch.aclose()
    # Without keep_facts (the pull pods' watch) nothing is kept.
    bare = PodWatch(api, "sandman.io/pool=p")
    try:
        await bare.ensure_started()
        assert bare.facts == {}
    finally:
        await bare.aclose()


async def test_facts_are_not_current_after_a_failed_stream_until_it_is_heard_from(
    server: PodServer, api: KubeAPI
) -> None:
    """Events may have been missed while the stream was down: a list reads whole pods
    until the resumed stream says something (every minute at least: a bookmark)."""
    server.listed = [_sandbox_pod("sb-a", "Running")]
    server.scripts = ["garbage", "hang"]
    watch = PodWatch(api, "sandman.io/pool=p", keep_facts=True)
    try:
        await watch.ensure_started()
        assert watch.current

        async def resumed() -> None:
            while len(server.watched_from) < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(resumed(), 10)
        assert not watch.current
        assert set(watch.facts) == {"sb-a"}
    finally:
        await watch.aclose()
    assert not watch.current


async def test_pod_names_read_a_table_or_a_plain_list(server: PodServer, api: KubeAPI) -> None:
    """A server (or proxy) that cannot answer a table answers the pods: the names read
    the same."""
    server.listed = [pod("a", "9"), pod("b", "9")]
    assert [names async for names in api.pod_names("x=y")] == [["a", "b"]]

    async def table(request: web.Request) -> web.StreamResponse:
        assert "as=Table" in request.headers["Accept"]
        assert request.query["includeObject"] == "None"
        columns = [{"name": "Ready", "format": ""}, {"name": "Name", "format": "name"}]
        rows = [{"cells": ["1/1", "c"], "object": None}, {"cells": ["0/1", "d"], "object": None}]
        body = {"kind": "Table", "columnDefinitions": columns, "rows": rows, "metadata": {}}
        return web.json_response(body)

    async with loopback({"/api/v1/namespaces/ns/pods": table}) as url, kube_api(url) as client:
        assert [names async for names in client.pod_names("x=y")] == [["c", "d"]]
