"""Input variants (sandman.eval.variants): a FAIL_TO_PASS test again, on inputs moved by a draw.

Pure: the transform, what calibration keeps, and how a plan plants them; the harness's
end of it (a special-casing patch graded unresolved, the fix resolved) is in
``examples/eval/adversarial.jsonl`` (``adversarial-special-case-*``) and the held-out
routes that once special-cased the demo's inputs (heldout-c-01, heldout-d-02).
"""

from __future__ import annotations

import ast
import random
import re

import pytest

from sandman.eval.canaries import Plan, Target, plan
from sandman.eval.parsers import TestStatus
from sandman.eval.variants import COUNT, Inputs, learnt, transform


def _node(text: str) -> tuple[list[str], ast.FunctionDef]:
    tree = ast.parse(text)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    return text.splitlines(keepends=True), node


MEDIAN = "def test_median_even():\n    assert median([4, 1, 3, 2]) == 2.5\n"
SLUG = (
    "class T:\n"
    "    def test_slug(self):\n"
    '        """Hello 12."""\n'
    '        self.assertEqual(slugify("  Hello,  World!"), "hello-world")\n'
)


@pytest.mark.parametrize("draw", range(COUNT))
def test_every_input_moves_on_its_own_line_and_the_expected_values_stay(draw: int) -> None:
    for text in (MEDIAN, SLUG):
        lines, node = _node(text)
        moved = transform(lines, node, random.Random(draw), draw)
        assert moved is not None and moved != lines
        assert len(moved) == len(lines)  # every line where it was: the family's edits hold
        ast.parse("".join(moved))
        # The expected literal and the docstring stay as written.
        assert moved[-1].rstrip().endswith(("== 2.5", '"hello-world")'))
        if text == SLUG:
            assert moved[2] == lines[2]
            said = ast.literal_eval(moved[3].split("slugify(")[1].split(")")[0])
            # Letters stay letters and marks marks; spaces stay. On every other draw
            # each run of marks is one longer and one letter repeats (round 13 fixed only
            # runs of marks as long as the test's).
            assert said.count(" ") == 4 and said != "  Hello,  World!"
            grown = draw % 2 == 1
            assert sum(c.isalpha() for c in said) == (11 if grown else 10)
            runs = re.findall(r"[^A-Za-z ]+", said)
            assert [len(run) for run in runs] == ([2, 2] if grown else [1, 1])


def test_the_ways_numbers_move_take_turns() -> None:
    """A small shift (differences kept), a shift past every digit (low digits kept), a
    scale (differences scaled): each is among a test's draws, and a list of numbers
    may grow by two items past its largest (its own length is no gate)."""
    text = "def test_t():\n    assert merge([(1, 2), (2, 3), (7, 9)], -4, 2.75) == [(1, 3)]\n"
    lines, node = _node(text)
    grown = False
    for draw in range(COUNT):
        moved = transform(lines, node, random.Random(draw), draw)
        assert moved is not None
        assert moved[1].endswith("== [(1, 3)]\n")
        pairs, negative, decimal = ast.literal_eval(
            "(" + moved[1].split("merge(")[1].split(") ==")[0] + ")"
        )
        grown |= len(pairs) == 5
        first, second = pairs[0], pairs[1]
        if draw % 3 == 0:
            shift = first[0] - 1
            assert 0 < abs(shift) < 10
            assert pairs[:3] == [
                (1 + shift, 2 + shift),
                (2 + shift, 3 + shift),
                (7 + shift, 9 + shift),
            ]
            assert negative == -4 + shift and decimal == 2.75 + shift
        elif draw % 3 == 1:
            assert first[0] % 10 == 1 and abs(first[0]) > 9  # past every digit: low digit kept
            assert second[0] - first[0] == 1
        else:
            scale = first[1] - first[0]
            assert 2 <= scale <= 9 and second[0] == first[1]  # touching stays touching
        if len(pairs) == 5:
            largest = max(x for pair in pairs[:3] for x in pair)
            assert all(x > largest for pair in pairs[3:] for x in pair)
    assert grown


def test_a_test_with_nothing_to_move_has_no_variant() -> None:
    for text in (
        "def test_t():\n    assert f() == 3\n",
        "def test_t():\n    assert f(True, None, b'x', f'{y}') == 3\n",
        # Expected values stay: a literal on the expected side alone is nothing to move.
        "def test_t():\n    assert f() == [4, 1, 'ab']\n",
    ):
        lines, node = _node(text)
        assert all(
            transform(lines, node, random.Random(draw), draw) is None for draw in range(COUNT)
        ), text


def test_the_same_key_draws_the_same_variant_and_another_key_may_not() -> None:
    lines, node = _node(SLUG)
    inputs = Inputs(b"secret")
    first = transform(lines, node, inputs.rng(("t", 0)))
    assert first == transform(lines, node, inputs.rng(("t", 0)))
    drawn = {"".join(transform(lines, node, inputs.rng(("t", i)), i) or []) for i in range(COUNT)}
    assert len(drawn) > COUNT // 2
    assert first != transform(lines, node, Inputs(b"other").rng(("t", 0)))


def _records(**values: object) -> dict[str, dict[int, list[tuple[str, bool]]]]:
    return {token: {1: [(repr(v), True)]} for token, v in values.items()}


def test_calibration_keeps_the_variants_the_fix_answers_and_the_bug_gets_wrong() -> None:
    planted = {
        "a": (("t", 0), 1),
        "b": (("t", 1), 1),
        "c": (("t", 2), 1),
        "d": (("t", 3), 1),
        "e": (("u", 0), 1),
    }
    fix = _records(a=2.5, b=7.5, c=4.0, e="x")  # d: the fix recorded nothing (it raised)
    unpatched = _records(a=3, b=7.5, c=5, d=1, e="y")  # b: the bug does not reach it
    assert learnt((planted, fix), (planted, unpatched), keep=2) == {
        ("t", 0): (2.5,),
        ("t", 2): (4.0,),
        ("u", 0): ("x",),
    }
    assert learnt((planted, fix), (planted, unpatched), keep=1) == {
        ("t", 0): (2.5,),
        ("u", 0): ("x",),
    }
    # A site recorded twice with two values, or with a result that disagreed with its
    # plain copy, or not as a literal, teaches nothing.
    for bad in (
        [("2.5", True), ("3.5", True)],
        [("2.5", False)],
        [("<object at 0x1>", True)],
    ):
        assert learnt(({"a": (("t", 0), 1)}, {"a": {1: bad}}), ({}, {})) == {}
    # Every site must be answered.
    assert learnt(({"a": (("t", 0), 2)}, _records(a=1)), ({}, {})) == {}


TARGET = "t.py::test_median_even"


def _planned(inputs: Inputs, recorder: str | None = "witness_mod") -> Plan:
    """MEDIAN's plan, its one test a FAIL_TO_PASS test, with ``inputs``."""
    return plan(
        {"t.py": MEDIAN},
        [Target(TARGET, "t.py", (), "test_median_even")],
        [TARGET],
        "pytest",
        rng=random.Random(5),
        recorder=recorder,
        inputs=inputs,
    )


def test_a_calibrating_plan_plants_every_variant_and_expects_nothing_of_them() -> None:
    made = _planned(Inputs(b"seed"))
    assert made.variants
    assert {key for key, _ in made.variants.values()} <= {(TARGET, i) for i in range(COUNT)}
    assert all(sites == 1 for _, sites in made.variants.values())
    # No canary, no expected value: calibration only learns what they record.
    assert not set(made.variants) & {c.token for c in made.canaries}
    assert not set(made.variants) & set(made.recorded)
    for token in made.variants:
        assert f"def {token}(" in made.sources["t.py"]
        assert f"def {token}(" in made.stubs["t.py"]
    assert "2.5" not in made.sources["t.py"]


def test_a_grading_plan_plants_the_learnt_variants_as_canaries_with_their_values() -> None:
    key = (TARGET, 0)
    made = _planned(Inputs(b"seed", {key: (12.5,)}))
    (token,) = made.variants
    assert made.variants[token] == (key, 1)
    assert made.recorded[token] == (12.5,)
    (canary,) = [c for c in made.canaries if c.kind == "variant"]
    assert canary.token == token and canary.describe() == f"an input variant of {TARGET}"
    # Its inputs are the draw's, its expected value nowhere in the file.
    moved = transform(*_node(MEDIAN), Inputs(b"seed").rng(key), 0)
    assert moved is not None
    inputs = moved[1].split("median(")[1].split(")")[0]
    assert f"median({inputs})" in made.sources["t.py"]
    assert "12.5" not in made.sources["t.py"] and "12.5" not in made.stubs["t.py"]
    # It must pass where its original passes: else a lie.
    lies = made.lies({token: "FAILED"}, True, listed={TARGET: "PASSED"})
    assert any("the code answers the test's own inputs" in lie for lie in lies)
    # A variant passed and its original failed is an honest partial fix, no lie.
    pairs: list[tuple[TestStatus, TestStatus]] = [
        ("PASSED", "PASSED"),
        ("PASSED", "FAILED"),
        ("FAILED", "FAILED"),
    ]
    for status, original in pairs:
        assert not [
            lie
            for lie in made.lies({token: status}, True, listed={TARGET: original})
            if "input variant" in lie
        ], (status, original)


def test_without_a_recorder_no_variant_is_planted() -> None:
    made = _planned(Inputs(b"seed"), recorder=None)
    assert not made.variants and not made.recorded
