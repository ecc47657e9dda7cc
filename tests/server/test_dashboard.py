"""The dashboard: the sampler and its JSON (in-process, fake provider), and the page in
headless Chromium over a real service, a real pool and the local provider."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import sandman
from sandman.models import SandboxSpec
from sandman.pool import Pool, PoolConfig, PoolEvent
from sandman.server import LABEL_TENANT, ApiKey, ServerSettings, create_app
from sandman.server.dashboard import BUCKETS, NO_TENANT, OTHER_TENANTS, Sampler
from sandman.server.schemas import DashboardOut
from sandman.testing import FakeProvider
from tests.server.conftest import AUTH_A, AUTH_B, KEY_A, KEY_B, serve_in_thread, settings
from tests.support import alive, eventually

pytestmark = pytest.mark.anyio


def _spec(image: str, tenant: str) -> SandboxSpec:
    # As the service labels it (a caller's spec may not name a sandman.io/ label).
    return SandboxSpec(image=image).model_copy(update={"labels": {LABEL_TENANT: tenant}})


@pytest.fixture
async def sampled() -> AsyncIterator[tuple[Pool, Sampler, FakeProvider]]:
    """A fake-provider pool with a sampler whose samples the test takes itself."""
    async with FakeProvider(daemon=False, seed=5) as fake:
        pool = Pool(fake, PoolConfig(name="unit"))
        sampler = Sampler(pool, keep=4, interval=3600)  # the test takes the samples
        pool.add_hook(sampler.hook)
        async with pool:
            try:
                yield pool, sampler, fake
            finally:
                await sampler.aclose()
        assert fake.live == 0


async def test_samples_hold_the_states_and_the_events_of_their_second(
    sampled: tuple[Pool, Sampler, FakeProvider],
) -> None:
    pool, sampler, _ = sampled
    session = pool.open_session()
    before = sampler.sample(1000.0)
    assert before.states["leased"] == 0 and before.started == before.completed == 0
    records = await asyncio.gather(*(pool.acquire(_spec("img", "a"), session=session)
                                     for _ in range(3)))  # fmt: skip
    burst = sampler.sample(1001.0)
    assert burst.states["leased"] == 3
    assert (burst.started, burst.completed, burst.failed, burst.deleted) == (3, 3, 0, 0)
    for record in records:
        pool.release(record.id)
    await eventually(lambda: not pool.list())
    after = sampler.sample(1002.0)
    assert after.states["leased"] == 0 and after.started == 0 and after.deleted == 3
    # A ring: the oldest sample goes first.
    sampler.sample(1003.0)
    sampler.sample(1004.0)
    view = sampler.view("a", now=1004.0, seconds=3600)
    assert [s.t for s in view.samples] == [1001.0, 1002.0, 1003.0, 1004.0]
    # Only the samples of the last `seconds`.
    assert [s.t for s in sampler.view("a", now=1004.0, seconds=1.5).samples] == [1003.0, 1004.0]


async def test_a_tenant_sees_its_own_images_and_errors_and_the_pool_as_a_whole(
    sampled: tuple[Pool, Sampler, FakeProvider],
) -> None:
    pool, sampler, fake = sampled
    fake.faults.image_errors = frozenset({"broken-a", "broken-b"})
    session = pool.open_session()
    for image, tenant in [("img-a", "a"), ("img-a", "a"), ("tools", "a"), ("img-b", "b")]:
        await pool.acquire(_spec(image, tenant), session=session)
    for image, tenant in [("broken-a", "a"), ("broken-b", "b")]:
        with pytest.raises(sandman.ImageError):
            await pool.acquire(_spec(image, tenant), session=session)
    await eventually(lambda: len(pool.list()) == 4)  # the failed ones deleted
    view = sampler.view("a", now=time.time())
    assert view.tenant == "a" and view.pool == "unit" and view.provider == fake.name
    assert view.states["leased"] == 4 and view.sessions == 1
    assert [(g.name, g.total, g.states) for g in view.tenants] == [
        ("a", 3, {"leased": 3}), (OTHER_TENANTS, 1, {"leased": 1}),
    ]  # fmt: skip
    assert [(g.name, g.total) for g in view.images] == [("img-a", 2), ("tools", 1)]
    assert [(e.event, e.image) for e in view.errors] == [("create.failed", "broken-a")]
    assert "broken-b" not in view.model_dump_json() and "img-b" not in view.model_dump_json()
    seen_by_b = sampler.view("b", now=time.time())
    assert [(g.name, g.total) for g in seen_by_b.images] == [("img-b", 1)]
    assert [e.image for e in seen_by_b.errors] == ["broken-b"]
    # The backend's own errors (no sandbox, no tenant) are everyone's.
    sampler.hook(PoolEvent("reconcile.failed", "unit", detail={"error": "list refused"}))
    newest_first = sampler.view("b", now=time.time()).errors
    assert [(e.event, e.image) for e in newest_first] == [
        ("reconcile.failed", None), ("create.failed", "broken-b"),
    ]  # fmt: skip
    assert newest_first[0].message == "list refused"
    pool.close_session(session)
    await eventually(lambda: not pool.list())


def test_readiness_is_a_histogram_with_quantiles_of_the_window() -> None:
    pool = Pool(FakeProvider(daemon=False))
    sampler = Sampler(pool)
    for at, seconds in [(10.0, 0.03), (100.0, 0.3), (100.0, 0.4), (100.0, 7.0), (100.0, 500.0)]:
        sampler.hook(PoolEvent("create.complete", "p", "sb-x", at=at, detail={"seconds": seconds}))
    sampler.hook(PoolEvent("create.complete", "p", "sb-y", at=100.0, detail={"seconds": math.nan}))
    view = sampler.view("a", now=101.0, seconds=60)
    counts = {b.le: b.count for b in view.readiness}
    assert list(counts) == [*BUCKETS, None]
    assert (counts[0.5], counts[10.0], counts[None], counts[0.05]) == (2, 1, 1, 0)
    assert view.readiness_count == sum(counts.values()) == 4
    assert (view.readiness_p50, view.readiness_p95) == (0.4, 500.0)
    everything = sampler.view("a", now=101.0, seconds=3600)
    assert everything.readiness_count == 5 and everything.readiness_p50 == 0.4
    empty = sampler.view("a", now=10_000.0, seconds=60)
    assert empty.readiness_count == 0 and empty.readiness_p50 is None
    # The pacer has no latency yet: NaN is no JSON, so it is None.
    assert empty.pacing.latency is None and empty.pacing.window is not None
    with pytest.raises(ValueError, match="interval"):
        Sampler(pool, interval=0)


async def test_the_sampling_task_starts_with_the_first_read_and_stops_at_close() -> None:
    pool = Pool(FakeProvider(daemon=False))
    sampler = Sampler(pool, interval=0.05)
    first = sampler.view("a", now=time.time())
    assert first.samples == [] and first.interval == 0.05
    await eventually(lambda: len(sampler.view("a", now=time.time()).samples) >= 3)
    await sampler.aclose()
    count = len(sampler.view("a", now=time.time(), seconds=3600).samples)
    await asyncio.sleep(0.2)  # would hold ~4 more samples if the task still ran
    assert len(sampler.view("a", now=time.time(), seconds=3600).samples) == count


async def test_the_route_needs_a_key_and_answers_the_keys_tenant(
    api: httpx.AsyncClient, app: FastAPI, pool: Pool
) -> None:
    session = pool.open_session()
    await pool.acquire(_spec("image-of-b", "b"), session=session)
    try:
        refused = await api.get("/v1/dashboard", headers={"Authorization": ""})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
        answer = await api.get("/v1/dashboard", params={"seconds": 60})
        assert answer.status_code == 200
        view = DashboardOut.model_validate(answer.json())
        assert view.tenant == "a" and view.states["leased"] == 1
        assert [(g.name, g.total) for g in view.tenants] == [("a", 0), (OTHER_TENANTS, 1)]
        assert "image-of-b" not in answer.text
        as_b = await api.get("/v1/dashboard", headers=AUTH_B)
        assert [g.name for g in DashboardOut.model_validate(as_b.json()).images] == ["image-of-b"]
        bad = await api.get("/v1/dashboard", params={"seconds": 1})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
        assert "/v1/dashboard" in app.openapi()["paths"]
    finally:
        await app.state.dashboard.aclose()
        pool.close_session(session)


KEY_OPS = "key-of-the-operators-0123456789"
AUTH_OPS = {"Authorization": f"Bearer {KEY_OPS}"}


def _with_ops(**overrides: Any) -> Any:
    """The conftest's tenants a and b, and an operator tenant ``ops``."""
    keys = [ApiKey(tenant="a", key=KEY_A), ApiKey(tenant="b", key=KEY_B),
            ApiKey(tenant="ops", key=KEY_OPS)]  # fmt: skip
    return settings(api_keys=keys, admin_tenants="ops", **overrides)


async def test_an_operator_sees_every_tenant_image_and_error_apart(
    sampled: tuple[Pool, Sampler, FakeProvider],
) -> None:
    pool, _, fake = sampled
    waiting = {"b": 2, "c": 1, "d": 0}
    sampler = Sampler(pool, interval=3600, queue_depths=lambda: waiting, admins={"ops"})
    pool.add_hook(sampler.hook)
    fake.faults.image_errors = frozenset({"broken-b"})
    session = pool.open_session()
    for image, tenant in [("img-a", "a"), ("img-a", "a"), ("img-b", "b")]:
        await pool.acquire(_spec(image, tenant), session=session)
    await pool.acquire(SandboxSpec(image="spare"), session=session)  # the service's: no tenant
    with pytest.raises(sandman.ImageError):
        await pool.acquire(_spec("broken-b", "b"), session=session)
    sampler.refused("a", "tenant_pending_limit", "too many", image="img-a")
    sampler.refused("a", "create_timeout", "the pool's own failure: a pool event, not kept")
    await eventually(lambda: len(pool.list()) == 4)
    ops = sampler.view("ops", now=time.time())
    assert ops.admin and ops.tenant == "ops"
    assert [(g.name, g.total, g.waiting) for g in ops.tenants] == [
        ("ops", 0, 0), ("b", 1, 2), ("a", 2, 0), ("c", 0, 1), (NO_TENANT, 1, 0),
    ]  # the caller first, then the busiest (held + waiting)  # fmt: skip
    assert [(g.name, g.total) for g in ops.images] == [("img-a", 2), ("img-b", 1), ("spare", 1)]
    assert [(e.event, e.kind, e.tenant, e.image) for e in ops.errors] == [
        ("refused", "tenant_pending_limit", "a", "img-a"),
        ("create.failed", "image_error", "b", "broken-b"),
    ]  # fmt: skip
    # The same sampler, for a tenant: its own apart, the rest (their waiting too) one group.
    a = sampler.view("a", now=time.time())
    assert not a.admin
    assert [(g.name, g.total, g.waiting) for g in a.tenants] == [
        ("a", 2, 0), (OTHER_TENANTS, 2, 3),
    ]  # fmt: skip
    assert [e.kind for e in a.errors] == ["tenant_pending_limit"]
    b = sampler.view("b", now=time.time())
    assert [(g.name, g.waiting) for g in b.tenants] == [("b", 2), (OTHER_TENANTS, 1)]
    assert [e.image for e in b.errors] == ["broken-b"]
    # A flood of refusals keeps the backend's errors visible.
    for i in range(200):
        sampler.refused("a", "invalid_request", f"garbage {i}")
    flooded = sampler.view("ops", now=time.time())
    assert "create.failed" in [e.event for e in flooded.errors]
    await sampler.aclose()
    pool.close_session(session)
    await eventually(lambda: not pool.list())


async def test_the_services_refusals_reach_the_page_of_their_tenant(pool: Pool) -> None:
    app = create_app(pool, _with_ops(default_limits={"max_pending": 0}))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sandman"
    ) as api:
        try:
            session = (await api.post("/v1/sessions", headers=AUTH_A)).json()["id"]
            body = {"spec": {"image": "img-a"}, "session": session}
            limit = await api.post("/v1/sandboxes", json=body, headers=AUTH_A)
            assert limit.json()["error"]["code"] == "tenant_pending_limit"
            garbage = await api.post(
                "/v1/sandboxes", content=b"{not json", headers={**AUTH_A,
                "content-type": "application/json"},
            )  # fmt: skip
            assert garbage.json()["error"]["code"] == "malformed_json"
            bad = await api.post("/v1/sandboxes", json={"spec": {}}, headers=AUTH_A)
            assert bad.json()["error"]["code"] == "invalid_request"
            stranger = await api.post(
                "/v1/sandboxes", content=b"{", headers={"Authorization": "Bearer no-such-key",
                "content-type": "application/json"},
            )  # fmt: skip
            assert stranger.status_code == 400  # no tenant: on nobody's page

            seen = (await api.get("/v1/dashboard", headers=AUTH_A)).json()
            kinds = [(e["event"], e["kind"], e["tenant"]) for e in seen["errors"]]
            assert sorted(kinds) == sorted([
                ("refused", "tenant_pending_limit", "a"), ("refused", "malformed_json", "a"),
                ("refused", "invalid_request", "a"),
            ])  # fmt: skip
            by_kind = {e["kind"]: e for e in seen["errors"]}
            assert by_kind["tenant_pending_limit"]["image"] == "img-a"
            assert "limit 0" in by_kind["tenant_pending_limit"]["message"]
            assert by_kind["invalid_request"]["message"].startswith("POST /v1/sandboxes: ")
            assert (await api.get("/v1/dashboard", headers=AUTH_B)).json()["errors"] == []
            ops = (await api.get("/v1/dashboard", headers=AUTH_OPS)).json()
            assert ops["admin"] is True and len(ops["errors"]) == 3
        finally:
            await app.state.dashboard.aclose()


async def test_acquires_waiting_per_tenant_are_on_the_page(fake: FakeProvider, pool: Pool) -> None:
    app = create_app(pool, _with_ops())
    fake.faults.create_latency = 2.0
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sandman"
    ) as api:

        async def waiting(auth: dict[str, str]) -> list[tuple[str, int]]:
            view = (await api.get("/v1/dashboard", headers=auth)).json()
            return [(g["name"], g["waiting"]) for g in view["tenants"]]

        session = (await api.post("/v1/sessions", headers=AUTH_A)).json()["id"]
        body = {"spec": {"image": "img-a"}, "session": session, "timeout": 30}
        acquires = [asyncio.ensure_future(api.post("/v1/sandboxes", json=body, headers=AUTH_A))
                    for _ in range(2)]  # fmt: skip
        try:
            async with asyncio.timeout(10):
                while await waiting(AUTH_A) != [("a", 2), (OTHER_TENANTS, 0)]:
                    await asyncio.sleep(0.01)
            assert await waiting(AUTH_B) == [("b", 0), (OTHER_TENANTS, 2)]
            assert ("a", 2) in await waiting(AUTH_OPS)
            for acquired in await asyncio.gather(*acquires):
                assert acquired.status_code == 201
            assert await waiting(AUTH_A) == [("a", 0), (OTHER_TENANTS, 0)]
        finally:
            for task in acquires:
                task.cancel()
            await asyncio.gather(*acquires, return_exceptions=True)
            await app.state.dashboard.aclose()
            pool.close_session(session)
        await eventually(lambda: not pool.list())


async def test_the_apps_lifespan_stops_the_sampler(app: FastAPI, api: httpx.AsyncClient) -> None:
    sampler: Sampler = app.state.dashboard
    async with app.router.lifespan_context(app):
        assert (await api.get("/v1/dashboard")).status_code == 200
        assert sampler.running
    assert not sampler.running
    await api.get("/v1/dashboard")  # closed for good: no new task
    assert not sampler.running


def test_admin_tenants_come_from_the_environment_and_need_a_key() -> None:
    environ = {"SANDMAN_API_KEYS": f"a:{KEY_A},ops:{KEY_OPS},sre:{KEY_B}",
               "SANDMAN_ADMIN_TENANTS": " ops, sre ,"}  # fmt: skip
    assert ServerSettings.from_env(environ).admin_tenants == {"ops", "sre"}
    assert ServerSettings.from_env({}).admin_tenants == frozenset()
    with pytest.raises(sandman.ConfigError, match="admin tenants without an API key: typo"):
        ServerSettings.from_env({**environ, "SANDMAN_ADMIN_TENANTS": "ops,typo"})
    with pytest.raises(sandman.ConfigError, match="admin_tenants"):
        ServerSettings.from_env({**environ, "SANDMAN_ADMIN_TENANTS": "Not A Tenant"})
    anonymous = ServerSettings(anonymous_tenant="local", admin_tenants=frozenset({"local"}))
    assert anonymous.admin_tenants == {"local"}


async def test_the_page_is_public_static_and_locked_down(api: httpx.AsyncClient) -> None:
    page = await api.get("/", headers={"Authorization": ""})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard.js"' in page.text and "http" not in page.text.split("<body")[1]
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    script = await api.get("/dashboard.js", headers={"Authorization": ""})
    assert script.status_code == 200 and "/v1/dashboard" in script.text
    assert "innerHTML" not in script.text  # strings from the service go in as text only
    style = await api.get("/dashboard.css", headers={"Authorization": ""})
    assert style.status_code == 200 and style.headers["content-type"].startswith("text/css")


# -- the page in Chromium, over the local provider -------------------------------------

needs_root_and_crun = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("crun") is None,
    reason="the local provider needs root and crun (scripts/setup installs crun)",
)
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/setup installs it)"
)


@dataclass
class Served:
    url: str
    pool: Pool
    loop: asyncio.AbstractEventLoop

    def run(self, fn: Any) -> Any:
        """Call ``fn()`` on the server's loop (the pool is not thread-safe) and return its value."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)


@contextlib.contextmanager
def serve_local(busybox_tar: Path) -> Iterator[Served]:
    """The service over a pool of the local provider (images ``busybox`` and ``tools``), on
    127.0.0.1:<free port>. At the end: everything deleted and nothing of it left."""
    from tests.providers.local.fresh import fresh_local_provider

    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[FastAPI, Pool]]:
        async with fresh_local_provider(busybox_tar, ("busybox", "tools")) as provider:
            pool = Pool(provider, PoolConfig(name="dash"))
            yield create_app(pool, settings(close_pool=True)), pool

    served = serve_in_thread(setup, name="uvicorn-local", start_timeout=30, stop_timeout=60)
    with served as (url, pool, loop):
        yield Served(url, pool, loop)


def _descendants(root: int) -> dict[int, str]:
    """Processes below ``root`` now: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            commands[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found


async def _number(page: Any, selector: str, expected: str, timeout: float = 30.0) -> None:
    """Wait until the page shows ``expected`` at ``selector`` (it polls every second)."""
    from playwright.async_api import expect

    await expect(page.locator(selector)).to_have_text(expected, timeout=timeout * 1000)


@needs_root_and_crun
@needs_chromium
async def test_the_page_shows_a_live_burst_in_chromium(busybox_tar: Path, tmp_path: Path) -> None:
    pytest.importorskip("playwright")
    from playwright.async_api import async_playwright, expect

    browsers: dict[int, str] = {}
    with serve_local(busybox_tar) as served:
        try:
            async with (
                sandman.connect(served.url, api_key=KEY_A) as a,
                sandman.connect(served.url, api_key=KEY_B) as b,
                async_playwright() as playwright,
            ):
                browser = await playwright.chromium.launch(
                    executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
                )
                browsers.update(
                    (pid, cmd) for pid, cmd in _descendants(os.getpid()).items() if "chrom" in cmd
                )
                assert browsers, "no chromium process found below the test"
                page = await browser.new_page(viewport={"width": 1280, "height": 1000})
                problems: list[str] = []
                page.on("pageerror", lambda exc: problems.append(str(exc)))
                await page.goto(f"{served.url}/")
                browsers.update(  # and its renderers, now that there is a page
                    (pid, cmd) for pid, cmd in _descendants(os.getpid()).items() if "chrom" in cmd
                )
                # No key yet: the page asks for one, and again when the service refuses it.
                await page.locator("#key-input").fill("not-a-key-0123456789", timeout=15_000)
                await page.locator("#key-form button").click()
                await _number(page, "#key-error", "The service refused this key.")
                await page.locator("#key-input").fill(KEY_A)
                await page.locator("#key-form button").click()
                await _number(page, "#tenant", "a")
                await _number(page, "#count-leased", "0")

                # With the page open, a burst of 20: tenant a 12 busybox + 4 tools, tenant
                # b 4 busybox; and one image nobody has.
                wanted = [(a, "busybox")] * 12 + [(a, "tools")] * 4 + [(b, "busybox")] * 4
                sandboxes = await asyncio.gather(
                    *(client.acquire(image, timeout=45) for client, image in wanted)
                )
                with pytest.raises(sandman.ImageError):
                    await a.acquire("no-such-image", timeout=45)
                assert (await sandboxes[0].exec("echo live")).stdout == "live\n"
                stats = served.run(served.pool.stats)
                assert stats["leased"] == 20

                await _number(page, "#count-leased", "20")
                await _number(page, '#tenants tr[data-name="a"] .total', "16")
                await _number(page, f'#tenants tr[data-name="{OTHER_TENANTS}"] .total', "4")
                await _number(page, '#images tr[data-name="busybox"] .total', "12")
                await _number(page, '#images tr[data-name="tools"] .total', "4")
                await _number(page, "#readiness-count", "20")
                bars = page.locator("#chart-readiness rect")
                counts = [int(await bars.nth(i).get_attribute("data-count") or 0)
                          for i in range(await bars.count())]  # fmt: skip
                assert sum(counts) == 20, counts
                error_row = page.locator("#errors tbody tr")
                await expect(error_row).to_have_count(1)
                await expect(error_row.locator("td").nth(3)).to_have_text("no-such-image")
                await expect(error_row.locator("td").nth(5)).to_have_text("a")
                await expect(page.locator("#admin")).to_be_hidden()
                # Tenant a's own 16, paged by 50, each with what it uses now.
                await _number(page, "#sandboxes-total", "16")
                rows = page.locator("#sandboxes tbody tr")
                await expect(rows).to_have_count(16)
                mine = {sb.id for sb in sandboxes[:16]}
                shown = {await rows.nth(i).get_attribute("data-sandbox") for i in range(16)}
                assert shown == mine
                await expect(rows.first.locator("td").nth(1)).to_have_text("leased")
                await expect(rows.first.locator("td").nth(5)).to_contain_text("MiB")
                # Drawn once two samples (a second apart) hold leased sandboxes.
                leased_area = page.locator("#chart-states polygon[data-state=leased]")
                await expect(leased_area).to_have_count(1, timeout=15_000)
                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                if artifacts := os.environ.get("SANDMAN_ARTIFACTS"):
                    Path(artifacts).mkdir(parents=True, exist_ok=True)
                    shutil.copy(shot, Path(artifacts) / "dashboard.png")

                for sandbox in sandboxes:
                    await sandbox.release()
                # Live: the page follows the pool down.
                await _number(page, "#count-leased", "0")
                assert not problems, problems
                await browser.close()
            await eventually(lambda: not served.run(served.pool.list), timeout=30)
        finally:
            deadline = time.monotonic() + 10
            while any(alive(pid) for pid in browsers) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = {pid: cmd for pid, cmd in browsers.items() if alive(pid)}
            for pid in left:  # ours: started by this test's Playwright
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            assert not left, f"chromium left running: {left}"


async def test_the_sandbox_list_is_the_tenants_own_and_paged(
    sampled: tuple[Pool, Sampler, FakeProvider],
) -> None:
    pool, _, _ = sampled
    app = create_app(pool, settings())
    session = pool.open_session()
    for image, tenant in [("img-1", "a"), ("img-2", "a"), ("img-3", "a"), ("img-4", "b")]:
        await pool.acquire(_spec(image, tenant), session=session)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as api:
        first = (await api.get("/v1/dashboard/sandboxes?size=2", headers=AUTH_A)).json()
        second = (await api.get("/v1/dashboard/sandboxes?size=2&page=1", headers=AUTH_A)).json()
        theirs = (await api.get("/v1/dashboard/sandboxes", headers=AUTH_B)).json()
        bad = await api.get("/v1/dashboard/sandboxes?size=0", headers=AUTH_A)
    assert (first["total"], len(first["sandboxes"]), len(second["sandboxes"])) == (3, 2, 1)
    images = [row["image"] for row in first["sandboxes"] + second["sandboxes"]]
    assert images == ["img-1", "img-2", "img-3"]  # oldest first, a's alone
    assert [row["image"] for row in theirs["sandboxes"]] == ["img-4"]
    assert first["sandboxes"][0]["state"] == "leased" and first["sandboxes"][0]["age"] >= 0
    assert bad.status_code == 422
