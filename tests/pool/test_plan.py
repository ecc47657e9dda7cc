"""A reconcile pass's decisions as a table: what the provider lists, who lives, what is done."""

from __future__ import annotations

import pytest

from sandman.pool.owner import LABEL_OWNER
from sandman.pool.plan import plan_reconcile
from sandman.pool.records import LABEL_EXPIRES, LABEL_POOL, LABEL_SESSION
from sandman.providers.base import OwnerStatus, SandboxInfo, SandboxState

NOW = 1_000_000.0
ME, LIVE, DEAD, UNSURE = "pid:me", "pid:live", "pid:dead", "pid:unsure"
STATUS: dict[str, OwnerStatus] = {LIVE: "alive", DEAD: "dead", UNSURE: "unknown"}


def info(
    *,
    pool: str | None = "p",
    owner: str | None = None,
    session: str | None = "s1",
    expires: float | str | None = NOW + 60,
    state: SandboxState = "running",
    age: float = 10.0,
) -> SandboxInfo:
    labels = {}
    for key, value in ((LABEL_POOL, pool), (LABEL_OWNER, owner), (LABEL_SESSION, session),
                       (LABEL_EXPIRES, expires)):  # fmt: skip
        if value is not None:
            labels[key] = str(value)
    return SandboxInfo(
        id="sb-1", provider="x", state=state, labels=labels, created_at=NOW - age, image="i"
    )


CASES = [
    # (listed, adopt, judge) -> (action, reason)
    ("ours, adoptable, at start", info(owner=DEAD), True, True, "adopt", None),
    ("ours, adoptable, judging at start even if alive-unknown", info(owner=UNSURE), True, True, "adopt", None),
    ("ours, later pass: only a dead owner's", info(owner=UNSURE), True, False, "orphan", "orphan"),
    ("ours, later pass, owner dead", info(owner=DEAD), True, False, "adopt", None),
    ("ours, no adoption asked", info(owner=DEAD), False, True, "orphan", "orphan"),
    ("ours, never handed over", info(owner=DEAD, session=None), True, True, "orphan", "orphan, never handed over"),
    ("ours, expired", info(owner=DEAD, expires=NOW - 1), True, True, "orphan", "orphan"),
    ("ours, expiry unreadable", info(owner=DEAD, expires="soon"), True, True, "orphan", "orphan"),
    ("ours, not running", info(owner=DEAD, state="stopped"), True, True, "orphan", "orphan"),
    ("ours, this process's own", info(owner=ME), True, True, "adopt", None),
    ("ours, another live process's", info(owner=LIVE), True, True, "elsewhere", None),
    ("another pool's, owner alive", info(pool="q", owner=LIVE), True, True, None, None),
    ("another pool's, owner unknown", info(pool="q", owner=UNSURE), True, True, None, None),
    ("another pool's, owner dead", info(pool="q", owner=DEAD), True, True, "orphan", f"owner {DEAD!r} is dead"),
    ("no record, young", info(pool=None, session=None, expires=None, state="unknown", age=5), True, True, None, None),
    ("no record, old", info(pool=None, session=None, expires=None, state="unknown", age=120), True, True, "orphan", "no record"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("listed", "adopt", "judge", "action", "reason"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_each_listing_gets_its_action(
    listed: SandboxInfo, adopt: bool, judge: bool, action: str | None, reason: str | None
) -> None:
    plan = plan_reconcile(
        [listed], known=set(), pool="p", owner=ME, liveness=STATUS.__getitem__, now=NOW,
        adopt=adopt, judge=judge, stray_grace=60.0,
    )  # fmt: skip
    got = (
        ("adopt", None) if plan.adopt
        else ("orphan", plan.orphan[0].reason) if plan.orphan
        else ("elsewhere", None) if plan.elsewhere
        else (None, None)
    )  # fmt: skip
    assert got == (action, reason)
    assert len(plan.adopt) + len(plan.orphan) + len(plan.elsewhere) <= 1
    if plan.adopt:
        assert plan.adopt[0].session == "s1" and plan.adopt[0].expires == NOW + 60
    if plan.elsewhere:
        assert plan.elsewhere == {"s1": dict(listed.labels)}


def test_what_the_pool_knows_is_left_alone() -> None:
    plan = plan_reconcile(
        [info(owner=DEAD)], known={"sb-1"}, pool="p", owner=ME, liveness=STATUS.__getitem__,
        now=NOW, adopt=True, judge=True, stray_grace=60.0,
    )  # fmt: skip
    assert (plan.adopt, plan.orphan, plan.elsewhere) == ([], [], {})
