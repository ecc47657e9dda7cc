"""Build the honest-patch corpus's image: two small PyPI projects, each with injected bugs.

Each project's pinned sdist (``toolz``, ``more-itertools``; no runtime
dependencies, tests that need only pytest or unittest) is fetched once with
pip into ``$SANDMAN_TEST_CACHE/sdists`` (default
``/var/cache/sandman/test-images``) and checked against its sha256, so later
builds are offline. Each becomes a git repository at ``/testbed/<project>``
with the same fixed authors and dates as the demo's (examples/eval/build.py,
whose functions this reuses): commit 1 is the sdist's tree as it is (less
the build metadata ``*.egg-info`` that the demo builder writes itself),
commit 2 the same with the `Bug`s below injected, the ``base_commit`` of
every instance in ``instances.jsonl``. The image is the demo's cached Debian
base (``base_tar()``) plus ``/testbed``, imported as ``sandman-eval-honest:1``.

Run as root: ``python examples/eval/honest/build.py [--state-dir DIR]``. It
prints one JSON line: the image name, its id, and the instance and
prediction files.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
IMAGE = "sandman-eval-honest:1"


def _demo_builder() -> ModuleType:
    """examples/eval/build.py, imported by path (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "sandman_eval_demo_build", HERE.parent / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO = _demo_builder()


@dataclass(frozen=True)
class Bug:
    """A small injected bug: ``old`` (found exactly once in ``path``) becomes ``new``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Project:
    name: str
    """The repository's directory under /testbed."""
    dist: str
    version: str
    sha256: str
    bugs: tuple[Bug, ...]

    @property
    def sdist(self) -> str:
        return f"{self.dist}-{self.version}.tar.gz"


PROJECTS = (
    Project(
        name="toolz",
        dist="toolz",
        version="0.12.1",
        sha256="ecca342664893f177a13dac0e6b41cbd8ac25a358e5f215316d43e2100224f4d",
        bugs=(
            # unique(seq, key=...) remembers the item, not its key: nothing is deduplicated.
            Bug("toolz/itertoolz.py", "                seen_add(val)\n",
                "                seen_add(item)\n"),
            # get_in() through a value that is not a container raises instead of the default.
            Bug("toolz/dicttoolz.py", "    except (KeyError, IndexError, TypeError):\n",
                "    except (KeyError, IndexError):\n"),
            # memoize's default key keeps keyword names, not their values.
            Bug("toolz/functoolz.py",
                "                    frozenset(kwargs.items()) if kwargs else None,\n",
                "                    frozenset(kwargs) if kwargs else None,\n"),
        ),
    ),
    Project(
        name="more-itertools",
        dist="more-itertools",
        version="10.2.0",
        sha256="8fccb480c43d3e99a00087634c06dd02b0d50fbf088b380de5a41a015ec239e1",
        bugs=(
            # unique_everseen() remembers unhashable elements, not their keys.
            Bug("more_itertools/recipes.py", "                seenlist_add(k)\n",
                "                seenlist_add(element)\n"),
            # split_at() never counts its splits down: maxsplit > 1 splits everywhere.
            Bug("more_itertools/more.py",
                "            buf = []\n            maxsplit -= 1\n        else:\n            buf.append(item)\n    yield buf\n",
                "            buf = []\n        else:\n            buf.append(item)\n    yield buf\n"),
        ),
    ),
)  # fmt: skip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sdist(project: Project) -> Path:
    """The project's sdist from the cache, fetched from PyPI with pip the first time; checked."""
    cached = Path(DEMO.cache_dir()) / "sdists" / project.sdist
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="eval-sdist-") as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 f"{project.dist}=={project.version}", "-d", tmp],
                check=True, capture_output=True, timeout=600,
            )  # fmt: skip
            fetched = Path(tmp) / project.sdist
            if _sha256(fetched) != project.sha256:
                raise SystemExit(
                    f"{project.sdist}: sha256 {_sha256(fetched)}, not {project.sha256}"
                )
            shutil.move(fetched, cached.with_suffix(".part"))
            cached.with_suffix(".part").replace(cached)
    if _sha256(cached) != project.sha256:
        raise SystemExit(f"{cached}: sha256 {_sha256(cached)}, not {project.sha256}")
    return cached


def _unpack(project: Project, into: Path) -> None:
    """The sdist's tree at ``into``, without its top directory and build metadata."""
    with (
        tempfile.TemporaryDirectory(prefix="eval-unpack-") as tmp,
        tarfile.open(sdist(project)) as archive,
    ):
        archive.extractall(tmp, filter="data")
        top = Path(tmp) / f"{project.dist}-{project.version}"
        shutil.copytree(top, into, ignore=shutil.ignore_patterns("*.egg-info"))


def inject(project: Project, tree: Path) -> None:
    """Apply the project's bugs to ``tree`` in place (each ``old`` must occur exactly once)."""
    for bug in project.bugs:
        path = tree / bug.path
        text = path.read_text()
        if text.count(bug.old) != 1:
            raise SystemExit(f"{project.name}: {bug.path} holds {bug.old!r} {text.count(bug.old)}x")
        path.write_text(text.replace(bug.old, bug.new))


def stage(project: Project, root: Path) -> Path:
    """``root/commits/1`` (the sdist) and ``2`` (the bugs injected), as make_repo reads them."""
    _unpack(project, root / "commits" / "1")
    shutil.copytree(root / "commits" / "1", root / "commits" / "2")
    inject(project, root / "commits" / "2")
    return root


def make_repos(stage_dir: Path) -> dict[str, str]:
    """Every project's repository under ``stage_dir/testbed``; returns each one's HEAD."""
    heads: dict[str, str] = {}
    for project in PROJECTS:
        source = stage(project, stage_dir / "sources" / project.name)
        heads[project.name] = str(DEMO.make_repo(source, stage_dir / "testbed" / project.name))
    return heads


def build_tar(out: Path) -> dict[str, str]:
    """The image's rootfs tarball at ``out``; returns each repository's HEAD commit."""
    staged = Path(tempfile.mkdtemp(prefix="eval-honest-"))
    try:
        heads = make_repos(staged)
        shutil.copyfile(DEMO.base_tar(), out)
        DEMO._tar(staged, "./testbed", out, append=True)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return heads


async def build(state_dir: Path) -> dict[str, str]:
    """Build and import the image; what it made, as the JSON line prints it."""
    built: dict[str, str] = await DEMO.build(
        state_dir, make_tar=build_tar, image=IMAGE, here=HERE, hint="run make_predictions.py"
    )
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/sandman"))
    parser.add_argument("--fetch-only", action="store_true", help="only fill the sdist cache")
    args = parser.parse_args()
    if args.fetch_only:
        print(json.dumps({p.name: str(sdist(p)) for p in PROJECTS}))
        return
    print(json.dumps(asyncio.run(build(args.state_dir))))


if __name__ == "__main__":
    main()
