"""OpenTelemetry spans around what a rollout waits on: acquire, create, ready, exec, release.

Sandman makes spans only when the program has set up OpenTelemetry itself (the SDK's
tracer provider, with whatever exporter it chose): with none, `span` is a shared no-op
context, and nothing of OpenTelemetry is imported. The check is a dictionary lookup
and an isinstance, so the no-op exec does not feel it (``benchmarks/tracing.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["span"]

_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()
_NAME = "sandman"


def _tracer() -> Any | None:
    """The tracer of the program's tracer provider, or None while it has set none."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None  # the program never imported OpenTelemetry: it traces nothing
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return trace.get_tracer(_NAME)


def span(name: str, **attributes: str | float | bool | None) -> AbstractContextManager[Any]:
    """A span ``sandman.<name>`` with ``attributes`` (None values left out) while the block
    runs, a child of the current one; a no-op unless the program set up tracing."""
    tracer = _tracer()
    if tracer is None:
        return _NOTHING
    return _span(tracer, name, attributes)


@contextlib.contextmanager
def _span(tracer: Any, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    kept = {f"sandman.{k}": v for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(f"sandman.{name}", attributes=kept) as current:
        yield current
