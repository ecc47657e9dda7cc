"""The comparison line of ``benchmarks/peers/agent_sandbox.py``: its ratio must say
something also when an arm never had every sandbox ready (its t100 is inf)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def load() -> ModuleType:
    path = REPO / "benchmarks" / "peers" / "agent_sandbox.py"
    spec = importlib.util.spec_from_file_location("agent_sandbox_peer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


peer = load()


def burst(name: str, *ready_at: float) -> Any:
    return peer.Burst(name, ready_at=list(ready_at))


def test_both_complete_compares_t100() -> None:
    line = peer.compare(burst("sandman", 1, 2, 3, 4), [burst("as", 2, 4, 6, 8)], 4)
    assert line == "sandman_t100=4.0 agent_sandbox_t100=8.0 ratio=0.50"


def test_the_faster_of_their_paths_is_compared() -> None:
    theirs = [burst("as", 2, 4, 6, 10), burst("claims", 1, 2, 3, 8)]
    line = peer.compare(burst("sandman", 1, 2, 3, 4), theirs, 4)
    assert line == "sandman_t100=4.0 agent_sandbox_t100=8.0 ratio=0.50"


def test_an_incomplete_arm_is_compared_at_the_share_both_reached() -> None:
    # 3 of 4 ever ready: t100 is inf, the ratio is taken at 75% (3.0 s vs 12.0 s).
    line = peer.compare(burst("sandman", 1, 2, 3, 4), [burst("as", 5, 9, 12)], 4)
    assert line == (
        "sandman_t100=4.0 agent_sandbox_t100=inf ratio=0.25 at=75.00% (t=3.0s vs 12.0s)"
    )


def test_the_arm_with_more_ready_is_the_one_compared() -> None:
    theirs = [burst("as", 5, 9), burst("claims", 6, 7, 20)]
    line = peer.compare(burst("sandman", 1, 2, 3, 4), theirs, 4)
    assert line.endswith("ratio=0.15 at=75.00% (t=3.0s vs 20.0s)")


def test_nothing_of_theirs_ready_has_no_ratio() -> None:
    line = peer.compare(burst("sandman", 1, 2), [burst("as")], 2)
    assert line == "sandman_t100=2.0 agent_sandbox_t100=inf ratio=nan"


def test_no_agent_sandbox_arm_is_skipped() -> None:
    line = peer.compare(burst("sandman", 1, 2), [], 2)
    assert line == "sandman_t100=2.0 agent_sandbox_t100=skipped ratio=skipped"
