"""Our log parsers and grading against the official ``swebench`` package's, log by log.

The package (``pip install --no-deps swebench==5.0.2 unidiff``, done by
scripts/setup) is imported narrowly: ``swebench.harness``'s ``__init__``
pulls in docker and modal, so the test registers a bare package in its place
and imports only ``constants``, ``log_parsers`` and ``grading`` (stdlib,
``unidiff``). Grading imports only its Python log parsers, the same way, for a
verdict's ``official`` (`parse_log_officially`: ours where the package is missing).

The logs are in ``tests/eval/logs/<family>/``; ``cases.json`` gives each one's
FAIL_TO_PASS and PASS_TO_PASS lists and the test command's exit status. A
case marked ``divergence`` is one where our stricter reading differs from the
official one on purpose: a forged log, or pytest's own test suite printing an
inner run's summary (see docs/evaluation.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, cast, get_args

import pytest

from sandman.eval import Instance, parse_log
from sandman.eval import swebench as table
from sandman.eval.canaries import Plan
from sandman.eval.instances import LogParser
from sandman.eval.judge import judge
from sandman.eval.parsers import OFFICIAL_PARSERS, TestStatus, parse_log_officially
from sandman.eval.verdict import grade_tests
from sandman.models import ExecResult

LOGS = Path(__file__).parent / "logs"
CASES: list[dict[str, Any]] = json.loads((LOGS / "cases.json").read_text())
OFFICIAL_NAMES: dict[str, str] = {
    "pytest": "parse_log_pytest",
    "pytest_options": "parse_log_pytest_options",
    "pytest_v2": "parse_log_pytest_v2",
    "matplotlib": "parse_log_matplotlib",
    "seaborn": "parse_log_seaborn",
    "django": "parse_log_django",
    "sympy": "parse_log_sympy",
}
SWEBENCH_VERSION = "5.0.2"


def _official() -> types.SimpleNamespace:
    spec = importlib.util.find_spec("swebench")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            f"the swebench package is not installed: pip install --no-deps "
            f"swebench=={SWEBENCH_VERSION} unidiff (scripts/setup does)"
        )
    root = importlib.import_module("swebench")
    assert root.__version__ == SWEBENCH_VERSION, root.__version__
    for package in ("harness", "image_builder"):
        # Their __init__s import docker, modal...: skip them, keep the submodules.
        if f"swebench.{package}" not in sys.modules:
            bare = types.ModuleType(f"swebench.{package}")
            bare.__path__ = [str(Path(spec.submodule_search_locations[0]) / package)]
            sys.modules[f"swebench.{package}"] = bare
    return types.SimpleNamespace(
        grading=importlib.import_module("swebench.harness.grading"),
        log_parsers=importlib.import_module("swebench.harness.log_parsers"),
        python=importlib.import_module("swebench.harness.log_parsers.python"),
        types=importlib.import_module("swebench.types"),
        constants=importlib.import_module("swebench.harness.constants"),
    )


@pytest.fixture(scope="module")
def official() -> types.SimpleNamespace:
    return _official()


def _spec(official: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    return official.types.TestSpec(
        instance_id="repo__repo-1",
        image="unused",
        eval_script_list=[],
        repo="repo/repo",
        version="1.0",
        FAIL_TO_PASS=case["FAIL_TO_PASS"],
        PASS_TO_PASS=case["PASS_TO_PASS"],
        log_parser=OFFICIAL_NAMES[case["parser"]],
        eval_type="pass_and_fail",
    )


def _official_map(official: types.SimpleNamespace, case: dict[str, Any], log: str) -> Any:
    parser = official.log_parsers.PARSER_REGISTRY[OFFICIAL_NAMES[case["parser"]]]
    return parser(log, _spec(official, case))


def _official_resolved(
    official: types.SimpleNamespace, case: dict[str, Any], log: str, tmp_path: Path
) -> bool:
    """The whole official path: the eval log as its harness writes it, then get_eval_report."""
    c = official.constants
    path = tmp_path / "test_output.txt"
    path.write_text(
        f"+ : '{c.START_TEST_OUTPUT}'\n{log}+ SWEBENCH_TEST_EXIT_CODE={case['exit_code']}\n"
        f"+ : '{c.END_TEST_OUTPUT}'\n{c.TEST_EXIT_CODE}: {case['exit_code']}\n"
    )
    prediction = {"instance_id": "repo__repo-1", "model_name_or_path": "m", "model_patch": "x"}
    report = official.grading.get_eval_report(_spec(official, case), prediction, str(path), True)
    return bool(report["repo__repo-1"]["resolved"])


def _ours(case: dict[str, Any], log: str) -> tuple[str, dict[str, TestStatus]]:
    instance = Instance(
        instance_id="repo__repo-1", image="unused", base_commit="abcd", test_patch="",
        test_cmd="unused", log_parser=case["parser"], FAIL_TO_PASS=case["FAIL_TO_PASS"],
        PASS_TO_PASS=case["PASS_TO_PASS"],
    )  # fmt: skip
    results = parse_log(case["parser"], log)
    return grade_tests(instance, results, exit_code=case["exit_code"])[0], results


def _id(case: dict[str, Any]) -> str:
    return f"{case['log']}:{','.join(case['FAIL_TO_PASS'])[:40]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_parsers_and_verdicts_match_the_official_ones(
    case: dict[str, Any], official: types.SimpleNamespace, tmp_path: Path
) -> None:
    log = (LOGS / case["log"]).read_text()
    theirs = _official_map(official, case, log)
    # SWE-bench's line rules, to the letter, on every log (honest or not).
    assert parse_log(case["parser"], log, strict=False) == theirs
    status, ours = _ours(case, log)
    resolved = _official_resolved(official, case, log, tmp_path)
    if case.get("divergence") is None:
        # On an honest log, reading only the framework's report changes nothing. (Django:
        # a test with a docstring is also found under its own name, an extra key.)
        extra = {k: v for k, v in ours.items() if k not in theirs}
        assert {k: v for k, v in ours.items() if k in theirs} == theirs
        assert all(re.fullmatch(r"\w+ \([\w.]+\)", k) for k in extra), extra
        assert (status == "resolved") == resolved, (status, resolved)
    elif case["divergence"] == "forged":
        # Output printed around the framework's report fools the official reading, not ours.
        assert ours != theirs
        assert (status, resolved) == ("unresolved", True)
    else:
        # pytester's inner summary, in the captured output, comes first: without the
        # harness's summary mark our reading takes it for the run's (docs/evaluation.md).
        assert case["divergence"] == "pytester"
        assert (status, resolved) == ("unresolved", True)


def test_every_family_has_logs() -> None:
    covered = {case["parser"] for case in CASES}
    assert covered == set(OFFICIAL_NAMES)
    assert set(OFFICIAL_NAMES) == set(get_args(LogParser)) - {"unittest"}


def test_a_naive_parser_would_be_caught(official: types.SimpleNamespace) -> None:
    # The comparison has teeth: whole pytest names (what a careful parser would
    # keep) are not what SWE-bench's lists hold.
    case = next(c for c in CASES if c["log"] == "pytest/mixed.log")
    log = (LOGS / case["log"]).read_text()
    naive = parse_log("pytest_v2", log)
    assert naive != _official_map(official, case, log)
    assert "tests/test_basic.py::test_method_route[get - with space]" in naive


def test_the_repository_table_matches(official: types.SimpleNamespace) -> None:
    by_function = {id(f): name for name, f in official.log_parsers.PARSER_REGISTRY.items()}
    theirs = {
        repo: by_function[id(parser)]
        for repo, parser in official.python.MAP_REPO_TO_PARSER_PY.items()
    }
    ours = {repo: OFFICIAL_NAMES[name] for repo, name in table.PARSER_BY_REPO.items()}
    # parse_log_astropy is parse_log_pytest_v2, etc.: compare the functions' canonical names.
    canonical = {
        name: by_function[id(official.log_parsers.PARSER_REGISTRY[name])]
        for name in OFFICIAL_NAMES.values()
    }
    assert {repo: canonical[name] for repo, name in ours.items()} == theirs


STATUSES: list[str | None] = ["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", None]


def test_grading_matches_on_every_combination(official: types.SimpleNamespace) -> None:
    """Every status (or none) for two FAIL_TO_PASS and one PASS_TO_PASS test, and truncated ids."""
    grading = official.grading
    names = ["t.py::test_a", "t.py::test_b[x", "t.py::test_c"]
    for statuses in itertools.product(STATUSES, repeat=3):
        results: dict[str, TestStatus] = {"t.py::other": "PASSED"}
        for name, status in zip(names, statuses, strict=True):
            if status is not None:
                key = name + " y]" if name.endswith("[x") else name
                results[key] = cast(TestStatus, status)
        instance = Instance(
            instance_id="r-1", image="i", base_commit="abcd", test_patch="", test_cmd="c",
            FAIL_TO_PASS=names[:2], PASS_TO_PASS=names[2:],
        )  # fmt: skip
        gold = {"FAIL_TO_PASS": names[:2], "PASS_TO_PASS": names[2:]}
        report = grading.get_eval_tests_report(dict(results), gold)
        theirs = grading.get_resolution_status(report) == "RESOLVED_FULL"
        assert (grade_tests(instance, results)[0] == "resolved") == theirs, statuses


def test_swebench_rows_derive_what_the_official_harness_does(
    official: types.SimpleNamespace,
) -> None:
    # The exit-code marker and the image name as swebench 5 writes them.
    image = importlib.import_module("swebench.image_builder.image_spec").ImageSpec(
        instance_id="django__django-11099", dockerfile="FROM x", namespace="swebench"
    )
    assert table.image_name("django__django-11099") == image.name
    assert official.constants.TEST_EXIT_CODE == ">>>>> Test Exit Code"


# -- a verdict's ``official``: read by the package's own parser where it is importable -------

FORGED = """\
============================= test session starts ==============================
collected 1 item

tests/test_stats.py F                                                    [100%]

=========================== short test summary info ============================
FAILED tests/test_stats.py::test_median_even - assert 3 == 2.5
============================== 1 failed in 0.01s ===============================
PASSED tests/test_stats.py::test_median_even
"""


def test_the_official_reading_is_the_package_s(official: types.SimpleNamespace) -> None:
    assert OFFICIAL_PARSERS == OFFICIAL_NAMES
    for case in CASES:
        log = (LOGS / case["log"]).read_text()
        results, parser = parse_log_officially(case["parser"], log)
        assert parser == f"swebench=={SWEBENCH_VERSION}:{OFFICIAL_NAMES[case['parser']]}"
        theirs = _official_map(official, case, log)
        # Django: a test with a docstring also under its own name, an extra key.
        assert {k: v for k, v in results.items() if k in theirs} == theirs
        extra = {k for k in results if k not in theirs}
        assert all(re.fullmatch(r"\w+ \([\w.]+\)", k) for k in extra), extra
        assert not extra or case["parser"] == "django"


def test_a_verdict_s_official_grade_is_the_package_s_reading(
    official: types.SimpleNamespace,
) -> None:
    # A pass printed after pytest's last line: our reading ignores it, SWE-bench's
    # (every line, the last word wins) takes it, and ``official`` says so.
    instance = Instance(
        instance_id="calc-1", image="unused", base_commit="abcd", test_patch="",
        test_cmd="unused", log_parser="pytest",
        FAIL_TO_PASS=["tests/test_stats.py::test_median_even"], PASS_TO_PASS=[],
    )  # fmt: skip
    run = ExecResult(
        exit_code=1, stdout=FORGED, stderr="", timed_out=False, truncated=False,
        duration_seconds=0.1,
    )  # fmt: skip
    judged = judge(
        instance, run, plan=Plan(), key=b"k", mode=None, strict=True, leads=[], strong=[]
    )
    assert judged.status == "unresolved", judged.reason
    assert (judged.official, judged.official_parser) == (
        "resolved",
        f"swebench=={SWEBENCH_VERSION}:parse_log_pytest",
    )


def _officially_in_a_child(parser: str, log: str, setup: str, path: Path | None = None) -> Any:
    """``parse_log_officially(parser, log)`` after ``setup``, in a fresh interpreter."""
    code = (
        f"import json, sys\n{setup}\n"
        "from sandman.eval.parsers import parse_log_officially\n"
        f"print(json.dumps([parse_log_officially({parser!r}, {log!r}), "
        "sorted(m for m in sys.modules if m.startswith('swebench.harness'))]))"
    )
    paths = [str(path)] if path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_whatever_swebench_package_is_importable_reads_the_log(tmp_path: Path) -> None:
    # A package of that name whose parser says what no log does: it is what reads the
    # log, imported without the harness's __init__s (the real ones import docker).
    root = tmp_path / "swebench"
    (root / "harness" / "log_parsers").mkdir(parents=True)
    (root / "__init__.py").write_text("__version__ = '0.0.fake'\n")
    (root / "types.py").write_text("TestSpec = object\n")
    for package in (root / "harness", root / "harness" / "log_parsers"):
        (package / "__init__.py").write_text("raise ImportError('no docker here')\n")
    (root / "harness" / "log_parsers" / "python.py").write_text(
        "from swebench.types import TestSpec\n\n\n"
        "def parse_log_pytest(log: str, test_spec: TestSpec) -> dict[str, str]:\n"
        "    return {'fake.py::test_said': 'PASSED', 'fake.py::test_odd': 'NOT A STATUS'}\n"
    )
    (results, parser), left = _officially_in_a_child("pytest", FORGED, "", tmp_path)
    assert (results, parser) == (
        {"fake.py::test_said": "PASSED"},
        "swebench==0.0.fake:parse_log_pytest",
    )
    assert left == []  # the stand-ins for its __init__s are gone: a later import gets them
    # unittest has no SWE-bench parser: ours.
    (_, parser), _ = _officially_in_a_child("unittest", "", "", tmp_path)
    assert parser == "sandman:unittest"


def test_without_the_package_ours_reads_the_log_as_it_would() -> None:
    (results, parser), _ = _officially_in_a_child(
        "pytest", FORGED, "sys.modules['swebench'] = None  # not importable"
    )
    assert parser == "sandman:pytest"
    assert results == parse_log("pytest", FORGED, strict=False)
    assert results["tests/test_stats.py::test_median_even"] == "PASSED"
