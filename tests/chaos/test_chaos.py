"""The chaos suite's fast, seeded set: every scenario and fault once, then the seeds that
ever failed in a ``benchmarks/chaos.py`` run.

Each case is one iteration (see `tests.chaos.engine`): a burst on two clients, the
fault, then the accounting, which must come out clean: nothing leaked, nothing lost,
no untyped error, no client stuck. Every case is plain: a seed that a chaos run finds
failing is added here with its fix, never marked as expected to fail.

A seed fixes the plan (scenario, fault, timing, parameters), not the interleaving of
processes: these cases are chosen to fail, or not, whatever the interleaving.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chaos.engine import plan_for, run_iteration
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [pytest.mark.anyio, pytest.mark.chaos, needs_root_and_crun, pytest.mark.timeout(300)]

SEED = 14


def case(
    scenario: str, fault: str, *marks: pytest.MarkDecorator, **params: Any
) -> Any:  # a pytest ParameterSet
    label = "-".join([scenario, fault, *(f"{k}={v}" for k, v in sorted(params.items()))])
    return pytest.param(scenario, fault, params, marks=marks, id=label)


EVERY_FAULT = [
    # Controls: no fault at all must come out clean.
    case("embedded", "none"),
    # An embedded pool's process killed, stopped; its watchdog killed, stopped.
    case("embedded", "kill-client", when="hold"),
    case("embedded", "stop-client", at=0.5, duration=5.0),
    case("embedded", "kill-watchdog", at=0.5),
    case("embedded", "stop-watchdog-kill-client", when="hold"),
    case("embedded", "kill-client-and-watchdog", when="hold"),
    case("embedded", "kill-daemon", when="hold"),
    case("embedded", "cancel-storm"),
    case("embedded", "state-ro", at=0.3, duration=2.0),
    # The service killed, stopped, restarted; its clients killed, stopped.
    case("service", "stop-service", at=0.5, duration=5.0, on_shutdown="release"),
    case(
        "service",
        "kill-service",
        when="hold",
        on_shutdown="leave",
        adopt=True,
        restart_after=0.3,
    ),
    case(
        "service",
        "term-service",
        when="hold",
        on_shutdown="leave",
        adopt=True,
        restart_after=0.3,
    ),
    case("service", "kill-service-slow-watchdog", when="hold"),
    case("service", "kill-client", at=0.5, on_shutdown="release"),
    case("service", "kill-daemon", when="hold", on_shutdown="release"),
    case("service", "cancel-storm", on_shutdown="release"),
    case("service", "state-ro", at=0.3, duration=2.0, on_shutdown="release"),
    # Found by the chaos suite itself.
    case(
        "embedded",
        "kill-client",
        # Issue 14, item 7 (fixed): children of the killed pool (crun create, nft) finished
        # their half of a create after the watchdog's sweep.
        at=0.3,
        rounds=0,
        hold=6,
        cancel_rate=0,
    ),
    case(
        "service",
        "kill-service",
        # Issue 14, item 9 (fixed): adoption leased a sandbox the killed instance made but
        # never handed to its caller.
        when="first-acquired",
        at=0.1,
        on_shutdown="leave",
        adopt=True,
        restart_after=0.3,
        rounds=0,
        hold=10,
        cancel_rate=0,
    ),
    # A full state dir aborted the disk filesystem's transaction: btrfs went read-only,
    # no create or delete worked after.
    case("embedded", "state-full", at=0.5, duration=3.0),
    # Workers that snapshot, fork, restore and pause as they go (issue 26): a pool
    # killed, its watchdog with it, a service killed in the middle of those.
    case("embedded", "kill-client", at=0.6, snapshots=True),
    case("embedded", "kill-client-and-watchdog", when="hold", snapshots=True),
    case("embedded", "state-ro", at=0.4, duration=2.0, snapshots=True),
    case(
        "service",
        "kill-service",
        at=0.6,
        on_shutdown="release",
        adopt=False,
        restart_after=0.3,
        snapshots=True,
    ),
]


@pytest.mark.parametrize(("scenario", "fault", "params"), EVERY_FAULT)
async def test_every_fault(
    scenario: str, fault: str, params: dict[str, Any], busybox_tar: Path, chaos_work: Path
) -> None:
    plan = plan_for(SEED, 0, scenario=scenario, fault=fault, **params)
    outcome = await run_iteration(plan, busybox_tar, chaos_work)
    assert not outcome.failed, outcome.details()


# Iterations of `benchmarks/chaos.py` runs that failed, replayed as drawn (same plan).
SEEDS_THAT_FAILED = [
    # A release the service never received (it was down) was dropped by the client:
    # the next instance adopted the sandbox, leased to a live session, held by no one.
    pytest.param(1, 0, id="1-0-service-release-during-outage"),
    # Item 5: a client whose session expired never opened a new one.
    pytest.param(1, 12, id="1-12-service-stop-client-7.5s"),
    # Items 9 and 5, and releases dropped during the outage (fixed): a sandbox never
    # handed to its caller adopted as leased, a session not adopted never replaced.
    pytest.param(1, 9, id="1-9-service-kill-service-slow-watchdog"),
]  # fmt: skip


@pytest.mark.parametrize(("seed", "iteration"), SEEDS_THAT_FAILED)
async def test_seeds_that_failed(
    seed: int, iteration: int, busybox_tar: Path, chaos_work: Path
) -> None:
    outcome = await run_iteration(plan_for(seed, iteration), busybox_tar, chaos_work)
    assert not outcome.failed, outcome.details()
