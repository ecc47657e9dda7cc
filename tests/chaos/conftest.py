from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def chaos_work() -> Path:
    """Where failing iterations keep their logs (named in the failure message); outside
    pytest's temporary directories, which other runs on this machine rotate away."""
    return Path(tempfile.mkdtemp(prefix="sandman-chaos-tests-"))
