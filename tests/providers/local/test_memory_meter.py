"""`MemoryMeter`: a sandbox's average memory is the time-weighted mean of its samples."""

from __future__ import annotations

from sandman.providers.local.usage import MemoryMeter


def test_the_average_weighs_each_sample_by_how_long_it_held() -> None:
    meter = MemoryMeter("/sandman")
    assert meter.observe("a", 100, at=0.0) == 100  # one sample: itself
    assert meter.observe("a", 400, at=1.0) == 100  # 100 held for 1 s
    assert meter.observe("a", 0, at=4.0) == 325  # then 400 for 3 s: (100 + 1200) / 4
    assert meter.observe("b", 7, at=4.0) == 7  # sandboxes apart
    # A sample out of order (an older read finishing late) changes nothing.
    assert meter.observe("a", 10**9, at=2.0) == 325


def test_a_forgotten_sandbox_starts_again() -> None:
    meter = MemoryMeter("/sandman")
    meter.observe("a", 100, at=0.0)
    meter.observe("a", 300, at=1.0)
    meter.forget("a")
    assert meter.observe("a", 50, at=2.0) == 50


def test_a_sandbox_without_a_cgroup_is_not_sampled() -> None:
    meter = MemoryMeter("/sandman-no-such-parent")
    meter.sample(["gone"])
    assert meter.observe("gone", 5, at=0.0) == 5  # nothing was recorded before
