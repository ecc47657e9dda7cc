"""OpenTelemetry spans: made where the program set up tracing, none (and nothing imported)
where it did not. In a process of its own: a tracer provider is set once per process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [needs_root_and_crun, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    TRACED = sys.argv[2] == "traced"
    if TRACED:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    import sandman

    async def main():
        async with sandman.local(state_dir=sys.argv[1]) as client:
            sb = await client.acquire("busybox")
            await sb.exec(["true"])
            await sb.release()
            return sb.id

    sandbox = asyncio.run(main())
    spans = []
    if TRACED:
        for s in exporter.get_finished_spans():
            parent = s.parent.span_id if s.parent else None
            spans.append({"name": s.name, "id": s.context.span_id, "parent": parent,
                          "trace": s.context.trace_id, "attributes": dict(s.attributes)})
    loaded = "opentelemetry" in sys.modules
    print(json.dumps({"sandbox": sandbox, "spans": spans, "loaded": loaded}))
    """
)


def run(local_state: Path, mode: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(local_state), mode],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_rollout_is_traced_where_tracing_is_set_up(
    local_state: Path, imported: LocalProvider
) -> None:
    result = run(local_state, "traced")
    spans = result["spans"]
    assert isinstance(spans, list)
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) >= {
        "sandman.acquire", "sandman.create", "sandman.ready", "sandman.exec", "sandman.release",
    }  # fmt: skip
    sandbox = result["sandbox"]
    for name in by_name:
        assert by_name[name]["attributes"].get("sandman.sandbox") == sandbox, name
    assert by_name["sandman.acquire"]["attributes"]["sandman.image"] == "busybox"


def test_nothing_is_traced_or_imported_where_it_is_not(
    local_state: Path, imported: LocalProvider
) -> None:
    result = run(local_state, "plain")
    assert result["spans"] == [] and result["loaded"] is False
