"""Patches that try to grade themselves: the verdict stays the one the code earns.

Each one leaves the calc-1 bug in place and tries to make the test run report
a pass anyway; each must be graded exactly like a patch that does nothing.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sandman.client import AsyncClient
from sandman.eval import evaluate_report
from tests.eval.conftest import CONDITIONS, EXAMPLES, Demo
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the image
]

F2P = "tests/test_stats.py::test_median_even"

# A pytest plugin that reports every test as passed, and a file that loads it.
PLUGIN = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""


def diff(path: str, old: str | None, new: str) -> str:
    """A git-style diff turning ``old`` (None: no file) into ``new`` at ``path``."""
    body = "".join(
        difflib.unified_diff(
            (old or "").splitlines(keepends=True), new.splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{path}", f"b/{path}",
        )
    )  # fmt: skip
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if old is None else "")
    return header + body


def stats_patch(line: str, before: str) -> str:
    """A patch of calc/stats.py that puts the lines ``before`` in front of ``line``."""
    original = (EXAMPLES / "repos/calc/commits/1/calc/stats.py").read_text()
    changed = original.replace(line, before + line)
    assert changed != original, line
    return diff("calc/stats.py", original, changed)


# How each patch gets the plugin loaded; the paths that must be set back.
LOADERS: dict[str, tuple[str, list[str]]] = {
    # Package metadata in the repository root, which is on sys.path: pytest
    # loads the entry point's plugin by itself.
    "dist-info": (
        diff("evil-1.dist-info/METADATA", None, "Metadata-Version: 2.1\nName: evil\nVersion: 1\n")
        + diff("evil-1.dist-info/entry_points.txt", None, "[pytest11]\nevil = evil_plugin\n"),
        ["evil-1.dist-info/METADATA", "evil-1.dist-info/entry_points.txt"],
    ),
    # The same through the metadata ``pip install -e`` left in the image,
    # which git does not track.
    "egg-info": (
        diff(
            "calc.egg-info/entry_points.txt",
            "[console_scripts]\n",
            "[console_scripts]\n\n[pytest11]\nevil = evil_plugin\n",
        ),
        ["calc.egg-info/entry_points.txt"],
    ),
    # pytest's configuration, in the two files that are not pytest's own.
    "setup.cfg": (
        diff("setup.cfg", None, "[tool:pytest]\naddopts = -p evil_plugin\n"),
        ["setup.cfg"],
    ),
    "pyproject.toml": (
        diff("pyproject.toml", None, '[tool.pytest.ini_options]\naddopts = "-p evil_plugin"\n'),
        ["pyproject.toml"],
    ),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
async def test_a_plugin_the_patch_smuggles_in_is_not_loaded(
    demo: Demo, client: AsyncClient, loader: str
) -> None:
    instance, _ = demo.shipped("calc-1", "gold")
    loading, loaders = LOADERS[loader]
    patch = diff("evil_plugin.py", None, PLUGIN) + loading
    report = await evaluate_report(instance, patch, client=client, conditions=CONDITIONS)
    verdict = report.verdict
    assert verdict.applied_with == "git apply", report.apply_attempts
    assert verdict.reverted == loaders
    assert verdict.status == "unresolved", verdict.reason
    assert verdict.fail_to_pass == {F2P: "FAILED"}
    assert "evil_plugin" not in report.test_output


async def test_a_summary_printed_by_the_code_under_test_does_not_count(
    demo: Demo, client: AsyncClient
) -> None:
    # The bug stays; mean(), which passing tests call, prints a pytest summary that
    # claims the FAIL_TO_PASS test passed. With -rA pytest shows that output (in its
    # PASSES section) before its own summary; the grade must come from pytest's.
    instance, _ = demo.shipped("calc-1", "gold")
    fake = (
        "========== short test summary info ==========\n"
        f"PASSED {F2P}\n"
        "========== 4 passed in 0.01s =========="
    )
    patch = stats_patch("    return sum(values) / len(values)\n", f"    print({fake!r})\n")
    report = await evaluate_report(instance, patch, client=client, conditions=CONDITIONS)
    assert report.test_output.count("short test summary info") >= 2  # the fake was there
    assert report.verdict.status == "unresolved", report.verdict.reason
    # The fake names the test as listed, and no test of that name ran: the run
    # had renamed it. Its real result (FAILED) is the one the summary it hid.
    assert report.verdict.fail_to_pass[F2P] in ("FAILED", "MISSING")
    assert any("had renamed" in s for s in report.verdict.suspicious), report.verdict.suspicious


# What the code under test does after printing a summary that claims a pass:
# the test process ends before pytest's own summary, in two ways.
ENDINGS = {
    # A SIGKILL that is not the OOM killer's: not an "oom" verdict either.
    "sigkill": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    # A clean exit: pytest's summary never comes.
    "exit": "import os; os._exit(0)",
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
async def test_a_test_run_ended_by_the_code_under_test_is_graded_on_pytests_word(
    demo: Demo, client: AsyncClient, ending: str
) -> None:
    instance, _ = demo.shipped("calc-1", "gold")
    # No newline at the end: the harness's end marker must still be found.
    fake = f"========== short test summary info ==========\nPASSED {F2P}"
    # Past pytest's capture: straight to the test command's own output.
    claim = f"open('/proc/%d/fd/1' % __import__('os').getppid(), 'w').write({fake!r})"
    patch = stats_patch("    ordered = sorted(values)\n", f"    {claim}\n    {ENDINGS[ending]}\n")
    report = await evaluate_report(instance, patch, client=client, conditions=CONDITIONS)
    assert f"PASSED {F2P}" in report.test_output  # the claim was made
    assert report.verdict.status == "unresolved", report.verdict.reason
    assert report.verdict.fail_to_pass == {F2P: "MISSING"}


def git_patch(work: Path, change: Callable[[Path], None]) -> str:
    """The patch (as git writes it, symlinks and renames too) that ``change`` makes to
    a copy of calc at its base commit."""
    repo = work / "calc"
    shutil.copytree(EXAMPLES / "repos/calc/commits/1", repo)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(work), "PATH": os.environ["PATH"]}  # fmt: skip

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "base")
    change(repo)
    git("add", "-A")
    return git("diff", "--cached", "--binary", "HEAD")


async def test_test_files_swapped_for_a_symlink_are_set_back(
    demo: Demo, client: AsyncClient, tmp_path: Path
) -> None:
    # tests/ becomes a symlink to a directory of tests that all pass.
    def swap(repo: Path) -> None:
        fake = repo / "faketests"
        fake.mkdir()
        (fake / "__init__.py").write_text("")
        (fake / "test_stats.py").write_text(
            "".join(f"def {name}():\n    assert True\n\n\n" for name in
                    ("test_mean", "test_mean_empty", "test_median_odd", "test_median_even"))
        )  # fmt: skip
        shutil.rmtree(repo / "tests")
        (repo / "tests").symlink_to("faketests")

    instance, _ = demo.shipped("calc-1", "gold")
    patch = git_patch(tmp_path, swap)
    assert "new file mode 120000" in patch
    report = await evaluate_report(instance, patch, client=client, conditions=CONDITIONS)
    verdict = report.verdict
    assert verdict.applied_with is not None, report.apply_attempts
    assert "tests" in verdict.reverted
    assert verdict.status == "unresolved", verdict.reason
    assert verdict.fail_to_pass == {F2P: "FAILED"}


# pre_test runs the patch's build (a reinstall runs setup.py): before it the
# grader has nothing on disk, every command of it counts, and what it writes
# into the test framework is evidence.


@pytest.mark.parametrize(
    ("pre_test", "status", "said"),
    [
        pytest.param(
            [
                # Fails (and so fails the run) if the witness or its key is there:
                # only the patches and git's index snapshots are.
                "test -z \"$(find /tmp/sandman-eval -type f ! -name '*.patch' ! -name '*.index')\"",
                "export FROM_PRE_TEST=1",
            ],
            "resolved", "PASS_TO_PASS tests pass", id="finds-nothing-of-the-grader",
        ),
        pytest.param(
            ["true", "false", "true"], "error", "pre-test command 2 failed",
            id="every-command-counts",
        ),
        pytest.param(
            ["echo '# built' >> /usr/lib/python3/dist-packages/_pytest/runner.py"],
            "unresolved", "changed the test framework's files", id="rewrites-the-framework",
        ),
        pytest.param(
            ["git config filter.evil.smudge 'sed s/assert/pass/'"],
            "unresolved", "git configuration", id="changes-git-s-configuration",
        ),
    ],
)  # fmt: skip
async def test_a_build_is_graded_on_what_it_did(
    demo: Demo, client: AsyncClient, pre_test: list[str], status: str, said: str
) -> None:
    instance, patch = demo.shipped("calc-1", "gold")
    build = instance.model_copy(update={"pre_test": pre_test})
    report = await evaluate_report(build, patch, client=client, conditions=CONDITIONS)
    assert report.verdict.status == status, report.verdict.reason
    assert said in report.verdict.reason


async def test_a_new_top_level_module_that_shadows_an_installed_one_is_set_back(
    demo: Demo, client: AsyncClient
) -> None:
    # pytest/ at the root comes first on sys.path under `python3 -m pytest`;
    # a new module of the project's own does not shadow anything and stays.
    instance, gold = demo.shipped("calc-1", "gold")
    shadow = diff("pytest/__init__.py", None, "raise SystemExit('shadowed')\n")
    own = diff("calc_extra.py", None, "VALUE = 1\n")
    report = await evaluate_report(
        instance, gold + shadow + own, client=client, conditions=CONDITIONS
    )
    assert report.verdict.status == "resolved", report.verdict.reason
    assert "pytest/__init__.py" in report.verdict.reverted
    assert "calc_extra.py" not in report.verdict.reverted
