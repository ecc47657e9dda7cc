"""Judging a pool process's Lease: alive while renewed, dead only once it has been seen
unchanged past its duration and a grace on the observer's own clock, through observations
none of which failed; whatever the holder's clock says."""

from __future__ import annotations

from typing import Any

from sandman.providers.kubernetes.owners import OwnerJudge, lease_name, micro_time

DURATION = 15
GRACE = 10.0
T0 = 1_800_000_000.0  # the observer's wall clock at its first look


def lease(name: str, version: str, renewed: float, duration: int | None = DURATION) -> Any:
    spec: dict[str, Any] = {"holderIdentity": "host/1", "renewTime": micro_time(renewed)}
    if duration is not None:
        spec["leaseDurationSeconds"] = duration
    return {"metadata": {"name": name, "resourceVersion": version}, "spec": spec}


def test_a_lease_renewed_within_its_duration_is_alive() -> None:
    judge = OwnerJudge(GRACE)
    owners = judge.observe([lease("a", "1", T0 - 5)], wall=T0, now=0.0)
    assert owners("k.a") == "alive"
    assert owners.undecided_for == 0


def test_an_expired_lease_is_dead_only_once_seen_unchanged_for_its_duration_and_grace() -> None:
    judge = OwnerJudge(GRACE)
    stale = [lease("a", "1", T0 - 3600)]
    assert judge.observe(stale, wall=T0, now=0.0)("k.a") == "unknown"
    middle = judge.observe(stale, wall=T0 + 20, now=20.0)
    assert middle("k.a") == "unknown"
    assert middle.undecided_for == DURATION + GRACE - 20
    dead = judge.observe(stale, wall=T0 + 25, now=25.0)
    assert dead("k.a") == "dead"
    assert dead.dead == ["k.a"]
    assert dead.versions["k.a"] == "1"


def test_a_holder_whose_clock_is_behind_stays_alive_while_it_renews() -> None:
    """Its renewTime says an hour ago every time, but each look finds a new version."""
    judge = OwnerJudge(GRACE)
    for step in range(20):
        now = step * 5.0
        owners = judge.observe([lease("a", str(step), T0 + now - 3600)], wall=T0 + now, now=now)
        assert owners("k.a") != "dead", step


def test_a_failed_observation_starts_the_count_again() -> None:
    """The API server away: the holder could not renew, and we could not see; after it is
    back, the holder gets a whole duration and grace to renew before it reads as dead."""
    judge = OwnerJudge(GRACE)
    stale = [lease("a", "1", T0 - 60)]
    judge.observe(stale, wall=T0, now=0.0)
    judge.interrupted()
    assert judge.observe(stale, wall=T0 + 40, now=40.0)("k.a") == "unknown"
    assert judge.observe(stale, wall=T0 + 60, now=60.0)("k.a") == "unknown"
    assert judge.observe(stale, wall=T0 + 65, now=65.0)("k.a") == "dead"


def test_looks_further_apart_than_the_lease_lasts_start_the_count_again() -> None:
    """An observer that itself stood still cannot tell whether the holder could renew."""
    judge = OwnerJudge(GRACE)
    stale = [lease("a", "1", T0 - 60)]
    judge.observe(stale, wall=T0, now=0.0)
    assert judge.observe(stale, wall=T0 + 100, now=100.0)("k.a") == "unknown"
    assert judge.observe(stale, wall=T0 + 125, now=125.0)("k.a") == "dead"


def test_a_missing_lease_is_dead_and_other_forms_are_unknown() -> None:
    owners = OwnerJudge(GRACE).observe([lease("a", "1", T0)], wall=T0, now=0.0)
    assert owners("k.gone") == "dead"
    assert owners.dead == []  # only records judged dead: a missing one has nothing to forget
    assert owners("p.0123456789ab.4026531836.1.1") == "unknown"
    assert owners.knows("k.a") and not owners.knows("p.x")


def test_a_lease_we_did_not_write_is_never_dead() -> None:
    judge = OwnerJudge(GRACE)
    odd = [lease("a", "1", T0 - 3600, duration=None)]
    for now in (0.0, 20.0, 40.0, 60.0):
        assert judge.observe(odd, wall=T0 + now, now=now)("k.a") == "unknown"


def test_owner_values_name_their_lease() -> None:
    assert lease_name("k.sandman-owner-0123456789ab") == "sandman-owner-0123456789ab"
    assert lease_name("p.0123456789ab.1.2.3") is None
    assert lease_name("k.") is None
