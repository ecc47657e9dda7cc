"""A bad value in a spec is a `sandman.ConfigError` naming the field in plain words, from
both faces of the SDK: never pydantic's ``ValidationError`` (README: "every error is a
`sandman.SandboxError`")."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

import sandman
from sandman.client import AsyncClient, Client, InProcessBackend
from sandman.pool import Pool, PoolConfig
from sandman.testing import FakeProvider


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"memory": "lots"}, "memory: not a byte quantity: 'lots' (try 512Mi or 2Gi)"),
        ({"cpu": 0}, "cpu: must be more than 0, not 0"),
        ({"memory": "1Mi", "pids": 3},
         "memory: must be at least 16Mi, not 1Mi; pids: must be at least 16, not 3"),
        ({"network": "public"}, "network: should be 'none', 'isolated', 'egress' or an Egress, not 'public'"),
        ({"gpus": 1}, "gpus: is not a setting here"),
    ],
)  # fmt: skip
@pytest.mark.anyio
async def test_a_bad_spec_is_a_config_error(fields: dict[str, Any], said: str) -> None:
    async with (
        FakeProvider(daemon=False) as fake,
        Pool(fake, PoolConfig(name="t")) as pool,
        AsyncClient(InProcessBackend(pool, own_pool=False)) as client,
    ):
        with pytest.raises(sandman.ConfigError) as raised:
            await client.acquire("task", **fields)
        assert str(raised.value) == f"invalid sandbox spec: {said}"
        assert not isinstance(raised.value, pydantic.ValidationError)
        assert fake.live == 0


def test_the_blocking_client_says_the_same() -> None:
    # The spec is checked before anything is asked of the pool (never started here).
    with Client(AsyncClient(InProcessBackend(Pool(FakeProvider(daemon=False))))) as client:
        with pytest.raises(sandman.ConfigError, match="^invalid sandbox spec: cpu: must be more"):
            client.acquire("task", cpu=-1)
        with (
            pytest.raises(sandman.ConfigError, match="memory: not a byte quantity"),
            client.sandbox("task", memory="lots"),
        ):
            pass
