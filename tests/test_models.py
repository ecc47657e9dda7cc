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
