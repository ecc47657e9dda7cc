"""Test-log parsers, one per framework: a log in, ``{test name: status}`` out.

Each parser reads only the framework's own report section and stops at the
line that ends the run, so output a test (or the code under test) prints
elsewhere, before or after it, cannot add or overturn a result: pytest's
``-rA`` short summary, up to its final ``== N passed in Xs ==`` line; the
unittest and Django runners' verbose ``name (module.Class) ... ok`` lines, up
to the first failure report or the ``Ran N tests`` line, overruled by the
failure report's own ``FAIL:``/``ERROR:`` headers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from sandman.eval.instances import LogParser

__all__ = ["PARSERS", "TestStatus", "parse_django", "parse_log", "parse_pytest", "parse_unittest"]

TestStatus = Literal["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "MISSING"]
"""How a test ended; ``MISSING``: it is not in the log at all (a test not run does not pass)."""

_PYTEST_STATUSES: dict[str, TestStatus] = {
    "PASSED": "PASSED", "FAILED": "FAILED", "ERROR": "ERROR", "SKIPPED": "SKIPPED",
    "XFAIL": "XFAIL", "XPASS": "FAILED",  # an unexpected pass breaks a strict xfail
}  # fmt: skip
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_RUN_END = re.compile(r"^=+ .*\bin [\d.]+s\b.* =+$")
_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: |$)")


def parse_pytest(log: str) -> dict[str, TestStatus]:
    """Results from pytest run with ``-rA`` (or, without it, ``-v``).

    The first short test summary is read up to the run's final line.
    """
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if _SUMMARY_HEADER.match(line)), None)
    if start is None:
        return _parse_pytest_verbose(lines)
    results: dict[str, TestStatus] = {}
    for line in lines[start + 1 :]:
        if _RUN_END.match(line):
            break
        word, _, rest = line.partition(" ")
        status = _PYTEST_STATUSES.get(word)
        if status is None or not rest or rest.startswith("["):  # "SKIPPED [1] file:12: why"
            continue
        # "FAILED tests/x.py::test_y - AssertionError: ..." carries a message after " - ".
        name = rest.split(" - ", 1)[0] if status != "PASSED" else rest
        results[name.strip()] = status
    return results


def _parse_pytest_verbose(lines: list[str]) -> dict[str, TestStatus]:
    results: dict[str, TestStatus] = {}
    for line in lines:
        if _RUN_END.match(line):
            break
        match = _VERBOSE.match(line)
        if match:
            results[match[1]] = _PYTEST_STATUSES[match[2]]
    return results


_UNITTEST_STATUSES: dict[str, TestStatus] = {
    "ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": "XFAIL",
    "unexpected success": "FAILED",
}  # fmt: skip
_TEST_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_OUTCOME = re.compile(r" \.\.\. (ok|FAIL|ERROR|expected failure|unexpected success|skipped\b.*)$")
_BARE_OUTCOME = re.compile(r"^(ok|FAIL|ERROR|expected failure|unexpected success|skipped\b.*)$")
_UNITTEST_END = re.compile(r"^(=|-){70}$|^Ran \d+ tests? in ")
_REPORT_HEAD = re.compile(r"^(FAIL|ERROR): (\w+) \(([\w.]+)\)")


def _unittest_name(method: str, where: str) -> str:
    """``test_x (pkg.mod.Class)``, also from Python 3.11+'s ``(pkg.mod.Class.test_x)``."""
    return f"{method} ({where.removesuffix('.' + method)})"


def _outcome(word: str) -> TestStatus:
    return "SKIPPED" if word.startswith("skipped") else _UNITTEST_STATUSES[word]


def parse_unittest(log: str) -> dict[str, TestStatus]:
    """Results from ``python -m unittest -v``: ``test_x (module.Class) ... ok`` lines.

    A test that printed, or has a docstring, ends its line later: the name
    is remembered until a line ends in (or is) an outcome. The runner's own
    ``FAIL: test_x (module.Class)`` and ``ERROR: ...`` headers after the run
    have the last word: an "ok" the code under test printed right after the
    runner's ``test_x (module.Class) ... `` does not turn its failure into a pass.
    """
    results: dict[str, TestStatus] = {}
    pending: str | None = None
    lines = log.splitlines()
    end = len(lines)
    for i, line in enumerate(lines):
        if _UNITTEST_END.match(line):
            end = i
            break
        head = _TEST_HEAD.match(line)
        if head:
            pending = _unittest_name(head[1], head[2])
        outcome = _OUTCOME.search(line) or _BARE_OUTCOME.match(line)
        if outcome and pending is not None:
            results[pending] = _outcome(outcome[1])
            pending = None
    for line in lines[end:]:
        report = _REPORT_HEAD.match(line)
        if report:
            results[_unittest_name(report[2], report[3])] = _UNITTEST_STATUSES[report[1]]
    return results


def parse_django(log: str) -> dict[str, TestStatus]:
    """Results from Django's test runner at ``--verbosity 2`` (``./tests/runtests.py -v 2``).

    Its per-test lines are unittest's; around them it prints database set-up
    and system-check lines, which this skips.
    """
    kept = [
        line
        for line in log.splitlines()
        if not line.startswith(("Creating test database", "Cloning test database",
                                "Destroying test database", "System check identified",
                                "Testing against Django installed in", "Importing application",
                                "Found ", "Operations to perform", "Synchroniz", "Apply",
                                "Running ", "  Apply", "  Creating table", "  Running"))
    ]  # fmt: skip
    return parse_unittest("\n".join(kept))


PARSERS: dict[LogParser, Callable[[str], dict[str, TestStatus]]] = {
    "pytest": parse_pytest,
    "unittest": parse_unittest,
    "django": parse_django,
}


def parse_log(parser: LogParser, log: str) -> dict[str, TestStatus]:
    """The results ``parser`` finds in ``log``."""
    return PARSERS[parser](log)
