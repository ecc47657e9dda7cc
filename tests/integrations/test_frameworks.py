"""The frameworks the adapters are tested against are the pinned ones (scripts/integrations-pins.txt)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.integrations

PINS = Path(__file__).resolve().parents[2] / "scripts" / "integrations-pins.txt"


def test_the_pinned_frameworks_are_installed() -> None:
    pins = [
        line.split("==")
        for line in PINS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(pins) == 4
    for name, pinned in pins:
        assert version(name) == pinned, name
