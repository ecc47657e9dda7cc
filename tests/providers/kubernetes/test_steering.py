"""The provider's node list for image steering, against a real HTTP server on loopback.

The server answers ``GET /api/v1/nodes`` as the API server does (paged, or
with a 403/500 Status); KubeAPI and NodeImages are the provider's own.
tests/kube/test_steering.py runs the same against the harness cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from sandman.providers.kubernetes.api import KubeAPI
from sandman.providers.kubernetes.steering import NodeImages
from tests.providers.kubernetes.conftest import kube_api, loopback

pytestmark = pytest.mark.anyio

IMAGE = "r.io/task:1"


def node(name: str, *images: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"images": [{"names": [i]} for i in images]}}


@dataclass
class FakeServer:
    """What the API server answers for nodes: `nodes` two per page, or `status` with an error."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    requests: int = 0
    hold: asyncio.Event | None = None
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.status != 200:
            body = {"kind": "Status", "message": f"nodes is forbidden ({self.status})"}
            return web.json_response(body, status=self.status)
        start = int(request.query.get("continue", "0"))
        page = self.nodes[start : start + 2]
        more = start + 2 < len(self.nodes)
        metadata = {"continue": str(start + 2)} if more else {}
        return web.json_response({"kind": "NodeList", "items": page, "metadata": metadata})


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    async with loopback({"/api/v1/nodes": fake.handle}) as fake.url:
        try:
            yield fake
        finally:
            if fake.hold is not None:
                fake.hold.set()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api(server: FakeServer) -> AsyncIterator[KubeAPI]:
    async with kube_api(server.url) as client:
        yield client


def nodes_in(term: dict[str, Any] | None) -> list[str]:
    assert term is not None
    assert term["weight"] == 80
    [expression] = term["preference"]["matchFields"]
    assert expression["key"] == "metadata.name"
    values: list[str] = expression["values"]
    return values


async def test_concurrent_creates_share_one_paged_list(server: FakeServer, api: KubeAPI) -> None:
    server.nodes = [node(f"n{i}", IMAGE if i % 2 else "other:1") for i in range(5)]
    steering = NodeImages(api)
    try:
        terms = await asyncio.gather(*(steering.term(IMAGE) for _ in range(20)))
        assert all(nodes_in(term) == ["n1", "n3"] for term in terms)
        assert await steering.term("not/held:1") is None
        # Five nodes at two a page: three requests for the one list, none more.
        assert server.requests == 3
    finally:
        await steering.aclose()


async def test_the_list_is_refreshed_after_the_interval_without_making_creates_wait(
    server: FakeServer, api: KubeAPI
) -> None:
    server.nodes = [node("a", IMAGE)]
    clock = Clock()
    steering = NodeImages(api, refresh=30, clock=clock)
    try:
        assert nodes_in(await steering.term(IMAGE)) == ["a"]
        clock.now += 29
        server.nodes = [node("b", IMAGE)]
        assert nodes_in(await steering.term(IMAGE)) == ["a"]
        assert server.requests == 1
        clock.now += 2
        server.hold = asyncio.Event()
        # Stale: the next list is under way, the last one answers at once meanwhile.
        async with asyncio.timeout(2):
            assert nodes_in(await steering.term(IMAGE)) == ["a"]
        async with asyncio.timeout(5):
            while server.requests < 2:  # the list in the background reaches the server
                await asyncio.sleep(0.01)
        assert nodes_in(await steering.term(IMAGE)) == ["a"]
        server.hold.set()
        async with asyncio.timeout(5):
            while nodes_in(await steering.term(IMAGE)) != ["b"]:
                await asyncio.sleep(0.01)
        assert server.requests == 2
    finally:
        await steering.aclose()


async def test_forbidden_turns_steering_off_with_one_warning(
    server: FakeServer, api: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    server.status = 403
    clock = Clock()
    steering = NodeImages(api, refresh=30, clock=clock)
    with caplog.at_level(logging.WARNING, logger="sandman.providers.kubernetes.steering"):
        assert await steering.term(IMAGE) is None
        clock.now += 100
        assert await steering.term(IMAGE) is None
    assert steering.enabled is False
    assert server.requests == 1
    [record] = caplog.records
    assert "may not list nodes" in record.getMessage()
    assert "deploy/node-reader" in record.getMessage()


async def test_a_failed_list_is_no_failure_and_is_tried_again_later(
    server: FakeServer, api: KubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    server.status = 500
    clock = Clock()
    steering = NodeImages(api, refresh=30, clock=clock)
    try:
        with caplog.at_level(logging.WARNING, logger="sandman.providers.kubernetes.steering"):
            assert await steering.term(IMAGE) is None
            assert await steering.term(IMAGE) is None  # within the interval: no retry
        assert server.requests == 1
        assert "listing nodes for image steering failed" in caplog.text
        assert steering.enabled is True
        server.status = 200
        server.nodes = [node("a", IMAGE)]
        clock.now += 31
        assert nodes_in(await steering.term(IMAGE)) == ["a"]
        assert server.requests == 2
    finally:
        await steering.aclose()


async def test_a_slow_first_list_delays_a_create_briefly_at_most(
    server: FakeServer, api: KubeAPI
) -> None:
    server.nodes = [node("a", IMAGE)]
    server.hold = asyncio.Event()
    steering = NodeImages(api, first_wait=0.2)
    try:
        async with asyncio.timeout(2):
            assert await steering.term(IMAGE) is None
        server.hold.set()
        async with asyncio.timeout(5):
            while await steering.term(IMAGE) is None:
                await asyncio.sleep(0.01)
        assert nodes_in(await steering.term(IMAGE)) == ["a"]
    finally:
        await steering.aclose()


async def test_an_unparseable_image_gets_no_term(server: FakeServer, api: KubeAPI) -> None:
    server.nodes = [node("a", IMAGE)]
    steering = NodeImages(api)
    try:
        assert await steering.term("Not An Image") is None
    finally:
        await steering.aclose()
