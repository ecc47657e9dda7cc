"""Schemathesis against the served OpenAPI document: no 5xx, no answer outside the schema.

Deterministic (derandomized Hypothesis, a fixed number of examples per
operation) and quick. Bodies that name a session get a real one of the
calling tenant, so acquires reach the pool instead of stopping at 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sandman.pool import Pool
from sandman.server import create_app
from sandman.testing import FakeProvider
from tests.server.conftest import AUTH_A, Served, serve

schema = schemathesis.openapi.from_dict(create_app(Pool(FakeProvider(daemon=False))).openapi())


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(daemon=False) as served:
        yield served


@pytest.fixture(scope="module")
def session(served: Served) -> str:
    response = requests.post(f"{served.url}/v1/sessions", headers=AUTH_A, timeout=10)
    response.raise_for_status()
    return str(response.json()["id"])


@schema.parametrize()
@settings(
    max_examples=25, derandomize=True, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
def test_the_api_keeps_its_schema(case: Any, served: Served, session: str) -> None:
    if isinstance(case.body, dict) and "session" in case.body:
        case.body["session"] = session
    response = case.call(base_url=served.url, headers=AUTH_A, timeout=30)
    # A deadline is the one documented 5xx an acquire may meet with a tiny timeout.
    timed_out = response.status_code == 504 and response.json()["error"]["code"] == "create_timeout"
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance]  # fmt: skip
    if not timed_out:
        checks.append(not_a_server_error)
    case.validate_response(response, checks=checks)
