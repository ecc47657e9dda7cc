"""The shipped instances (examples/eval), built once per session into a state dir of their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import sandman
from sandman.client import AsyncClient
from sandman.eval import Conditions, Instance, load_instances, load_predictions
from sandman.providers.local import LocalProvider
from sandman.settings import LocalConfig

# A wall-clock limit far above what the tests need (about a second), so a
# machine loaded by others cannot turn a verdict into a timeout.
CONDITIONS = Conditions(timeout=120, memory="1Gi")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"


@dataclass(frozen=True)
class Demo:
    """The built demo: its state dir (image imported), image id and the shipped files."""

    state_dir: Path
    image_id: str
    instances: Path
    predictions: Path

    def shipped(self, instance_id: str, model: str) -> tuple[Instance, str]:
        """The shipped instance and the patch `model` made for it."""
        instance = next(i for i in load_instances(self.instances) if i.instance_id == instance_id)
        prediction = next(
            p for p in load_predictions(self.predictions)
            if p.instance_id == instance_id and p.model_name_or_path == model
        )  # fmt: skip
        return instance, prediction.patch

    def expected(self) -> dict[tuple[str, str], str]:
        """(model, instance_id) -> the status each shipped prediction was made to get."""
        return {
            (p["model_name_or_path"], p["instance_id"]): p["expected"]
            for p in map(json.loads, self.predictions.read_text().splitlines())
        }


def built(script: Path, prefix: str) -> Iterator[Demo]:
    """The image ``script`` builds (from the cached Debian base), in a state dir of its own."""
    # Short on purpose: the daemon's socket path must fit in 108 bytes.
    state = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--state-dir", str(state)],
            capture_output=True, text=True, timeout=1700, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        made = json.loads(done.stdout.splitlines()[-1])
        yield Demo(state, made["image_id"], Path(made["instances"]), Path(made["predictions"]))
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def local_client(state_dir: Path) -> AsyncIterator[AsyncClient]:
    """A local pool on ``state_dir``; afterwards no sandbox may be left."""
    async with sandman.local(state_dir=state_dir) as client:
        yield client
    provider = LocalProvider(LocalConfig(state_dir=state_dir))
    left = await provider.list()
    for info in left:
        await provider.delete(info.id)
    assert left == [], "the evaluation left sandboxes behind"


@pytest.fixture(scope="session")
def demo() -> Iterator[Demo]:
    """Build the demo image (debootstrap the first time on a machine, then cached)."""
    yield from built(EXAMPLES / "build.py", "sm-ev-")


@pytest.fixture
async def client(demo: Demo) -> AsyncIterator[AsyncClient]:
    """A local pool on the demo's state dir; afterwards no sandbox may be left."""
    async for pool in local_client(demo.state_dir):
        yield pool
