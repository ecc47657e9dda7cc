"""The machine-level helpers of the local provider, on the real cgroup filesystem."""

from __future__ import annotations

import resource
import uuid
from pathlib import Path

import pytest

from sandman.providers.local import host
from sandman.providers.local.host import CGROUP_ROOT, remove_cgroup_parent
from tests.providers.local.conftest import needs_root_and_crun


@needs_root_and_crun
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


def _sysctls(root: Path, values: dict[str, int]) -> None:
    for name, value in values.items():
        path = root / name.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")


def test_capacity_names_each_kernel_parameter_too_low_for_the_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sysctls(
        tmp_path,
        {
            "kernel.pid_max": 32768,  # the kernel's default: ~4000 idle sandboxes
            "kernel.threads-max": 193098,
            "user.max_net_namespaces": 96549,
            "fs.file-max": 2470878,
            "kernel.keys.root_maxkeys": 200,
        },
    )
    monkeypatch.setattr(host, "PROC_SYS", tmp_path)
    few = {f.what.split(" =")[0]: f for f in host.check_capacity(100)}
    assert few["kernel.pid_max"].ok and few["user.max_net_namespaces"].ok
    many = {f.what.split(" =")[0]: f for f in host.check_capacity(11858)}
    assert not many["kernel.pid_max"].ok
    assert many["kernel.pid_max"].fix == "sysctl -w kernel.pid_max=4194304"
    assert many["kernel.threads-max"].ok and many["fs.file-max"].ok
    assert many["user.max_net_namespaces"].ok
    assert not many["kernel.keys.root_maxkeys"].ok
    assert "kernel.keys.root_maxkeys=15954" in many["kernel.keys.root_maxkeys"].fix
    # What this host does not have is not reported (a parameter missing is no finding).
    assert "user.max_mnt_namespaces" not in many


def test_the_soft_limit_on_open_files_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        assert host.raise_open_files() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_memory_of_many_sandboxes_grows_with_the_square_of_their_count() -> None:
    # Fit to the density curve: 3040 sandboxes held 1.5 GiB of kmalloc-1k (10
    # superblocks each then), 1000 held 150 MiB (8 then); 5000 held 337 KiB each (4 now).
    assert host.memory_for(1000) < 2 * 2**30
    assert 24 * 2**30 < host.memory_for(11858) < 30 * 2**30
    assert host.memory_for(2000) - 2 * host.memory_for(1000) > 100 * 2**20


def test_the_doctor_says_whether_the_built_runsc_has_its_sidecars(tmp_path: Path) -> None:
    """runsc starts each sentry through the sidecars beside it (hack/gvisor/build makes
    them); the doctor names those missing and where they belong."""
    runsc = tmp_path / "runsc"
    runsc.write_text("#!/bin/sh\necho 'runsc version test'\n")
    runsc.chmod(0o755)
    (tmp_path / "gvisor-bin").mkdir()
    sentry = tmp_path / "gvisor-bin" / "gvisor_sentry"
    sentry.write_text("")
    sentry.chmod(0o755)
    lines = host.check_gvisor(runsc)
    (said,) = [line for line in lines if line.startswith("runsc sidecars")]
    assert "gvisor-sentry-prewarmer missing" in said and str(tmp_path / "gvisor-bin") in said
    prewarmer = tmp_path / "gvisor-bin" / "gvisor-sentry-prewarmer"
    prewarmer.write_text("")
    prewarmer.chmod(0o755)
    (said,) = [line for line in host.check_gvisor(runsc) if line.startswith("runsc sidecars")]
    assert "missing" not in said and "gvisor_sentry, gvisor-sentry-prewarmer" in said
