"""`benchmarks/burst.py` run at a small size, then the host's mount table read: a run
closes what it opened. Its embedded run once left its state dir's btrfs mounted after
removing the directory, the image file deleted but its space kept (issue 30). Its
figures are not checked (no timed tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import sandman
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [needs_root_and_crun, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "burst.py"


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short on purpose: the daemons' socket paths must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="smt-", dir="/tmp"))
    try:
        yield path
    finally:
        # What a failed run left mounted goes too, deepest first (its loop device with it).
        for mount in sorted(_mounts_under(path), reverse=True):
            subprocess.run(["umount", "--lazy", mount], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _mounts_under(directory: Path) -> list[str]:
    inside = f"{directory}/"
    return [
        point
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if f"{(point := line.split()[4])}/".startswith(inside)
    ]


def held_under(directory: Path) -> list[str]:
    """The mounts under ``directory`` in the host's mount table, and the loop devices
    backed by a file in it (a deleted image file still mounted shows only there)."""
    inside = f"{directory}/"
    held = _mounts_under(directory)
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = backing.read_text().strip()
        except OSError:  # detached meanwhile
            continue
        if name.startswith(inside):
            held.append(f"{backing.parent.parent.name}: {name}")
    return held


def test_the_embedded_burst_leaves_nothing_mounted(state_dir: Path) -> None:
    source = Path(sandman.__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, str(SCRIPT), "--requests", "4", "--clients", "2",
        "--state-dir", str(state_dir / "run"), "--png", str(state_dir / "burst.png"),
    ]  # fmt: skip
    (state_dir / "run").mkdir()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=540, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    last = dict(field.split("=", 1) for field in done.stdout.strip().splitlines()[-1].split())
    assert last["failures"] == "0" and last["leftover"] == "0", done.stdout[-2000:]
    # The run made and mounted its disk filesystem here (sandboxes ran), and let it go.
    assert (state_dir / "run" / "disk").is_dir()
    assert held_under(state_dir) == []
