"""Build the shipped evaluation instances: one Debian image holding four small repositories.

Offline apart from the OS package mirror: ``debootstrap`` makes a Debian
bookworm root with python3, pytest, Django, git and patch
(`sandman.images.debootstrap`; cached as a tarball under
``$SANDMAN_TEST_CACHE``, default ``/var/cache/sandman/test-images``, so only
the first build takes minutes); each repository under ``repos/`` becomes a git
repository at ``/testbed/<name>`` with fixed dates, so its commits have the
hashes ``instances.jsonl`` names; the image is imported into the local store
as ``sandman-eval-demo:1``. The tarball is built byte for byte the same from
the same cached base, so the image's id (its digest) is too.

Run as root: ``python examples/eval/build.py [--state-dir DIR]``. It prints one
JSON line: the image name, its id, and the instance and prediction files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from sandman.images import ImageStore
from sandman.images.debootstrap import DEFAULT_CACHE, build_debian_rootfs

HERE = Path(__file__).resolve().parent
IMAGE = "sandman-eval-demo:1"
SUITE = "bookworm"
PACKAGES = ("python3", "python3-pytest", "python3-django", "git", "patch")
# Bump when the recipe changes, so stale caches are not reused.
RECIPE = 1
# Every commit is made at this instant by this person, so its hash is the same on every machine.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "Sandman Eval",
    "GIT_AUTHOR_EMAIL": "eval@sandman.invalid",
    "GIT_COMMITTER_NAME": "Sandman Eval",
    "GIT_COMMITTER_EMAIL": "eval@sandman.invalid",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
    "LC_ALL": "C",
}


def cache_dir() -> Path:
    return Path(os.environ.get("SANDMAN_TEST_CACHE", DEFAULT_CACHE))


def base_tar() -> Path:
    """The cached Debian rootfs tarball, made by debootstrap first if missing."""
    return build_debian_rootfs(PACKAGES, suite=SUITE, recipe=RECIPE, cache_dir=cache_dir())


def _tar(root: Path, member: str, out: Path, *, append: bool = False) -> None:
    # Sorted, numeric owners and fixed times: the same tree makes the same bytes.
    subprocess.run(
        ["tar", "-rf" if append else "-cf", str(out), "--sort=name", "--numeric-owner",
         "--owner=0", "--group=0", "--mtime=@0", "-C", str(root), member],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip


def _git(repo: Path, *args: str, date: str = "2024-01-01T00:00:00Z") -> str:
    env = {**os.environ, **_GIT_ENV, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    done = subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    )
    return done.stdout.strip()


def make_repo(source: Path, target: Path) -> str:
    """A git repository at ``target`` from ``source``; returns the last commit's hash.

    ``source/commits/1``, ``2``... are the trees of successive commits (each
    a whole tree), so a repository can have history for ``git apply --3way``.
    """
    target.mkdir(parents=True)
    _git(target, "init", "-q", "-b", "main")
    for number, tree in enumerate(sorted((source / "commits").iterdir()), start=1):
        for old in target.iterdir():
            if old.name != ".git":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        shutil.copytree(tree, target, dirs_exist_ok=True)
        for path in target.rglob("*"):
            if ".git" not in path.parts:
                path.chmod(0o755 if path.is_dir() else 0o644)
        _git(target, "add", "-A")
        _git(target, "commit", "-q", "-m", f"commit {number}", date=f"2024-01-0{number}T00:00:00Z")
    _egg_info(target)
    # Packed and garbage-free, so the image holds only what the commits need.
    _git(target, "gc", "-q", "--aggressive", "--prune=now")
    # An index without stat data (git refreshes it on first use): the same bytes every build.
    _git(target, "read-tree", "HEAD")
    return _git(target, "rev-parse", "HEAD")


def _egg_info(repo: Path) -> None:
    """What ``pip install -e .`` leaves in a repository: metadata nobody tracks.

    Task images carry such files; the grader must not let a patch change them
    (an entry point in them can load a pytest plugin).
    """
    info = repo / f"{repo.name}.egg-info"
    info.mkdir()
    (info / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: {repo.name}\nVersion: 0.1\n")
    (info / "top_level.txt").write_text(f"{repo.name}\n")
    (info / "entry_points.txt").write_text("[console_scripts]\n")
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("*.egg-info/\n")
    for path in [info, *info.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def build_tar(out: Path) -> dict[str, str]:
    """The image's rootfs tarball at ``out``; returns each repository's HEAD commit."""
    heads: dict[str, str] = {}
    stage = Path(tempfile.mkdtemp(prefix="eval-repos-"))
    try:
        for source in sorted((HERE / "repos").iterdir()):
            heads[source.name] = make_repo(source, stage / "testbed" / source.name)
        shutil.copyfile(base_tar(), out)
        _tar(stage, "./testbed", out, append=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return heads


def check_instances(
    heads: dict[str, str], instances: Path = HERE / "instances.jsonl", hint: str = "update it"
) -> None:
    """The shipped instances name the commits just made (else the recipe drifted)."""
    for line in instances.read_text().splitlines():
        instance = json.loads(line)
        repo = Path(instance["repo_path"]).name
        if heads.get(repo) != instance["base_commit"]:
            raise SystemExit(
                f"{instance['instance_id']}: base_commit {instance['base_commit']} but the "
                f"builder made {heads.get(repo)} for {repo}; {hint}"
            )


async def build(
    state_dir: Path,
    *,
    make_tar: Callable[[Path], dict[str, str]] = build_tar,
    image: str = IMAGE,
    here: Path = HERE,
    hint: str = "update instances.jsonl",
) -> dict[str, str]:
    """Build and import the image; what it made, as the JSON line prints it.

    ``make_tar`` writes the rootfs tarball and returns each repository's
    HEAD; ``here`` holds the ``instances.jsonl`` and ``predictions.jsonl``
    that name them (the honest corpus's builder passes its own).
    """
    work = Path(tempfile.mkdtemp(prefix="eval-image-"))
    try:
        heads = make_tar(work / "rootfs.tar")
        check_instances(heads, here / "instances.jsonl", hint)
        built = await ImageStore(state_dir / "images").import_archive(
            work / "rootfs.tar", name=image
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "image": image,
        "image_id": built.id,
        "instances": str(here / "instances.jsonl"),
        "predictions": str(here / "predictions.jsonl"),
        **{f"head:{name}": head for name, head in heads.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/sandman"))
    parser.add_argument("--base-only", action="store_true", help="only warm the Debian cache")
    args = parser.parse_args()
    if args.base_only:
        print(base_tar())
        return
    print(json.dumps(asyncio.run(build(args.state_dir))))


if __name__ == "__main__":
    main()
