"""A family's equality assertions are decided by plain values (`sandman.eval.settle`).

Each case runs one rewritten test against a stand-in for the code under test: a
result that lies about its equality (round 7 of heldout/) must fail, an honest one
must end as the assertion as written would.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import textwrap
import unittest
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _pytest.assertion.rewrite import rewrite_asserts

from sandman.eval.settle import HELPERS, LEAVES, helpers, settle, settled_values

TEST = textwrap.dedent(
    """
    def test_x():
        assert median([1, 2, 3, 4]) == 2.5
        assert slug("a b") == "a-b"
        assert merge([(1, 3), (2, 6)]) == [(1, 6)]
        assert -2 == neg(2)
    """
)


class LiarFloat(float):
    """A wrong median whose equality accepts anything (round 7's i-10, i-13)."""

    __hash__ = float.__hash__

    def __eq__(self, other: object) -> bool:
        return True


class LiarStr(str):
    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        return True


class LiarList(list[Any]):
    def __eq__(self, other: object) -> bool:
        return True


class ReprLiar:
    """Not a built-in: its ``repr`` is a piece of what a right list would show (round 12
    wrote the record with two: ``[(1, 6)]``, the list of another length kept raw)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class Learner:
    """Not a built-in: learns the expected value from ``__eq__`` and returns it when
    converted, so it passes if the conversion comes after the comparison."""

    seen: Any = None

    def __eq__(self, other: object) -> bool:
        Learner.seen = other
        return True

    def __float__(self) -> float:
        return float(Learner.seen) if Learner.seen is not None else 3.0

    def __iter__(self) -> Any:
        return iter(Learner.seen if Learner.seen is not None else [(1, 7)])


RIGHT: dict[str, Callable[..., Any]] = {
    "median": lambda v: 2.5,
    "slug": lambda s: "a-b",
    "merge": lambda v: [(1, 6)],
    "neg": lambda v: -2,
}
CASES: dict[str, tuple[dict[str, Callable[..., Any]], bool]] = {
    "right": ({}, True),
    "a float subclass that lies": ({"median": lambda v: LiarFloat(3.0)}, False),
    "a str subclass that lies": ({"slug": lambda s: LiarStr("a--b")}, False),
    "a list subclass that lies": ({"merge": lambda v: LiarList([(1, 7)])}, False),
    "a lying float inside a list": ({"merge": lambda v: [(1, LiarFloat(7))]}, False),
    "a learner for a number": ({"median": lambda v: Learner()}, False),
    "a learner for a list": ({"merge": lambda v: Learner()}, False),
    "numbers that are not built-ins": (
        {"median": lambda v: Fraction(5, 2), "neg": lambda v: Decimal(-2)},
        True,
    ),
    "a bool where an int is expected": ({"merge": lambda v: [(True, 6)]}, True),
    "a float subclass that does not lie": (
        {"median": lambda v: type("F", (float,), {})(2.5)},
        True,
    ),
    "a tuple where a list is expected": ({"merge": lambda v: ((1, 6),)}, False),
    "an int where a str is expected": ({"slug": lambda s: 5}, False),
    "another length": ({"merge": lambda v: [(1, 6), (7, 8)]}, False),
    "a wrong value": ({"median": lambda v: 3}, False),
    "elements whose repr forges the record": (
        {"merge": lambda v: [ReprLiar("(1"), ReprLiar("6)")]},
        False,
    ),
}


NAMES = [f"_h{i}" for i in range(HELPERS)]


def _rewritten(text: str) -> str:
    """``text``'s test with its assertions settled and the helpers atop its body."""
    lines = text.splitlines(keepends=True)
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.FunctionDef)
    out, stub, settled = settle(lines, node, NAMES)
    assert settled
    assert len(out) == len(stub) == len(lines)  # every edit is inside a line
    at = node.body[0].lineno - 1
    return "".join([*out[:at], f"    {helpers(NAMES)}\n", *out[at:]])


@pytest.mark.parametrize("case", CASES)
def test_an_assertion_passes_only_on_plain_values_that_agree(case: str) -> None:
    rewritten = _rewritten(TEST)
    stand_in, passes = CASES[case]
    scope: dict[str, Any] = {**RIGHT, **stand_in}
    Learner.seen = None
    exec(compile(rewritten, "t.py", "exec"), scope)  # noqa: S102 (the test under grading)
    if passes:
        scope["test_x"]()
    else:
        with pytest.raises(AssertionError):
            scope["test_x"]()


def test_the_rewrite_names_nothing_but_its_helpers_and_adds_no_digit() -> None:
    """No name the code under test could rebind (its own locals but), no constant a
    grid value could equal."""
    rewritten = ast.parse(_rewritten(TEST))
    original = ast.parse(TEST)
    names = {n.id for n in ast.walk(rewritten) if isinstance(n, ast.Name)}
    params = {a.arg for n in ast.walk(rewritten) if isinstance(n, ast.Lambda) for a in n.args.args}
    before = {n.id for n in ast.walk(original) if isinstance(n, ast.Name)}
    assert names - params - before == set(NAMES[:2])  # no recorder: two helpers
    constants = {repr(n.value) for n in ast.walk(rewritten) if isinstance(n, ast.Constant)}
    old = {repr(n.value) for n in ast.walk(original) if isinstance(n, ast.Constant)}
    # The expected values again (as a whole and by item), "", and the True the
    # assertion compares with (picked by a False), nothing else.
    assert constants - old == {"''", "True", "False"}


def test_a_literal_too_large_is_left_as_written() -> None:
    text = f"def test_x():\n    assert f() == {list(range(LEAVES + 1))}\n"
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.FunctionDef)
    lines = text.splitlines(keepends=True)
    hidden = ["def test_x():\n", "    assert f() == (...)\n"]
    assert settle(lines, node, NAMES) == (lines, hidden, False)


WRONG: dict[str, Callable[..., Any]] = {
    "median": lambda v: 3.25,
    "slug": lambda s: "a--b",
    "merge": lambda v: [(1, 7)],
    "neg": lambda v: 2,
}
UNITTEST = textwrap.dedent(
    """
    class T:
        def test_x(self):
            self.assertEqual(median([1, 2, 3, 4]), 2.5)
            self.assertEqual("a-b", slug("a b"))
            self.assertEqual(merge([(1, 3), (2, 6)]), [(1, 6)])
    """
)


@pytest.mark.parametrize(
    ("runner", "wrong"),
    [("pytest", w) for w in WRONG] + [("unittest", w) for w in WRONG if w != "neg"],
)
def test_a_failure_shows_the_result_never_the_expected_value(runner: str, wrong: str) -> None:
    """What a failing member leaves in the framework's records (its message, pytest's
    explanation of the rewritten assertion) tells nothing of its expected value (round
    8 of heldout/ read the mutants' values there)."""
    text = TEST if runner == "pytest" else UNITTEST
    tree = ast.parse(text)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    lines = text.splitlines(keepends=True)
    out, _, _ = settle(lines, node, NAMES)
    at = node.body[0].lineno - 1
    indent = " " * node.body[0].col_offset
    source = "".join([*out[:at], f"{indent}{helpers(NAMES)}\n", *out[at:]])
    module = ast.parse(source)
    rewrite_asserts(module, source.encode(), "t.py", None)  # as pytest imports a test file
    scope: dict[str, Any] = {**RIGHT, wrong: WRONG[wrong]}
    exec(compile(module, "t.py", "exec"), scope)  # noqa: S102 (the test under grading)
    with pytest.raises(AssertionError) as raised:
        if runner == "pytest":
            scope["test_x"]()
        else:
            case = type("Case", (scope["T"], unittest.TestCase), {})("test_x")
            case.test_x()
    message = str(raised.value)
    shown = repr(WRONG[wrong](None)).strip("[]")
    assert shown in message  # what the result was
    for expected in ("2.5", "'a-b'", "(1, 6)", "-2"):
        assert expected not in message, message


def test_the_stub_hides_every_expected_value_line_for_line() -> None:
    lines = TEST.splitlines(keepends=True)
    node = ast.parse(TEST).body[0]
    assert isinstance(node, ast.FunctionDef)
    planted, stub, _ = settle(lines, node, NAMES)
    text = "".join(stub)
    ast.parse(text)  # a stub is Python (a child that runs it fails its assertions)
    for expected in ("2.5", "'a-b'", '"a-b"', "(1, 6)", "-2"):
        assert expected in "".join(planted)
        assert expected not in text
    # Only the literals differ: the stub is the planted text with each one as (...).
    literal = re.compile(r"2\.5|\"a-b\"|'a-b'|\[\(1, 6\)\]|-2\b|\(1, 6\)")
    assert [literal.sub("(...)", line) for line in planted] == stub


def test_a_stub_keeps_the_lines_of_a_literal_over_several() -> None:
    text = 'def test_x():\n    assert f() == [\n        "p",\n        "q",\n    ]\n    g()\n'
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.FunctionDef)
    planted, stub, _ = settle(text.splitlines(keepends=True), node, NAMES)
    assert len(stub) == len(planted) == 6
    assert stub[-1] == "    g()\n"
    assert '"p"' in "".join(planted)
    assert '"p"' not in "".join(stub) and '"q"' not in "".join(stub)


def _witness_module() -> Any:
    path = Path(__file__).parents[2] / "src/sandman/eval/witness/sandman_eval_witness.py"
    spec = importlib.util.spec_from_file_location("witness_settle_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded(text: str) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef))
    out, stub, settled = settle(lines, node, NAMES, recorded=True)
    assert settled
    at = node.body[0].lineno - 1
    indent = " " * node.body[0].col_offset
    line = f"{indent}{helpers(NAMES, 'recorder_module')}\n"
    return "".join([*out[:at], line, *out[at:]]), "".join(stub)


@pytest.mark.parametrize("case", CASES)
def test_recorded_assertions_hold_no_expected_value_and_record_plain_results(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded, the expected values never enter the test process: each assertion
    hands its plain copy (and whether the result equals it) to the recorder and
    passes; the grader decides by `settled_values`, as the in-process form would."""
    planted, _ = _recorded(TEST)
    for expected in ("2.5", "'a-b'", '"a-b"', "(1, 6)", "-2"):
        assert expected not in planted
    assert settled_values(TEST.splitlines(keepends=True), ast.parse(TEST).body[0]) == (  # type: ignore[arg-type]
        2.5, "a-b", [(1, 6)], -2,
    )  # fmt: skip
    seen: list[tuple[int, str, bool]] = []
    witness = _witness_module()

    def record(site: str, value: object, plain: Callable[[object], object]) -> bool:
        # As the witness does (its profiler aside: tests/eval/test_witness.py).
        copy = plain(value)
        seen.append((len(site), witness._built_in_repr(copy), bool(value == copy)))
        return True

    monkeypatch.setitem(sys.modules, "recorder_module", SimpleNamespace(record=record))
    stand_in, passes = CASES[case]
    scope: dict[str, Any] = {**RIGHT, **stand_in}
    Learner.seen = None
    exec(compile(planted, "t.py", "exec"), scope)  # noqa: S102 (the test under grading)
    scope["test_x"]()  # passes in the process, whatever the result
    assert [site for site, _, _ in seen] == [1, 2, 3, 4]
    want = settled_values(TEST.splitlines(keepends=True), ast.parse(TEST).body[0])  # type: ignore[arg-type]
    # As the grader decides (`Plan.recorded_outcomes`): "?" is no value.
    decided = all(
        agree and text != "?" and ast.literal_eval(text) == want[site - 1]
        for site, text, agree in seen
    )
    assert decided is passes, seen
