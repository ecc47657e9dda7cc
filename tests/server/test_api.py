"""The JSON API in-process (httpx.ASGITransport) over a pool on the fake provider."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig
from sandman.server import LABEL_TENANT, ServerSettings, TenantLimits, create_app, service_of
from sandman.testing import FakeProvider
from tests.server.conftest import AUTH_A, AUTH_B, settings
from tests.support import OwnerRecords, eventually

pytestmark = pytest.mark.anyio


async def open_session(api: httpx.AsyncClient, **kwargs: Any) -> str:
    response = await api.post("/v1/sessions", **kwargs)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def acquire(api: httpx.AsyncClient, session: str, image: str = "task", **extra: Any) -> Any:
    body = {"spec": {"image": image}, "session": session, **extra}
    return await api.post("/v1/sandboxes", json=body)


def sample(text: str, series: str) -> float:
    """The value of one series in Prometheus's text format."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in the metrics")


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


async def test_health_needs_no_key(api: httpx.AsyncClient) -> None:
    response = await api.get("/v1/health", headers={"Authorization": ""})
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    assert response.json()["provider"] == "fake"


@pytest.mark.parametrize(
    "authorization", [None, "Bearer nope-nope-nope-nope", "Basic YTpi", "Bearer "]
)
async def test_requests_without_a_valid_key_are_refused(
    app: FastAPI, fake: FakeProvider, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=headers) as c:
        for method, path in [("POST", "/v1/sessions"), ("GET", "/v1/sandboxes"),
                             ("GET", "/v1/sandboxes/x"), ("DELETE", "/v1/sandboxes/x")]:  # fmt: skip
            response = await c.request(method, path)
            assert response.status_code == 401, (method, path, response.text)
            assert error_code(response) == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
    assert fake.calls == [("list", "")]  # the pool's start-up reconcile, nothing else


async def test_sessions_open_heartbeat_close(api: httpx.AsyncClient, pool: Pool) -> None:
    response = await api.post("/v1/sessions", json={"lease_seconds": 12})
    assert response.status_code == 201
    session = response.json()["id"]
    assert response.json()["lease_seconds"] == 12
    beat = await api.post(f"/v1/sessions/{session}/heartbeat")
    assert beat.status_code == 200 and beat.json() == {"id": session, "lease_seconds": 12}
    assert (await api.delete(f"/v1/sessions/{session}")).status_code == 204
    response = await api.post(f"/v1/sessions/{session}/heartbeat")
    assert response.status_code == 404 and error_code(response) == "session_expired"
    assert pool.stats()["sessions"] == 0


async def test_acquire_get_list_release(api: httpx.AsyncClient, fake: FakeProvider) -> None:
    session = await open_session(api)
    response = await acquire(api, session, timeout=5)
    assert response.status_code == 201, response.text
    sandbox = response.json()
    assert sandbox["state"] == "leased" and sandbox["session"] == session
    assert sandbox["spec"]["labels"][LABEL_TENANT] == "a"
    assert "handed_out" in sandbox["timeline"]
    sid = sandbox["id"]
    assert fake.live == 1

    got = (await api.get(f"/v1/sandboxes/{sid}", params={"probe": "true"})).json()
    assert got["id"] == sid and got["running"] is True
    listed = (await api.get("/v1/sandboxes", params={"session": session})).json()["sandboxes"]
    assert [s["id"] for s in listed] == [sid]
    assert listed[0]["endpoint"] is None  # never in lists
    for params in ({"state": "ready"}, {"image": "other"}, {"session": "s-other"}):
        assert (await api.get("/v1/sandboxes", params=params)).json()["sandboxes"] == []
    assert len((await api.get("/v1/sandboxes", params={"image": "task"})).json()["sandboxes"]) == 1

    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    await eventually(lambda: fake.live == 0)
    # Gone, but still visible for a while, with its whole timeline.
    got = (await api.get(f"/v1/sandboxes/{sid}")).json()
    assert got["state"] == "gone" and "gone" in got["timeline"]
    gone = (await api.get("/v1/sandboxes", params={"state": "gone"})).json()["sandboxes"]
    assert [s["id"] for s in gone] == [sid]
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204  # idempotent


async def test_a_release_can_answer_what_the_sandbox_used(
    api: httpx.AsyncClient, fake: FakeProvider
) -> None:
    session = await open_session(api)
    sid = (await acquire(api, session)).json()["id"]
    released = await api.delete(f"/v1/sandboxes/{sid}", params={"usage": "true"})
    assert released.status_code == 200, released.text
    assert released.json() is None  # the fake provider cannot tell
    await eventually(lambda: fake.live == 0)
    again = await api.delete(f"/v1/sandboxes/{sid}", params={"usage": "true"})
    assert again.status_code == 200 and again.json() is None  # idempotent
    missing = await api.delete("/v1/sandboxes/sb-nonexistent", params={"usage": "true"})
    assert missing.status_code == 404 and error_code(missing) == "sandbox_not_found"
    assert (await api.delete(f"/v1/sandboxes/{sid}", params={"usage": "maybe"})).status_code == 422


async def test_closing_a_session_releases_its_sandboxes(
    api: httpx.AsyncClient, fake: FakeProvider
) -> None:
    session = await open_session(api)
    for _ in range(3):
        assert (await acquire(api, session)).status_code == 201
    assert fake.live == 3
    assert (await api.delete(f"/v1/sessions/{session}")).status_code == 204
    await eventually(lambda: fake.live == 0)


async def test_a_tenant_never_sees_or_touches_another_tenants_things(
    app: FastAPI, api: httpx.AsyncClient, fake: FakeProvider, pool: Pool
) -> None:
    session = await open_session(api)
    sid = (await acquire(api, session)).json()["id"]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as b:
        assert (await b.get("/v1/sandboxes")).json()["sandboxes"] == []
        assert (await b.get("/v1/sandboxes", params={"session": session})).json() == {
            "sandboxes": []
        }
        for method, path in [
            ("GET", f"/v1/sandboxes/{sid}"),
            ("DELETE", f"/v1/sandboxes/{sid}"),
            ("GET", f"/v1/sandboxes/{sid}/daemon/v1/health"),
            ("POST", f"/v1/sandboxes/{sid}/daemon/v1/exec"),
        ]:
            response = await b.request(method, path)
            assert response.status_code == 404, (method, path)
            assert error_code(response) == "sandbox_not_found"
            assert sid not in response.text or "no sandbox" in response.text
        for method, path in [
            ("POST", f"/v1/sessions/{session}/heartbeat"),
            ("DELETE", f"/v1/sessions/{session}"),
        ]:
            response = await b.request(method, path)
            assert response.status_code == 404 and error_code(response) == "session_expired"
        # Acquiring into another tenant's session is refused too.
        response = await acquire(b, session)
        assert response.status_code == 404 and error_code(response) == "session_expired"
        # A spec that claims another tenant's label (any sandman.io/ label) is refused.
        own = await open_session(b)
        body = {"spec": {"image": "task", "labels": {LABEL_TENANT: "a"}}, "session": own}
        claimed = await b.post("/v1/sandboxes", json=body)
        assert claimed.status_code == 422 and error_code(claimed) == "invalid_request"
        assert "reserved" in claimed.json()["error"]["message"]
        # Nor may it turn the system-call filter off, or name a host file as its profile.
        for seccomp in ("unconfined", "/etc/shadow"):
            loose = {**body, "spec": {"image": "task", "seccomp": seccomp}}
            refused = await b.post("/v1/sandboxes", json=loose)
            assert refused.status_code == 422 and "not allowed" in refused.text
        mine = (await b.post("/v1/sandboxes", json={**body, "spec": {"image": "task"}})).json()
        assert mine["spec"]["labels"][LABEL_TENANT] == "b"
        assert [s["id"] for s in (await api.get("/v1/sandboxes")).json()["sandboxes"]] == [sid]
    assert pool.get(sid).state == "leased"
    assert (await api.get(f"/v1/sandboxes/{sid}")).status_code == 200


async def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    api: httpx.AsyncClient, fake: FakeProvider, pool: Pool
) -> None:
    session = await open_session(api)
    before = list(fake.calls)
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"json": {"spec": {"image": "task", "cpu": 0}, "session": session}}, 422, "invalid_request"),
        ({"json": {"spec": {"image": "task", "memory": 1}, "session": session}}, 422, "invalid_request"),
        ({"json": {"spec": {"image": ""}, "session": session}}, 422, "invalid_request"),
        ({"json": {"spec": {"image": "task", "gpus": 8}, "session": session}}, 422, "invalid_request"),
        ({"json": {"spec": {"image": "task"}, "session": session, "timeout": -1}}, 422, "invalid_request"),
        ({"json": {"session": session}}, 422, "invalid_request"),
        ({"json": [1, 2]}, 422, "invalid_request"),
        ({"content": b'{"spec": {"image": "task"', "headers": {"content-type": "application/json"}},
         400, "malformed_json"),
        ({"content": b"x" * (2 << 20), "headers": {"content-type": "application/json"}},
         413, "body_too_large"),
        ({"json": {"spec": {"image": "task"}, "session": "s-nonexistent"}}, 404, "session_expired"),
    ]  # fmt: skip
    for kwargs, status, code in cases:
        response = await api.post("/v1/sandboxes", **kwargs)
        assert (response.status_code, error_code(response)) == (status, code), response.text
        assert response.json()["error"]["message"]
    assert fake.calls == before and pool.list() == []
    # Unknown ids and routes.
    for method, path, code in [
        ("GET", "/v1/sandboxes/sb-nope", "sandbox_not_found"),
        ("DELETE", "/v1/sandboxes/sb-nope", "sandbox_not_found"),
        ("GET", "/v1/nothing-here", "not_found"),
    ]:
        response = await api.request(method, path)
        assert (response.status_code, error_code(response)) == (404, code)
    response = await api.put("/v1/sessions")
    assert (response.status_code, error_code(response)) == (405, "method_not_allowed")
    assert "POST" in response.headers["allow"]


async def test_a_body_too_large_without_content_length_is_refused(
    api: httpx.AsyncClient, pool: Pool
) -> None:
    async def chunks() -> Any:
        for _ in range(40):
            yield b" " * 65536

    response = await api.post("/v1/sessions", content=chunks())
    assert (response.status_code, error_code(response)) == (413, "body_too_large")
    assert pool.stats()["sessions"] == 0


async def test_an_image_error_is_a_4xx_and_leaves_nothing(
    api: httpx.AsyncClient, fake: FakeProvider, pool: Pool
) -> None:
    fake.faults.image_errors = frozenset({"no-such-image"})
    session = await open_session(api)
    response = await acquire(api, session, "no-such-image", timeout=5)
    assert (response.status_code, error_code(response)) == (422, "image_error")
    assert "no-such-image" in response.json()["error"]["message"]
    await eventually(lambda: pool.list() == [] and fake.live == 0)


async def test_a_deadline_is_a_504_with_a_stable_code(
    api: httpx.AsyncClient, fake: FakeProvider
) -> None:
    fake.faults.create_latency = 0.5
    session = await open_session(api)
    response = await acquire(api, session, timeout=0.05)
    assert (response.status_code, error_code(response)) == (504, "create_timeout")
    # The sandbox made for nobody is deleted.
    await eventually(lambda: fake.created_total == 1 and fake.live == 0)


async def test_an_expired_session(fake: FakeProvider) -> None:
    async with Pool(fake, PoolConfig(name="t", lease=0.2)) as pool:
        app = create_app(pool, settings())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://x", headers=AUTH_A
        ) as api:
            session = await open_session(api)
            assert (await acquire(api, session)).status_code == 201
            await eventually(lambda: pool.stats()["sessions"] == 0)
            for response in [
                await api.post(f"/v1/sessions/{session}/heartbeat"),
                await acquire(api, session),
            ]:
                assert (response.status_code, error_code(response)) == (404, "session_expired")
            await eventually(lambda: fake.live == 0)


async def test_per_tenant_limits(fake: FakeProvider) -> None:
    limits = {"a": TenantLimits(max_sandboxes=2, max_pending=1)}
    async with Pool(fake, PoolConfig(name="t")) as pool:
        app = create_app(pool, settings(tenant_limits=limits))
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as a,
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as b,
        ):
            session = await open_session(a)
            first = (await acquire(a, session)).json()["id"]
            fake.faults.create_latency = 0.3
            waiting = asyncio.ensure_future(acquire(a, session))
            await eventually(lambda: service_of(app).queue_depths() == {"a": 1})
            response = await acquire(a, session)
            assert (response.status_code, error_code(response)) == (429, "tenant_pending_limit")
            assert response.headers["retry-after"] == "1"
            assert (await waiting).status_code == 201
            response = await acquire(a, session)
            assert (response.status_code, error_code(response)) == (429, "tenant_sandbox_limit")
            # Other tenants are not limited by a's limits.
            fake.faults.create_latency = 0
            other = await open_session(b)
            assert (await acquire(b, other)).status_code == 201
            assert (await acquire(b, other)).status_code == 201
            assert (await acquire(b, other)).status_code == 201
            # Releasing makes room again.
            assert (await a.delete(f"/v1/sandboxes/{first}")).status_code == 204
            await eventually(lambda: all(r.id != first for r in pool.list()))
            assert (await acquire(a, session)).status_code == 201


async def test_pod_settings_that_reach_past_a_tenant_need_the_operators_grant(
    fake: FakeProvider,
) -> None:
    """A tenant's spec must not pull with someone else's registry secret, preempt other
    jobs, pick a weaker runtime class or land on nodes kept for others, unless its
    limits grant it; smaller resource requests are always its own to ask."""
    granted = TenantLimits(
        image_pull_secrets=["a-registry"], priority_classes=["batch-low"],
        runtime_classes=["gvisor"], pod_placement=True,
    )  # fmt: skip
    async with Pool(fake, PoolConfig(name="t")) as pool:
        app = create_app(pool, settings(tenant_limits={"a": granted}))
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as a,
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as b,
        ):
            asks = [
                ({"image_pull_secrets": ["a-registry"]}, "image pull secrets a-registry"),
                ({"priority_class_name": "batch-low"}, "priority class batch-low"),
                ({"runtime_class_name": "gvisor"}, "runtime class gvisor"),
                ({"node_selector": {"pool": "gpu"}}, "node_selector, tolerations"),
                ({"tolerations": [{"operator": "Exists"}]}, "node_selector, tolerations"),
                ({"affinity": {"nodeAffinity": {}}}, "node_selector, tolerations"),
            ]
            for client, tenant in ((a, "a"), (b, "b")):
                session = await open_session(client)
                for options, named in asks:
                    spec = {"image": "task", "kubernetes": options}
                    body = {"spec": spec, "session": session}
                    response = await client.post("/v1/sandboxes", json=body)
                    if tenant == "a":
                        assert response.status_code == 201, (options, response.text)
                    else:
                        assert (response.status_code, error_code(response)) == (
                            422, "invalid_request"
                        ), options  # fmt: skip
                        assert named in response.json()["error"]["message"]
                spec = {"image": "task", "kubernetes": {"cpu_request": 0.25}}
                response = await client.post(
                    "/v1/sandboxes", json={"spec": spec, "session": session}
                )
                assert response.status_code == 201
            # A grant names what it grants, and nothing else.
            session = await open_session(a)
            spec = {"image": "task", "kubernetes": {"image_pull_secrets": ["b-registry"]}}
            response = await a.post("/v1/sandboxes", json={"spec": spec, "session": session})
            assert (response.status_code, error_code(response)) == (422, "invalid_request")
            assert "b-registry not allowed here (allowed: a-registry)" in response.text
            assert len([r for r in pool.list() if r.state == "leased"]) == len(asks) + 2


async def test_a_session_a_live_predecessor_still_holds_is_moving_not_expired() -> None:
    """Two replicas of the service overlap (an eviction started this one before the last
    had gone): a client's session is unknown here, but the other replica's sandboxes
    still hold it. Its tenant hears ``session_moving`` (503, retry), not
    ``session_expired`` (which makes the SDK give its sandboxes up); once the other has
    left them, this one adopts them and the session goes on. Another tenant learns
    nothing of it."""
    records = OwnerRecords(FakeProvider(daemon=False, seed=3))
    records.statuses["k.old"], records.versions["k.old"] = "alive", "1"
    labels = {"sandman.io/pool": "t", "sandman.io/session": "s-moving",
              "sandman.io/expires-at": "1e12", "sandman.io/owner": "k.old", LABEL_TENANT: "a"}  # fmt: skip
    theirs = await records.create(SandboxSpec(image="task"), labels=labels)
    config = PoolConfig(name="t", adopt_orphans=True, reconcile_interval=0.05, lease=1.0)
    renewing = True

    async def renew() -> None:  # the old replica renews its record while this one starts
        version = 1
        while renewing:
            await asyncio.sleep(0.05)
            version += 1
            records.versions["k.old"] = str(version)

    renewer = asyncio.ensure_future(renew())
    try:
        async with Pool(records, config) as pool:
            app = create_app(pool, settings())
            transport = httpx.ASGITransport(app=app)
            async with (
                httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as a,
                httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as b,
            ):
                beat = "/v1/sessions/s-moving/heartbeat"
                response = await a.post(beat)
                assert (response.status_code, error_code(response)) == (503, "session_moving")
                assert response.headers["retry-after"] == "2"
                response = await b.post(beat)
                assert (response.status_code, error_code(response)) == (404, "session_expired")
                renewing = False
                await renewer
                del records.statuses["k.old"]  # it left them and removed its record

                async def beats() -> bool:
                    return (await a.post(beat)).status_code == 200

                await eventually(beats, what="the session adopted here")
                assert pool.get(theirs.id).state == "leased"
                listed = (await a.get("/v1/sandboxes", params={"session": "s-moving"})).json()
                assert [s["id"] for s in listed["sandboxes"]] == [theirs.id]
    finally:
        renewer.cancel()
        await records.aclose()


async def test_a_cancelled_acquire_hands_its_sandbox_to_the_next_waiter(
    fake: FakeProvider, serial_pool: Pool
) -> None:
    app = create_app(serial_pool, settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as api:
        session = await open_session(api)
        impatient = asyncio.ensure_future(acquire(api, session))
        await eventually(lambda: fake.creating == 1)
        patient = asyncio.ensure_future(acquire(api, session, timeout=5))
        await eventually(lambda: service_of(app).queue_depths() == {"a": 2})
        impatient.cancel()
        response = await patient
        assert response.status_code == 201
        assert fake.created_total == 1  # handed over, not made again
        await eventually(lambda: service_of(app).queue_depths() == {})


async def test_metrics(api: httpx.AsyncClient, fake: FakeProvider, pool: Pool) -> None:
    session = await open_session(api)
    sid = (await acquire(api, session)).json()["id"]
    text = (await api.get("/metrics", headers={"Authorization": ""})).text
    assert 'sandman_sandboxes{pool="t",state="leased"} 1.0' in text
    assert 'sandman_sandboxes{pool="t",state="queued"} 0.0' in text
    assert 'sandman_sessions{pool="t"} 1.0' in text
    assert 'sandman_ready_seconds_count{pool="t"} 1.0' in text
    assert 'sandman_create_seconds_count{pool="t"} 1.0' in text
    assert 'sandman_acquire_seconds_count{outcome="ok",pool="t"} 1.0' in text
    assert 'sandman_pacing_rate{pool="t"}' in text
    assert 'sandman_pacing_window{pool="t"}' in text
    await api.delete(f"/v1/sandboxes/{sid}")
    await eventually(lambda: fake.live == 0)
    fake.faults.image_errors = frozenset({"bad"})
    assert (await acquire(api, session, "bad")).status_code == 422
    fake.faults.create_latency = 0.5
    waiting = asyncio.ensure_future(acquire(api, session))
    await eventually(lambda: fake.creating == 1)
    text = (await api.get("/metrics")).text
    assert 'sandman_queue_depth{pool="t"} 1.0' in text
    assert 'tenant="' not in text  # no key was given: no tenant is named
    assert sample(text, 'sandman_delete_seconds_count{pool="t"}') >= 1
    # A missing image is the caller's mistake, counted apart from backend strain.
    errors = 'sandman_backend_errors_total{kind="other",operation="create",pool="t"}'
    assert sample(text, errors) == 1
    assert 'sandman_acquire_seconds_count{outcome="image_error",pool="t"} 1.0' in text
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting


async def test_shutdown_finishes_hand_overs_then_releases_everything(fake: FakeProvider) -> None:
    pool = Pool(fake, PoolConfig(name="t"))
    await pool.start()
    app = create_app(pool, settings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as api:
        session = await open_session(api)
        assert (await acquire(api, session)).status_code == 201
        fake.faults.create_latency = 0.3
        in_flight = asyncio.ensure_future(acquire(api, session))
        await eventually(lambda: fake.creating == 1)
        shutdown = asyncio.ensure_future(service_of(app).shutdown())
        await eventually(lambda: not service_of(app).accepting)
        response = await api.post("/v1/sessions")
        assert (response.status_code, error_code(response)) == (503, "shutting_down")
        health = await api.get("/v1/health")
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        assert (await in_flight).status_code == 201  # the hand-over in flight finished
        await shutdown
    assert fake.live == 0


async def test_shutdown_can_leave_sandboxes_for_the_next_instance(fake: FakeProvider) -> None:
    first = Pool(fake, PoolConfig(name="t"))
    await first.start()
    app = create_app(first, settings(release_on_shutdown=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as api:
        session = await open_session(api)
        sid = (await acquire(api, session)).json()["id"]
        await service_of(app).shutdown()
    assert fake.live == 1
    # The next instance adopts it; the tenant's session carries on, the other's sees nothing.
    async with Pool(fake, PoolConfig(name="t", adopt_orphans=True)) as second:
        app = create_app(second, settings())
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_A) as api,
            httpx.AsyncClient(transport=transport, base_url="http://x", headers=AUTH_B) as b,
        ):
            assert (await b.post(f"/v1/sessions/{session}/heartbeat")).status_code == 404
            assert (await b.get(f"/v1/sandboxes/{sid}")).status_code == 404
            assert (await api.post(f"/v1/sessions/{session}/heartbeat")).status_code == 200
            assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "leased"
            assert (await api.delete(f"/v1/sessions/{session}")).status_code == 204
            await eventually(lambda: fake.live == 0)


def test_anonymous_access_is_off_unless_configured() -> None:
    assert ServerSettings().anonymous_tenant is None
    parsed = ServerSettings.model_validate({"api_keys": "a:0123456789abcdef, b:fedcba9876543210,"})
    assert [(k.tenant, k.key.get_secret_value()) for k in parsed.api_keys] == [
        ("a", "0123456789abcdef"), ("b", "fedcba9876543210"),
    ]  # fmt: skip
    assert "0123456789abcdef" not in repr(parsed)
    with pytest.raises(ValueError, match="twice"):
        ServerSettings.model_validate({"api_keys": "a:0123456789abcdef,b:0123456789abcdef"})
    with pytest.raises(ValueError):
        ServerSettings.model_validate({"api_keys": "Not A Tenant:0123456789abcdef"})


async def test_anonymous_tenant(pool: Pool) -> None:
    app = create_app(pool, ServerSettings(anonymous_tenant="local", close_pool=False))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as api:
        session = await open_session(api)
        assert (await acquire(api, session)).json()["spec"]["labels"][LABEL_TENANT] == "local"
