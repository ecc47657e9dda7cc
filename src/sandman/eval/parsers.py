"""Test-log parsers, one per log format: a log in, ``{test name: status}`` out.

Two rules per parser:

- **what a line means** is SWE-bench's (the ``swebench`` package's
  ``harness/log_parsers/python.py``), to the letter, so that test names match
  the ``FAIL_TO_PASS``/``PASS_TO_PASS`` lists of its datasets, which that code
  wrote: ``parse_log_pytest`` keeps a name up to its first space
  (``test_x[a b]`` is ``test_x[a``), Django's runner names a test with a
  docstring by the docstring's first line, sympy's by the function alone,
  seaborn's parser ignores skipped and errored tests, and so on;
- **which lines are read** is stricter: only the framework's own report
  section, up to the line that ends the run, so output a test (or the code
  under test) prints elsewhere, before or after it, cannot add or overturn a
  result: pytest's ``-rA`` short test summary up to its final
  ``== N passed in Xs ==`` line; the Django and unittest runners' per-test
  lines up to the first failure report or the ``Ran N tests`` line, overruled
  by the failure report's own ``FAIL:``/``ERROR:`` headers; sympy's report
  between ``test process starts`` and ``tests finished``.

``parse_log(parser, log, strict=False)`` reads every line, as SWE-bench does.
On an honest log both give the same map, but for the cases listed in
``docs/evaluation.md`` (pytest's own test suite prints inner pytest runs'
summaries in its captured output; see ``tests/eval/test_parity.py``).

``parse_log_officially`` is SWE-bench's own reading, for a verdict's
``official``: the ``swebench`` package's parser where it is importable, else
ours with ``strict=False``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import re
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal, get_args

from sandman.eval.instances import LogParser

__all__ = [
    "OFFICIAL_PARSERS",
    "PARSERS",
    "TestStatus",
    "parse_django",
    "parse_log",
    "parse_log_officially",
    "parse_pytest",
    "parse_sympy",
    "parse_unittest",
]

logger = logging.getLogger(__name__)

TestStatus = Literal["PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "MISSING"]
"""How a test ended; ``MISSING``: it is not in the log at all (a test not run does not pass)."""

# SWE-bench's TestStatus, in its order: a line is a result if it starts with one.
_WORDS = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")
_STATUSES: frozenset[str] = frozenset(_WORDS)
_SKIP_COUNT = re.compile(r"^\[\d+\]$")  # "SKIPPED [2] file.py:12: why": [2] is no test
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_SESSION_START = re.compile(r"^=+ test session starts =+$")
_SECTION = re.compile(r"^=+ .* =+$")
# pytest's last line: "== 1 failed, 2 passed in 0.07s ==", older "in 0.07 seconds".
_RUN_END = re.compile(r"^=+ .*\bin [\d.]+ ?s(?:econds)?\b.* =+$")
_OPTION = re.compile(r"(.*?)\[(.*)\]")
_ANSI = re.compile(r"\[(\d+)m")
_CONTROL = str.maketrans("", "", "".join(chr(c) for c in range(1, 32)))

Rule = Callable[[Iterable[str]], dict[str, TestStatus]]


def _status(word: str) -> TestStatus | None:
    return word if word in _STATUSES else None  # type: ignore[return-value]


def _summary_entry(line: str) -> tuple[str, TestStatus] | None:
    """``STATUS name ...`` as ``parse_log_pytest`` reads it: the name ends at the first space."""
    if not line.startswith(_WORDS):
        return None
    if line.startswith("FAILED"):
        line = line.replace(" - ", " ")
    parts = line.split()
    status = _status(parts[0]) if len(parts) > 1 else None
    if status is None or (status == "SKIPPED" and _SKIP_COUNT.match(parts[1])):
        return None
    return parts[1], status


def _rule_pytest(lines: Iterable[str]) -> dict[str, TestStatus]:
    results: dict[str, TestStatus] = {}
    for line in lines:
        if entry := _summary_entry(line):
            results[entry[0]] = entry[1]
    return results


def _rule_matplotlib(lines: Iterable[str]) -> dict[str, TestStatus]:
    return _rule_pytest(
        line.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3") for line in lines
    )


def _rule_pytest_options(lines: Iterable[str]) -> dict[str, TestStatus]:
    """``parse_log_pytest_options``: a parameter that is a path keeps only its last part."""
    results: dict[str, TestStatus] = {}
    for line in lines:
        if not (entry := _summary_entry(line)):
            continue
        name, status = entry
        if option := _OPTION.search(name):
            main, param = option.groups()
            if param.startswith("/") and not param.startswith("//") and "*" not in param:
                param = "/" + param.split("/")[-1]
            name = f"{main}[{param}]"
        results[name] = status
    return results


def _clean_v2(line: str) -> str:
    return _ANSI.sub("", line).translate(_CONTROL)


def _rule_pytest_v2(lines: Iterable[str]) -> dict[str, TestStatus]:
    """``parse_log_pytest_v2``: whole names (spaces kept), also from ``-v`` lines ``name STATUS``."""
    results: dict[str, TestStatus] = {}
    for raw in lines:
        line = _clean_v2(raw)
        if line.startswith(_WORDS):
            if line.startswith("FAILED"):
                line = line.split(" - ", 1)[0]
            parts = line.split()
            status = _status(parts[0]) if len(parts) >= 2 else None
            if status is not None and not (status == "SKIPPED" and _SKIP_COUNT.match(parts[1])):
                results[" ".join(parts[1:])] = status
        elif line.endswith(_WORDS):
            parts = line.split()
            status = _status(parts[-1]) if len(parts) >= 2 else None
            if status is not None:
                results[" ".join(parts[:-1])] = status
    return results


def _rule_seaborn(lines: Iterable[str]) -> dict[str, TestStatus]:
    """``parse_log_seaborn``: passes and failures only (skips, xfails and errors are left out)."""
    results: dict[str, TestStatus] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        if line.startswith("FAILED"):
            results[parts[1]] = "FAILED"
        elif " PASSED " in line:
            if parts[1] == "PASSED":
                results[parts[0]] = "PASSED"
        elif line.startswith("PASSED"):
            results[parts[1]] = "PASSED"
    return results


def _pytest_section(
    lines: list[str], clean: Callable[[str], str] = str, progress: bool = False
) -> list[str]:
    """pytest's first short test summary, up to the run's last line.

    Without one (no ``-rA``, or pytest never got that far), every line up to
    the run's last line. With ``progress``, the ``-v`` result lines before the
    first section (``== FAILURES ==``...) come first: old pytest's summary
    names no skipped test (``SKIP [1] file:12: why``), its ``-v`` line does.
    """
    cleaned = [clean(line) for line in lines]
    start = next((i for i, line in enumerate(cleaned) if _SUMMARY_HEADER.match(line)), -1)
    section = []
    if progress and start >= 0:
        begun = next((i for i, line in enumerate(cleaned) if _SESSION_START.match(line)), None)
        if begun is not None:
            for line, plain in zip(
                lines[begun + 1 : start], cleaned[begun + 1 : start], strict=True
            ):
                if _SECTION.match(plain):
                    break
                section.append(line)
    for line, plain in zip(lines[start + 1 :], cleaned[start + 1 :], strict=True):
        if _RUN_END.match(plain):
            break
        section.append(line)
    return section


def _pytest_parser(
    rule: Rule, clean: Callable[[str], str] = str, progress: bool = False
) -> Callable[[str, bool], dict[str, TestStatus]]:
    def parse(log: str, strict: bool = True) -> dict[str, TestStatus]:
        lines = log.split("\n")
        return rule(_pytest_section(lines, clean, progress) if strict else lines)

    return parse


parse_pytest = _pytest_parser(_rule_pytest)
parse_pytest.__doc__ = "Results from pytest ``-rA`` as ``parse_log_pytest`` names them."
parse_pytest_options = _pytest_parser(_rule_pytest_options)
parse_pytest_v2 = _pytest_parser(_rule_pytest_v2, _clean_v2, progress=True)
parse_matplotlib = _pytest_parser(_rule_matplotlib)
parse_seaborn = _pytest_parser(_rule_seaborn)


# -- Django ---------------------------------------------------------------------------------

_DJANGO_PASS = (" ... ok", " ... OK", " ...  OK")
# A long print that interrupts the runner's own "... ok" (parse_log_django's patterns).
_DJANGO_INTERRUPTED = tuple(
    re.compile(pattern, re.MULTILINE)
    for pattern in (
        r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
        r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
        r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
    )
)
_UNITTEST_END = re.compile(r"^(=|-){70}$|^Ran \d+ tests? in ")
_BARE_HEAD = re.compile(r"^\w+ \([\w.]+\)$")
_DJANGO_REPORT_HEAD = re.compile(r"^(FAIL|ERROR): ((\S+)(?: \(\S+\))?)")
_DJANGO_7188 = "Applying sites.0002_alter_domain_unique...test_no_migrations"


def _rule_django(lines: list[str], strict: bool) -> dict[str, TestStatus]:
    """``parse_log_django``'s rules; ``strict``: a bare ``ok`` only ends a test still pending."""
    results: dict[str, TestStatus] = {}
    previous: str | None = None
    pending = False
    for raw in lines:
        line = raw.strip()
        if "--version is equivalent to version" in line:
            results["--version is equivalent to version"] = "PASSED"
        if " ... " in line:
            previous = line.split(" ... ")[0]
            pending = True
        for suffix in _DJANGO_PASS:
            if line.endswith(suffix):
                if line.startswith(_DJANGO_7188):
                    line = line.split("...", 1)[-1].strip()
                results[line.rsplit(suffix, 1)[0]] = "PASSED"
                pending = False
                break
        if " ... skipped" in line:
            results[line.split(" ... skipped")[0]] = "SKIPPED"
            pending = False
        if line.endswith(" ... FAIL"):
            results[line.split(" ... FAIL")[0]] = "FAILED"
            pending = False
        if line.startswith("FAIL:") and len(line.split()) > 1:
            results[line.split()[1].strip()] = "FAILED"
        if line.endswith(" ... ERROR"):
            results[line.split(" ... ERROR")[0]] = "ERROR"
            pending = False
        if line.startswith("ERROR:") and len(line.split()) > 1:
            results[line.split()[1].strip()] = "ERROR"
        if line.startswith("ok") and previous is not None and (pending or not strict):
            results[previous] = "PASSED"
            pending = False
    return _with_own_names(results, lines) if strict else results


def _with_own_names(results: dict[str, TestStatus], lines: list[str]) -> dict[str, TestStatus]:
    """Django: a test with a docstring also under its own name, an extra key.

    The runner names it by the docstring's first line (``test_x (app.tests.Case)``
    alone on the line before); SWE-bench's lists use that line, an instance of
    ours may use the name.
    """
    head: str | None = None  # "test_x (app.tests.Case)" alone: a docstring line follows
    for raw in lines:
        line = raw.strip()
        if " ... " in line and head is not None and (found := results.get(line.split(" ... ")[0])):
            results.setdefault(head, found)
        head = line if _BARE_HEAD.match(line) else None
    return results


def parse_django(log: str, strict: bool = True) -> dict[str, TestStatus]:
    """Results from Django's ``runtests.py --verbosity 2``, named as ``parse_log_django`` names them.

    The name is what precedes `` ... `` on the result line: ``test_x (app.tests.Class)``,
    or a docstring's first line. Strict: the per-test lines up to the first failure
    report; then only the report's ``FAIL:``/``ERROR:`` headers, which overrule; and a
    test with a docstring is found under its own name too (an extra key, never a
    different status).
    """
    lines = log.split("\n")
    if not strict:
        results = _rule_django(lines, strict=False)
        body = log
    else:
        end = next((i for i, line in enumerate(lines) if _UNITTEST_END.match(line)), len(lines))
        results = _rule_django(lines[:end], strict=True)
        body = "\n".join(lines[:end])
        for line in lines[end:]:
            head = _DJANGO_REPORT_HEAD.match(line)
            if head:
                status: TestStatus = "FAILED" if head[1] == "FAIL" else "ERROR"
                results[head[3]] = status  # SWE-bench's key: the method alone
                # The runner's own verdict on "test_x (app.tests.Class) ... ", whatever
                # the code under test printed after those dots.
                if head[2] in results:
                    results[head[2]] = status
    for pattern in _DJANGO_INTERRUPTED:
        for match in pattern.finditer(body):
            results[match.group(1)] = "PASSED"
    return results


# -- sympy ----------------------------------------------------------------------------------

_SYMPY_FAILURE = re.compile(r"(_*) (.*)\.py:(.*) (_*)")
_SYMPY_START = re.compile(r"^=+ test process starts =+$")
_SYMPY_END = re.compile(r"^=+ tests finished: .* =+$")


def parse_sympy(log: str, strict: bool = True) -> dict[str, TestStatus]:
    """Results from sympy's ``bin/test -C --verbose``, as ``parse_log_sympy`` reads them.

    ``test_x ok`` / ``F`` / ``E`` lines, named by the function alone, and the failure
    report's ``___ sympy/x/tests/test_y.py:test_z ___`` headers (FAILED, named by
    file and function). Strict: only between ``test process starts`` and ``tests finished``.
    """
    if strict:
        lines = log.split("\n")
        start = next((i for i, line in enumerate(lines) if _SYMPY_START.match(line)), None)
        if start is None:
            return {}
        section = []
        for line in lines[start + 1 :]:
            if _SYMPY_END.match(line):
                break
            section.append(line)
        log = "\n".join(section)
    results: dict[str, TestStatus] = {}
    for match in _SYMPY_FAILURE.findall(log):
        results[f"{match[1]}.py:{match[2]}"] = "FAILED"
    for raw in log.split("\n"):
        line = raw.strip()
        if line.startswith("test_"):
            if line.endswith(" E"):
                results[line.split()[0]] = "ERROR"
            if line.endswith(" F"):
                results[line.split()[0]] = "FAILED"
            if line.endswith(" ok"):
                results[line.split()[0]] = "PASSED"
    return results


# -- unittest (ours: SWE-bench has no plain-unittest repository) ----------------------------

_UNITTEST_STATUSES: dict[str, TestStatus] = {
    "ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": "XFAIL",
    "unexpected success": "FAILED",
}  # fmt: skip
_TEST_HEAD = re.compile(r"^(\w+) \(([\w.]+)\)")
_OUTCOME = re.compile(r" \.\.\. (ok|FAIL|ERROR|expected failure|unexpected success|skipped\b.*)$")
_BARE_OUTCOME = re.compile(r"^(ok|FAIL|ERROR|expected failure|unexpected success|skipped\b.*)$")
_REPORT_HEAD = re.compile(r"^(FAIL|ERROR): (\w+ \([\w.]+\))")


def _unittest_name(method: str, where: str) -> str:
    """``test_x (pkg.mod.Class)``, also from Python 3.11+'s ``(pkg.mod.Class.test_x)``."""
    return f"{method} ({where.removesuffix('.' + method)})"


def _outcome(word: str) -> TestStatus:
    return "SKIPPED" if word.startswith("skipped") else _UNITTEST_STATUSES[word]


def parse_unittest(log: str, strict: bool = True) -> dict[str, TestStatus]:
    """Results from ``python -m unittest -v``: ``test_x (module.Class) ... ok`` lines.

    A test that printed, or has a docstring, ends its line later: the name
    is remembered until a line ends in (or is) an outcome. The runner's own
    ``FAIL: test_x (module.Class)`` and ``ERROR: ...`` headers after the run
    have the last word: an "ok" the code under test printed right after the
    runner's ``test_x (module.Class) ... `` does not turn its failure into a pass.
    (No SWE-bench counterpart: ``strict`` changes nothing.)
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
            method, _, where = report[2].partition(" (")
            results[_unittest_name(method, where[:-1])] = _UNITTEST_STATUSES[report[1]]
    return results


PARSERS: dict[LogParser, Callable[[str, bool], dict[str, TestStatus]]] = {
    "pytest": parse_pytest,
    "pytest_options": parse_pytest_options,
    "pytest_v2": parse_pytest_v2,
    "matplotlib": parse_matplotlib,
    "seaborn": parse_seaborn,
    "django": parse_django,
    "sympy": parse_sympy,
    "unittest": parse_unittest,
}
assert set(PARSERS) == set(get_args(LogParser))


def parse_log(parser: LogParser, log: str, *, strict: bool = True) -> dict[str, TestStatus]:
    """The results ``parser`` finds in ``log``.

    ``strict`` (the default, what grading uses) reads only the framework's own
    report section; ``strict=False`` reads every line, exactly as SWE-bench does.
    """
    return PARSERS[parser](log, strict)


# -- the official reading -------------------------------------------------------------------

OFFICIAL_PARSERS: dict[LogParser, str] = {
    "pytest": "parse_log_pytest",
    "pytest_options": "parse_log_pytest_options",
    "pytest_v2": "parse_log_pytest_v2",
    "matplotlib": "parse_log_matplotlib",
    "seaborn": "parse_log_seaborn",
    "django": "parse_log_django",
    "sympy": "parse_log_sympy",
}
"""SWE-bench's parser of each family (``unittest`` is ours alone)."""

_SWEBENCH_PYTHON = "swebench.harness.log_parsers.python"


def parse_log_officially(parser: LogParser, log: str) -> tuple[dict[str, TestStatus], str]:
    """The results SWE-bench's grading finds in ``log``, and the parser that found them.

    The ``swebench`` package's own parser where the package is importable
    (named ``swebench==5.0.2:parse_log_pytest``); else, and for ``unittest``,
    which it has no parser for, ours reading every line as it does
    (``sandman:pytest``; the same map on every log in tests/eval/logs).
    Django: a test with a docstring is found under its own name too, as in
    our reading, for the instances that list it so.
    """
    results, used = _read_officially(parser, log)
    if parser == "django":
        results = _with_own_names(results, log.split("\n"))
    return results, used


def _read_officially(parser: LogParser, log: str) -> tuple[dict[str, TestStatus], str]:
    loaded = _swebench()
    name = OFFICIAL_PARSERS.get(parser)
    if loaded is not None and name is not None:
        version, module = loaded
        try:
            found = getattr(module, name)(log, None)  # its Python parsers ignore the TestSpec
        except Exception:
            logger.warning("swebench's %s failed on a log: read by ours", name, exc_info=True)
        else:
            results = {str(key): _status(str(word)) for key, word in found.items()}
            read = {key: status for key, status in results.items() if status is not None}
            return read, f"swebench=={version}:{name}"
    return parse_log(parser, log, strict=False), f"sandman:{parser}"


@functools.cache
def _swebench() -> tuple[str, types.ModuleType] | None:
    """The ``swebench`` package's version and its Python log parsers' module, if it loads."""
    try:
        spec = importlib.util.find_spec("swebench")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = str(importlib.import_module("swebench").__version__)
        return version, _import_narrowly(Path(spec.submodule_search_locations[0]))
    except Exception:
        logger.warning("swebench is installed but its log parsers do not load", exc_info=True)
        return None


def _import_narrowly(root: Path) -> types.ModuleType:
    """``swebench.harness.log_parsers.python`` without the ``__init__``s above it.

    ``swebench.harness``'s imports docker and modal, ``log_parsers``' every
    language's parsers; the Python parsers need only ``constants`` and
    ``swebench.types`` (stdlib). Bare packages stand in for the two while it
    loads, and are taken out after with what loaded under them, so that a
    later ``import swebench.harness`` gets the real package.
    """
    if _SWEBENCH_PYTHON in sys.modules:
        return sys.modules[_SWEBENCH_PYTHON]
    before = set(sys.modules)
    for package in ("harness", "harness.log_parsers"):
        if f"swebench.{package}" not in sys.modules:
            bare = types.ModuleType(f"swebench.{package}")
            bare.__path__ = [str(root.joinpath(*package.split(".")))]
            sys.modules[f"swebench.{package}"] = bare
    try:
        return importlib.import_module(_SWEBENCH_PYTHON)
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("swebench.harness"):
                del sys.modules[name]
