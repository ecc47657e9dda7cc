"""The machine-level helpers of the local provider, on the real cgroup filesystem."""

from __future__ import annotations

import uuid

from sandman.providers.local.host import CGROUP_ROOT, remove_cgroup_parent
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = needs_root_and_crun


def test_a_cgroup_parent_goes_with_its_empty_ancestors_and_only_them() -> None:
    # A top of its own: other runs' cgroups under a shared /sandman-test would
    # (rightly) keep it, and this test from seeing all its ancestors go.
    top = f"sandman-test-{uuid.uuid4().hex[:12]}"
    run = "run"
    parent = f"/{top}/{run}/pool"
    hierarchies = [h for h in CGROUP_ROOT.iterdir() if (h / "cgroup.procs").exists()]
    sandbox = [h / top / run / "pool" / "sb-1" for h in hierarchies]
    for directory in sandbox:
        directory.mkdir(parents=True)
    try:
        # A sandbox still there: its parent and the parent's ancestors stay.
        busy = remove_cgroup_parent(parent)
        assert sorted(busy) == sorted(d.parent for d in sandbox)
        assert all(d.is_dir() for d in sandbox)
    finally:
        for directory in sandbox:
            directory.rmdir()
    assert remove_cgroup_parent(parent) == []
    assert not any((h / top).exists() for h in hierarchies)
    assert remove_cgroup_parent(parent) == []  # nothing there: nothing to do
