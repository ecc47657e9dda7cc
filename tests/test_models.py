from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandman.models import SandboxSpec


@pytest.mark.parametrize(
    ("given", "expected"),
    [("512Mi", 512 * 2**20), ("2Gi", 2 * 2**30), ("1G", 10**9), ("1.5Gi", 3 * 2**29),
     (64 * 2**20, 64 * 2**20), ("100MB", 100 * 10**6)],
)  # fmt: skip
def test_memory_quantities(given: object, expected: int) -> None:
    assert SandboxSpec(image="x", memory=given).memory == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"memory": "lots"},
        {"memory": "1Mi"},  # below the 16 MiB floor
        {"cpu": 0},
        {"cpu": -1},
        {"pids": 3},
        {"network": "bridge"},
        {"image": ""},
        {"gpus": 1},  # unknown fields are refused, not ignored
    ],
)
def test_impossible_specs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SandboxSpec.model_validate({"image": "x", **bad})


def test_spec_is_frozen_and_hashable_by_value() -> None:
    spec = SandboxSpec(image="x", cpu=2)
    with pytest.raises(ValidationError):
        spec.cpu = 3  # type: ignore[misc]
    assert spec == SandboxSpec(image="x", cpu=2.0)


@pytest.mark.parametrize("key", ["sandman.io/client", "sandman.io/tenant", "sandman.io/pool"])
def test_reserved_labels_are_refused(key: str) -> None:
    # A tenant's sandman.io/client label would let the NetworkPolicy admit
    # its sandbox to every other sandbox's daemon port.
    with pytest.raises(ValidationError, match="reserved for Sandman"):
        SandboxSpec(image="x", labels={key: "true"})
    assert SandboxSpec(image="x", labels={"team": "a"}).labels == {"team": "a"}


@pytest.mark.parametrize("value", ["", "relative/profile.json", "strict"])
def test_seccomp_must_name_a_kind_or_an_absolute_path(value: str) -> None:
    with pytest.raises(ValidationError, match="seccomp must be"):
        SandboxSpec(image="x", seccomp=value)
    assert SandboxSpec(image="x", seccomp="/etc/p.json").seccomp == "/etc/p.json"


def test_disk_takes_quantities() -> None:
    assert SandboxSpec(image="x", disk="1Gi").disk == 2**30
    with pytest.raises(ValidationError):
        SandboxSpec(image="x", disk="1Ki")
