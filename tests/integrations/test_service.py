"""The adapters on a Sandman service (``SANDMAN_URL``, ``SANDMAN_API_KEY``): the service in
uvicorn on a thread, its pool on the local provider; the key never reaches what the
frameworks serialize, and nothing is left."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("prometheus_client")  # the server extra
pytest.importorskip("minisweagent")
pytest.importorskip("swerex")

from fastapi import FastAPI
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

from sandman.integrations._client import close_shared
from sandman.integrations.swerex import SandmanDeploymentConfig
from sandman.pool import Pool, PoolConfig
from sandman.providers.local import LocalProvider
from sandman.server import ApiKey, ServerSettings, create_app
from sandman.settings import LocalConfig
from tests.integrations.conftest import assert_gone
from tests.integrations.test_minisweagent import CLASS_PATH, ENV, agent_config
from tests.server.conftest import serve_in_thread

pytestmark = pytest.mark.integrations

KEY = "sk-sandman-test-key-0123456789"


def test_both_adapters_over_the_service(
    local_provider: LocalProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    @contextlib.asynccontextmanager
    async def setup() -> AsyncIterator[tuple[FastAPI, Pool]]:
        provider = LocalProvider(LocalConfig(state_dir=local_provider.config.state_dir))
        pool = Pool(provider, PoolConfig(name="int-served"))
        settings = ServerSettings(api_keys=[ApiKey(tenant="t", key=KEY)], close_pool=True)
        try:
            yield create_app(pool, settings), pool
        finally:
            await provider.aclose()

    with serve_in_thread(setup) as (url, _pool, _loop):
        monkeypatch.setenv("SANDMAN_URL", url)
        monkeypatch.setenv("SANDMAN_API_KEY", KEY)

        env = get_environment({"environment_class": CLASS_PATH, **ENV})
        submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done >&2"
        model = DeterministicModel(outputs=[make_output("submit", [{"command": submit}])])
        agent = DefaultAgent(model, env, **agent_config())
        info = agent.run("submit at once")
        assert (info["exit_status"], info["submission"]) == ("Submitted", "done\n")
        trajectory: dict[str, Any] = agent.serialize()
        assert KEY not in json.dumps(trajectory)
        env.cleanup()

        config = SandmanDeploymentConfig(image="busybox")
        assert KEY not in config.model_dump_json()
        deployment = config.get_deployment()
        asyncio.run(deployment.start())
        runtime = deployment.runtime
        asyncio.run(runtime.create_session(CreateBashSessionRequest()))
        obs = asyncio.run(runtime.run_in_session(BashAction(command="cd /tmp; echo $PWD >&2")))
        assert (obs.output, obs.exit_code) == ("/tmp\n", 0)
        asyncio.run(deployment.stop())
        close_shared()  # the client's session at the service ends
    assert_gone(local_provider)
