"""What a model patch may change, stated positively, and what it may not name.

Pure: paths and patch text in, decisions out. `is_protected` is everything
the interpreter or the test framework reads before a test runs; the harness
sets back whatever of it a patch (or its build, in ``pre_test``) changed.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import shlex

from sandman.eval.instances import Instance

__all__ = ["DEFAULT_PROTECTED", "binary_hunks", "git_paths", "is_protected"]

DEFAULT_PROTECTED = (
    "conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
    "setup.cfg", "pyproject.toml", ".gitattributes",
)  # fmt: skip
"""File names a model patch may not add or change anywhere in the repository.

pytest reads its configuration (``addopts``, ``-p`` plugins, warning filters)
from all of the ``.ini``, ``.cfg`` and ``.toml`` ones; the test run never
reinstalls the package, so their other contents cannot matter to it.
``.gitattributes`` decides how the grader's own checkouts write files.
"""
# Package metadata (an entry point in one on sys.path, as the repository root
# is, makes pytest load a plugin by itself; importlib.metadata matches its
# names without regard to case), startup hooks and bytecode: what the
# interpreter or the framework reads before any test runs.
_METADATA_DIRS = (".dist-info", ".egg-info")
_STARTUP_MODULES = ("sitecustomize", "usercustomize")
_BYTECODE = (".pyc", ".pyo")
_STARTUP_SUFFIXES = (".pth", ".egg-link")

_BINARY_HUNK = re.compile(r"^(?:GIT binary patch|Binary files .* differ)$", re.MULTILINE)
# Every header a patch program reads a path from (GNU patch also takes Index:,
# Prereq-less context diffs' *** and ---, and git's rename/copy lines).
_PATCH_PATH = re.compile(
    r"^(?:diff --git a/(\S+) b/(\S+)|(?:---|\+\+\+|\*\*\*) (?:[ab]/)?(\S+)"
    r"|Index: (?:[ab]/)?(\S+)|(?:rename|copy) (?:from|to) (\S+))",
    re.MULTILINE,
)
_TEST_DIRS = frozenset({"test", "tests", "testing"})


def is_protected(instance: Instance, path: str, listed_files: frozenset[str] = frozenset()) -> bool:
    """Whether a model patch's change to ``path`` is set back before the tests run.

    Protected, stated as what the interpreter and the test framework read
    before a test runs: the test patch's files and the files defining a listed
    test (``listed_files``); everything under a test directory (``test``,
    ``tests``, ``testing``, ``test_*``) holding one of them; the files the
    test command names; the `DEFAULT_PROTECTED` names anywhere; package
    metadata (``*.dist-info``, ``*.egg-info``, any case) and ``*.pth`` and
    ``*.egg-link`` files; ``sitecustomize``/``usercustomize`` in any form (a
    module, a package, an extension); bytecode (``__pycache__``, ``*.pyc``);
    the instance's ``protected`` globs.
    """
    name = posixpath.basename(path)
    parts = path.split("/")
    folded = name.lower()
    if path in instance.test_files or path in listed_files or name in DEFAULT_PROTECTED:
        return True
    if folded.endswith(_STARTUP_SUFFIXES + _BYTECODE) or "__pycache__" in parts:
        return True
    if any(part.lower().endswith(_METADATA_DIRS) for part in parts[:-1]):
        return True
    if any(part.split(".")[0] in _STARTUP_MODULES for part in parts):
        return True
    if path in _named_files(instance):
        return True
    for test_file in instance.test_files:
        parts = test_file.split("/")[:-1]
        # The outermost test directory: tests/ for tests/queries/tests.py.
        for depth, name in enumerate(parts, start=1):
            if name in _TEST_DIRS or name.startswith("test_"):
                if path.startswith("/".join(parts[:depth]) + "/"):
                    return True
                break
    return any(fnmatch.fnmatchcase(path, glob) for glob in instance.protected)


def _named_files(instance: Instance) -> set[str]:
    """The repository files the test command and its directives name (``tests/runtests.py``)."""
    try:
        words = shlex.split(instance.test_cmd)
    except ValueError:
        words = instance.test_cmd.split()
    return {
        posixpath.normpath(w)
        for w in [*words, *instance.directives]
        if "/" in w or w.endswith(".py")
    }


def binary_hunks(patch: str) -> int:
    """How many binary hunks (``GIT binary patch``, ``Binary files ... differ``) ``patch`` holds."""
    return len(_BINARY_HUNK.findall(patch))


def git_paths(patch: str) -> list[str]:
    """The paths inside ``.git`` a patch names (``patch`` would write there; ``git apply`` not).

    A patch that may touch the repository's own database (refs, replace
    objects, config, hooks) could change what the harness checks out, so it
    is refused.
    """
    found = []
    for match in _PATCH_PATH.finditer(patch):
        for path in filter(None, match.groups()):
            if ".git" in path.split("/") and path not in found:
                found.append(path)
    return found
