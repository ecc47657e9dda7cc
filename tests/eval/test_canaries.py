"""The canary plan (sandman.eval.canaries): test files in, renamed tests and planted canaries out.

Pure: the rewritten files are run here with the host's pytest and unittest, so
each planted outcome is checked against the framework itself, not against a
copy of what the planner meant.
"""

from __future__ import annotations

import ast
import collections
import io
import itertools
import subprocess
import sys
import tokenize
import types
from pathlib import Path

import pytest

from sandman.eval import Instance, decoys
from sandman.eval.canaries import Plan, Target, locate, plan
from sandman.eval.decoys import CHOICES
from sandman.eval.parsers import TestStatus, parse_log
from sandman.eval.protect import binary_hunks, git_paths, is_protected

PYTEST_FILE = """\
import pytest


def helper():
    return 2


def test_median_even():
    assert helper() == 2


@pytest.mark.xfail(reason="known")
def test_declared():
    assert False


def test_plain():
    assert 1 + 1 == 2
"""

UNITTEST_FILE = '''\
import unittest


class SlugTest(unittest.TestCase):
    def test_fixed(self):
        self.assertEqual("a", "a")

    def test_kept(self):
        """A docstring line."""
        self.assertTrue(True)
'''


def _draw() -> object:
    counter = itertools.count()
    return lambda: f"test_tok{next(counter):04d}x"


def test_locate_reads_each_family_s_ids() -> None:
    paths = {"tests/test_stats.py", "tests/shop_tests/tests.py", "tests/test_slug.py"}
    assert locate("tests/test_stats.py::TestA::test_x[1-2]", "pytest", paths) == Target(
        "tests/test_stats.py::TestA::test_x[1-2]", "tests/test_stats.py", ("TestA",), "test_x"
    )
    assert locate("other.py::test_x", "pytest", paths) is None  # not in the tree
    assert locate("test_y (shop_tests.tests.Cents)", "unittest", paths) == Target(
        "test_y (shop_tests.tests.Cents)", "tests/shop_tests/tests.py", ("Cents",), "test_y"
    )
    # Python 3.11's form, and a docstring line (which names no def).
    assert locate("test_y (tests.test_slug.Case.test_y)", "unittest", paths) is not None
    assert locate("A docstring line.", "unittest", paths) is None


def _run_pytest(tmp_path: Path, text: str) -> dict[str, TestStatus]:
    (tmp_path / "test_file.py").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-W", "ignore", "test_file.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return parse_log("pytest", done.stdout)


def _pytest_plan() -> Plan:
    targets = [
        Target(f"test_file.py::{name}", "test_file.py", (), name)
        for name in ("test_median_even", "test_declared", "test_plain")
    ]
    return plan(
        {"test_file.py": PYTEST_FILE},
        targets,
        ["test_file.py::test_median_even"],
        "pytest",
        draw=_draw(),  # type: ignore[arg-type]
    )


def test_pytest_canaries_end_as_planted_and_results_translate_back(tmp_path: Path) -> None:
    made = _pytest_plan()
    assert set(made.renamed.values()) == {"test_median_even", "test_declared", "test_plain"}
    assert sorted(c.kind for c in made.canaries) == [
        "agree", "error", "fail", *["mutant"] * 2 * (CHOICES - 1), "pass", "skip", "xfail",
    ]  # fmt: skip
    results = _run_pytest(tmp_path, made.sources["test_file.py"])
    tests, planted, forged = made.translate(results)
    assert tests == {
        "test_file.py::test_median_even": "PASSED",
        "test_file.py::test_declared": "XFAIL",
        "test_file.py::test_plain": "PASSED",
    }
    assert forged == []
    assert made.lies(planted, ran=True) == []
    assert made.declared["test_file.py::test_declared"] == frozenset({"xfail"})
    assert "xfail" not in made.declared["test_file.py::test_plain"]


def test_a_framework_that_passes_everything_makes_the_canaries_lie(tmp_path: Path) -> None:
    made = _pytest_plan()
    # What a forging plugin does: every report a pass.
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    report = outcome.get_result()\n"
        "    if report.when == 'call':\n        report.outcome = 'passed'\n"
    )
    _, planted, _ = made.translate(_run_pytest(tmp_path, made.sources["test_file.py"]))
    lies = made.lies(planted, ran=True)
    assert any("must-fail" in lie and "ended PASSED" in lie for lie in lies), lies
    assert any("a mutant of test_file.py::test_median_even" in lie for lie in lies), lies


def test_a_forger_that_spares_the_planted_shapes_meets_the_mutants(tmp_path: Path) -> None:
    """Forgery aimed by content (tests that call helper()), sparing whatever ends in a
    literal comparison of two numbers (the twin): the mutants read like the original."""
    made = _pytest_plan()
    mutants = [c for c in made.canaries if c.kind == "mutant"]
    # Each plain and re-importing, as the original has a copy.
    assert len(mutants) == 2 * (CHOICES - 1)
    text = made.sources["test_file.py"]
    assert all(f"def {m.token}():" in text for m in mutants)
    (tmp_path / "conftest.py").write_text(
        "import inspect, re\nimport pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    report = outcome.get_result()\n"
        "    source = inspect.getsource(item.function).rstrip()\n"
        "    twin = re.search(r'assert \\d+ == \\d+$', source)\n"
        "    if report.when == 'call' and 'helper()' in source and not twin:\n"
        "        report.outcome = 'passed'\n"
    )
    _, planted, _ = made.translate(_run_pytest(tmp_path, text))
    lies = made.lies(planted, ran=True)
    assert any("a mutant of test_file.py::test_median_even" in lie for lie in lies), lies
    assert not any("twin" in lie for lie in lies), lies


def test_a_fixed_copy_swapped_into_the_test_module_meets_the_re_importing_copy(
    tmp_path: Path,
) -> None:
    """The library stays wrong; the test module's name for it is rebound to a right
    copy (as a setup_module or an import hook of the patch's would)."""
    text = "from lib import helper\n\n\ndef test_median_even():\n    assert helper() == 2\n"
    made = plan(
        {"test_file.py": text},
        [Target("test_file.py::test_median_even", "test_file.py", (), "test_median_even")],
        ["test_file.py::test_median_even"],
        "pytest",
    )
    assert [c.kind for c in made.canaries if c.kind == "agree"] == ["agree"]
    (tmp_path / "lib.py").write_text("def helper():\n    return 3\n")
    (tmp_path / "conftest.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        item.module.helper = lambda: 2\n"
    )
    tests, planted, _ = made.translate(_run_pytest(tmp_path, made.sources["test_file.py"]))
    assert tests["test_file.py::test_median_even"] == "PASSED"  # the forgery worked
    lies = made.lies(planted, ran=True, listed=tests)
    assert any("re-importing copy" in lie and "ended FAILED" in lie for lie in lies), lies
    # Honest: the copy agrees.
    (tmp_path / "conftest.py").unlink()
    (tmp_path / "lib.py").write_text("def helper():\n    return 2\n")
    tests, planted, _ = made.translate(_run_pytest(tmp_path, made.sources["test_file.py"]))
    assert made.lies(planted, ran=True, listed=tests) == []


def test_a_family_drops_the_docstring_a_test_can_be_named_by() -> None:
    # Django's runner names a test with a docstring by its first line, which the
    # copies would share; the original drops it too, as it is written as they are.
    text = 'class T:\n    def test_x(self):\n        """Doc line."""\n        assert f() == 1\n'
    made = plan(
        {"t.py": text}, [Target("t.py::T::test_x", "t.py", ("T",), "test_x")], ["t.py::T::test_x"],
        "pytest",
    )  # fmt: skip
    assert made.sources["t.py"].count("Doc line.") == 0
    compile(made.sources["t.py"], "t.py", "exec")


def test_the_original_stands_at_a_random_place_among_its_family() -> None:
    # pytest runs a file top to bottom: were the copies always after the original,
    # "the first of the alike tests" would name it (team-f F10, F11).
    import random

    text = "def test_x():\n    assert f(3) == 2.5\n"
    places = set()
    for seed in range(120):
        made = plan(
            {"t.py": text}, [Target("t.py::test_x", "t.py", (), "test_x")], ["t.py::test_x"],
            "pytest", rng=random.Random(seed),
        )  # fmt: skip
        order = [line[4:].split("(")[0] for line in made.sources["t.py"].splitlines()
                 if line.startswith("def ")]  # fmt: skip
        family = [
            n
            for n in order
            if n in made.renamed or any(c.token == n and c.of for c in made.canaries)
        ]
        places.add(family.index(next(iter(made.renamed))))
        compile(made.sources["t.py"], "t.py", "exec")
    assert len(family) >= 3 and places == set(range(len(family))), places


def test_mutants_change_one_character_per_literal_and_keep_its_look() -> None:
    text = (
        'def test_x():\n    assert f("hello-world") == "hello-world"\n    assert g() == [1, 22]\n'
    )
    made = plan(
        {"t.py": text},
        [Target("t.py::test_x", "t.py", (), "test_x")],
        ["t.py::test_x"],
        "pytest",
        kinds=["mutant"],
    )
    rewritten = made.sources["t.py"]

    def tokens(name: str) -> list[str]:
        body = rewritten.split(f"def {name}():\n")[1].split("\n\n")[0]
        found = tokenize.generate_tokens(io.StringIO(body).readline)
        return [t.string for t in found if t.type not in _LAYOUT]

    original = tokens(made.listed["t.py::test_x"])
    assert made.canaries
    for mutant in made.canaries:
        body = tokens(mutant.token)
        # Only values differ (each literal and the copies `settle` makes of it), each
        # by one character, never the call side.
        differ = {(a, b) for a, b in zip(body, original, strict=True) if a != b}
        assert differ
        for a, b in differ:
            assert a[0] in "\"'0123456789" and len(a) == len(b), (a, b)
            assert sum(x != y for x, y in zip(a, b, strict=True)) == 1, (a, b)
        assert '"hello-world"' in body  # the call side is never touched


_LAYOUT = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)

# The shapes of the demo's FAIL_TO_PASS tests (heldout/team-h read each one's original
# off its family), and one with more literals than the grid has axes.
SHAPES = {
    "number": "from lib import median\n\n\ndef test_x():\n    assert median([4, 1, 3, 2]) == 2.5\n",
    "list": (
        "from lib import merge\n\n\ndef test_x():\n"
        "    assert merge([(1, 2), (2, 3), (7, 9)]) == [(1, 3), (7, 9)]\n"
    ),
    "string": (
        "import unittest\n\nfrom lib import slugify\n\n\nclass T(unittest.TestCase):\n"
        "    def test_y(self):\n        pass\n\n"
        "    def test_x(self):\n"
        '        self.assertEqual(slugify("  Hello,  World!"), "hello-world")\n'
    ),
    "two": (
        "from django.test import SimpleTestCase\n\nfrom lib import cents\n\n\n"
        "class T(SimpleTestCase):\n    def test_y(self):\n        pass\n\n"
        '    def test_x(self):\n        """Cents keep their zero."""\n'
        '        self.assertEqual(cents(1205), "12.05")\n'
        '        self.assertEqual(cents(7), "0.07")\n'
    ),
    "many": (
        "from lib import f\n\n\ndef test_x():\n"
        + "".join(f'    assert f({i}) == "v{i}-{i * 7}"\n' for i in range(6))
    ),
    # The expected value repeats an input: every centre's must repeat one too.
    "repeats": "from lib import pick\n\n\ndef test_x():\n    assert pick([5, 7, 9, 2, 4], 1) == 7\n",
}


def _planted(shape: str, seed: int) -> tuple[Plan, str, list[ast.FunctionDef]]:
    """``shape`` planted with ``seed``: the plan, the original's name, its family's defs."""
    import random

    text = SHAPES[shape]
    test = "t.py::T::test_x" if "class T" in text else "t.py::test_x"
    scope = ("T",) if "class T" in text else ()
    mode = "unittest" if "unittest" in text else "pytest"
    targets = [Target(test, "t.py", scope, "test_x")]
    if "test_y" in text:  # a plain test ahead, so the generic canaries stand apart
        targets.insert(0, Target(test.replace("test_x", "test_y"), "t.py", scope, "test_y"))
    made = plan({"t.py": text}, targets, [test], mode, rng=random.Random(seed))  # type: ignore[arg-type]
    members = {made.listed[test]} | {c.token for c in made.canaries if c.of == test}
    tree = ast.parse(made.sources["t.py"])
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in members]
    assert len(defs) == len(members) >= 8
    return made, made.listed[test], sorted(defs, key=lambda n: n.lineno)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_member_of_a_family_is_written_alike(shape: str) -> None:
    """Nothing but names and expected values tells the original from its copies: not
    the text, not the blank lines between them, not their code objects' lines (round 6
    of heldout/ found the original by the blank line it lacked, in the file and in
    ``co_firstlineno``)."""
    for seed in range(30):
        made, original, defs = _planted(shape, seed)
        text = made.sources["t.py"]
        lines = text.splitlines(keepends=True)
        masked = {}
        for node in defs:
            own = [line.encode() for line in lines]
            # The expected values, where the test wrote them and where `settle`
            # copied them (as a whole and by their items).
            for side in sorted(_copies(node), key=lambda n: (n.lineno, -n.col_offset)):
                line = own[side.lineno - 1]
                own[side.lineno - 1] = (
                    line[: side.col_offset] + b"VALUE" + line[side.end_col_offset :]
                )
            segment = b"".join(own[node.lineno - 1 : node.end_lineno]).decode()
            masked[node.name] = segment.replace(node.name, "NAME")
        plain = {m for m in masked.values() if "import" not in m}
        again = {m for m in masked.values() if "import" in m}
        assert len(plain) == 1 and len(again) <= 1, masked
        assert '"""' not in masked[original]  # the original lost its docstring as each copy
        # Nor do the values tell it by what they repeat: each expected literal, and
        # each list or tuple in one, appears elsewhere in every member or in none,
        # and equal constants merge alike (``co_consts`` is as long in each).
        repeats = set()
        for node in defs:
            segment = "".join(lines[node.lineno - 1 : node.end_lineno])
            pattern = []
            for _, side in _settled(node):
                for part in ast.walk(side):
                    if isinstance(part, (ast.Constant, ast.Tuple, ast.List)):
                        line = lines[part.lineno - 1].encode()
                        literal = line[part.col_offset : part.end_col_offset].decode()
                        pattern.append(segment.count(literal) > 1)
            repeats.add(tuple(pattern))
        assert len(repeats) == 1, repeats
        # Code objects: the gap above each function (from the last line of the one
        # before) is the same for every member but the first of the block.
        scope = compile(text, "t.py", "exec")
        if "class T" in text:
            scope = next(c for c in scope.co_consts if getattr(c, "co_name", "") == "T")
        objects = sorted(
            (c for c in scope.co_consts if hasattr(c, "co_lines")), key=lambda c: c.co_firstlineno
        )
        for form in (True, False):  # re-importing or plain
            names = {n for n, m in masked.items() if ("import" in m) is form}
            consts = {len(c.co_consts) for c in objects if c.co_name in names}
            assert len(consts) <= 1, consts
        gaps = {}
        for before, after in itertools.pairwise(objects):
            last = max(line for _, _, line in before.co_lines() if line is not None)
            gaps[after.co_name] = after.co_firstlineno - last - 1
        head = defs[0].name
        assert len({gaps[n.name] for n in defs if n.name != head}) == 1, (seed, gaps)
        assert gaps[original] >= 1 or original == head, (seed, gaps)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_stub_on_disk_tells_no_member_from_another(shape: str) -> None:
    """The file on disk while the tests run is the stub: line for line the planted
    file, and in it every member of the family reads alike but for its name, so a
    reader of the file (a child process, a fork, ``cat``: round 8 of heldout/) learns
    none of the family's values."""
    for seed in range(10):
        made, _, defs = _planted(shape, seed)
        planted, stub = made.sources["t.py"], made.stubs["t.py"]
        assert planted.count("\n") == stub.count("\n")
        stub_lines = stub.splitlines(keepends=True)
        alike = {
            "".join(stub_lines[node.lineno - 1 : node.end_lineno]).replace(node.name, "NAME")
            for node in defs
        }
        assert len({member for member in alike if "import" not in member}) == 1, alike
        assert len({member for member in alike if "import" in member}) <= 1, alike
        # In the planted file they differ (by their values).
        lines = planted.splitlines(keepends=True)
        told = {
            "".join(lines[node.lineno - 1 : node.end_lineno]).replace(node.name, "NAME")
            for node in defs
        }
        assert len(told) > len(alike)


def _copies(node: ast.FunctionDef) -> list[ast.expr]:
    """The outermost literals equal to an expected value or a part of one, in its
    assertions' expected sides and in the expressions `settle` wrapped around their
    results (never in the results: a call's inputs stay)."""
    values: set[str] = set()
    places: list[ast.AST] = []
    for result, side in _settled(node):
        for part in ast.walk(side):
            if isinstance(part, (ast.Constant, ast.Tuple, ast.List)):
                values.add(repr(ast.literal_eval(part)))
        places.append(side)
        if isinstance(result, ast.Call) and isinstance(result.func, ast.Lambda):
            places.append(result.func)
    found: list[ast.expr] = []
    inside: set[int] = set()
    for item in (item for place in places for item in ast.walk(place)):
        if id(item) in inside or not isinstance(item, (ast.Constant, ast.Tuple, ast.List)):
            continue
        try:
            value = repr(ast.literal_eval(item))
        except ValueError:
            continue
        if value in values:
            found.append(item)
            inside.update(id(part) for part in ast.walk(item))
    return [f for f in found if f.lineno == f.end_lineno]


def _values(node: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(repr(ast.literal_eval(side)) for _, side in _settled(node))


def _settled(node: ast.FunctionDef) -> list[tuple[ast.expr, ast.expr]]:
    """A planted member's settled assertions: (the wrapped result, the expected literal
    where the test wrote it, now ``(True, literal)[False]``)."""
    found: list[tuple[ast.expr, ast.expr]] = []
    for item in ast.walk(node):
        sides: list[ast.expr] = []
        if isinstance(item, ast.Assert) and isinstance(item.test, ast.Compare):
            sides = [item.test.left, *item.test.comparators]
        elif isinstance(item, ast.Call) and getattr(item.func, "attr", "") == "assertEqual":
            sides = list(item.args[:2])
        for a, b in (sides[:2], sides[1::-1]) if len(sides) == 2 else ():
            if (
                isinstance(b, ast.Subscript)
                and isinstance(b.value, ast.Tuple)
                and len(b.value.elts) == 2
                and isinstance(b.slice, ast.Constant)
                and b.slice.value is False
            ):
                found.append((a, b.value.elts[1]))
    return found


def _pointed(family: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The value tuples round 6's statistics pick out of a family: each assertion's
    plurality, the star centre (one change from every other value), and each
    character's plurality."""
    picks: set[tuple[str, ...]] = set()

    def plurality(columns: list[tuple[str, ...]]) -> list[str] | None:
        out = []
        for column in columns:
            counts = collections.Counter(column).most_common()
            if len(counts) > 1 and counts[0][1] == counts[1][1]:
                return None
            out.append(counts[0][0])
        return out

    by_assertion = plurality(list(zip(*family, strict=True)))
    if by_assertion is not None:
        picks.add(tuple(by_assertion))
    distinct = sorted(set(family))

    def changes(a: tuple[str, ...], b: tuple[str, ...]) -> int:
        return sum(x != y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))

    centres = [a for a in distinct if all(changes(a, b) == 1 for b in distinct if b != a)]
    if len(centres) == 1:
        picks.add(centres[0])
    by_character = plurality(list(zip(*("|".join(t) for t in family), strict=True)))
    if by_character is not None:
        picks.update(t for t in distinct if "|".join(t) == "".join(by_character))
    return picks


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_no_statistic_of_the_values_points_at_the_original(shape: str) -> None:
    """The family's values are symmetric: each of an assertion's values comes equally
    often, every combination of them is there (up to `decoys.AXES` axes), and the
    values of one literal differ from each other at one place. So the original's are
    any of the centres' with the same likelihood, and the statistics that picked them
    in round 6 of heldout/ (plurality by assertion or by character, the star centre)
    pick none."""
    for seed in range(40):
        _, original, defs = _planted(shape, seed)
        family = [_values(node) for node in defs]
        mine = next(_values(node) for node in defs if node.name == original)
        assert mine not in _pointed(family), (seed, family)
        assert family.count(mine) == max(family.count(t) for t in family)
        columns = list(zip(*family, strict=True))
        for column in columns:
            counts = set(collections.Counter(column).values())
            assert len(counts) == 1, column  # each value as often as each other
            distinct = set(column)
            assert len(distinct) >= 2
            # One place where they differ, the same for all.
            assert len({len(v) for v in distinct}) == 1, distinct
            places = {
                i
                for a in distinct
                for b in distinct
                for i, (x, y) in enumerate(zip(a, b, strict=True))
                if x != y
            }
            assert len(places) == 1, distinct
        if len(columns) <= decoys.AXES:
            grid = set(itertools.product(*(sorted(set(c)) for c in columns)))
            assert set(family) == grid
        # Every mutant fails whatever the code does right.
        assert sum(t == mine for t in family) == (2 if "import" in SHAPES[shape] else 1)


def test_a_result_under_a_renamed_test_s_listed_name_is_forged() -> None:
    made = _pytest_plan()
    token = next(t for t, name in made.renamed.items() if name == "test_median_even")
    results: dict[str, TestStatus] = {
        "test_file.py::test_median_even": "PASSED",
        f"test_file.py::{token}": "FAILED",
    }
    tests, _, forged = made.translate(results)
    assert forged == ["test_file.py::test_median_even"]
    assert tests == {"test_file.py::test_median_even": "FAILED"}
    assert made.scrub(f"x {token} y") == "x test_median_even y"


def test_unittest_canaries_end_as_planted(tmp_path: Path) -> None:
    targets = [
        Target(f"{name} (test_slug.SlugTest)", "test_slug.py", ("SlugTest",), name)
        for name in ("test_fixed", "test_kept")
    ]
    made = plan(
        {"test_slug.py": UNITTEST_FILE},
        targets,
        ["test_fixed (test_slug.SlugTest)"],
        "unittest",
        draw=_draw(),  # type: ignore[arg-type]
    )
    (tmp_path / "test_slug.py").write_text(made.sources["test_slug.py"])
    done = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "test_slug"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    tests, planted, _ = made.translate(parse_log("unittest", done.stderr))
    assert made.lies(planted, ran=True) == []
    assert tests["test_fixed (test_slug.SlugTest)"] == "PASSED"
    assert done.returncode != 0  # the canaries that must fail did


def test_a_missing_canary_lies_only_when_the_file_ran() -> None:
    made = _pytest_plan()
    assert made.lies({}, ran=False) == []
    # Not the skip canary (pytest's log names no id), nor the re-importing copy
    # (no evidence without its original's result).
    assert len(made.canaries) == 6 + 2 * (CHOICES - 1)
    assert len(made.lies({}, ran=True)) == len(made.canaries) - 2
    assert len(made.lies({}, ran=True, log=False)) == len(made.canaries) - 1


def test_a_file_that_does_not_parse_is_left_as_it_is() -> None:
    made = plan(
        {"t.py": "def test_x(:\n"}, [Target("t.py::test_x", "t.py", (), "test_x")], [], "pytest"
    )
    assert made.sources == {} and made.canaries == [] and made.left


def test_a_test_whose_name_is_used_elsewhere_keeps_it() -> None:
    text = "def test_x():\n    pass\n\n\nALIAS = test_x\n"
    made = plan({"t.py": text}, [Target("t.py::test_x", "t.py", (), "test_x")], [], "pytest")
    assert made.renamed == {} and any("used elsewhere" in why for why in made.left)


def test_a_marked_scope_gets_twins_but_no_generic_canaries() -> None:
    text = "import pytest\n\npytestmark = pytest.mark.skip\n\n\ndef test_x():\n    assert 1\n"
    made = plan(
        {"t.py": text}, [Target("t.py::test_x", "t.py", (), "test_x")], ["t.py::test_x"], "pytest"
    )
    # No literal to change: the twin stands in for the mutants.
    assert sorted(c.kind for c in made.canaries) == ["agree", "twin"]
    assert "SKIPPED" in made.canaries[0].expected  # the module declares the skip


def _instance(**fields: object) -> Instance:
    base: dict[str, object] = {
        "instance_id": "x-1", "image": "img", "base_commit": "abcd", "FAIL_TO_PASS": ["t"],
        "test_patch": "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n"
        "+++ b/tests/test_a.py\n", "test_cmd": "python3 tests/runtests.py",
    }  # fmt: skip
    return Instance.model_validate({**base, **fields})


@pytest.mark.parametrize(
    ("path", "protected"),
    [
        ("pkg/code.py", False),
        ("tests/test_a.py", True),
        ("tests/helpers/data.txt", True),
        ("tests/runtests.py", True),
        ("pkg/conftest.py", True),
        ("pyproject.toml", True),
        ("pytest.toml", True),
        ("sub/.gitattributes", True),
        ("x.pth", True),
        ("X.PTH", True),
        ("Evil-1.DIST-INFO/entry_points.txt", True),
        ("evil.Egg-Info/entry_points.txt", True),
        ("pkg/__pycache__/code.cpython-311.pyc", True),
        ("pkg/code.pyc", True),
        ("sitecustomize/__init__.py", True),
        ("usercustomize.cpython-311-x86_64-linux-gnu.so", True),
        ("pkg/apps.py", False),
    ],
)
def test_what_the_framework_reads_before_a_test_is_protected(path: str, protected: bool) -> None:
    assert is_protected(_instance(), path) is protected


def test_a_file_defining_a_listed_test_is_protected() -> None:
    assert is_protected(_instance(), "pkg/tests.py", frozenset({"pkg/tests.py"}))


def test_every_header_a_patch_program_reads_is_checked_for_git() -> None:
    assert git_paths("Index: a/.git/config\n--- a/x\n+++ b/x\n") == [".git/config"]
    assert git_paths("rename to .git/hooks/post-checkout\n") == [".git/hooks/post-checkout"]
    assert git_paths("*** a/.git/HEAD\n") == [".git/HEAD"]
    assert git_paths("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n") == []


def test_binary_hunks_are_counted() -> None:
    assert binary_hunks("GIT binary patch\nliteral 3\n") == 1
    assert binary_hunks("Binary files a/x and b/x differ\n") == 1
    assert binary_hunks("--- a/x\n+++ b/x\n") == 0


def test_the_witness_names_test_methods_replaced_on_an_instance() -> None:
    import importlib.util
    import unittest

    path = Path(__file__).parents[2] / "src/sandman/eval/witness/sandman_eval_witness.py"
    spec = importlib.util.spec_from_file_location("witness_under_test", path)
    assert spec is not None and spec.loader is not None
    witness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(witness)

    class Case(unittest.TestCase):
        def test_x(self) -> None:
            pass

    case = Case("test_x")
    case.maxDiff = None  # honest tests set such values
    assert witness._overridden(case) == []
    case.assertEqual = lambda *args, **kwargs: None  # type: ignore[method-assign]
    case.failureException = unittest.case._ShouldStop  # type: ignore[attr-defined]
    assert witness._overridden(case) == ["assertEqual", "failureException"]


def test_a_test_with_no_literal_gets_a_mutant_that_expects_nothing() -> None:
    """``assert got == expected`` has no value to vary: a copy expecting a fresh
    ``object()`` fails for an honest result and passes for one equal to anything."""
    text = (
        "from lib import f, g\n\n\ndef test_x():\n"
        "    expected = g()\n    assert f() == expected\n    assert f() == (\n        g()\n    )\n"
    )
    made = plan({"t.py": text}, [Target("t.py::test_x", "t.py", (), "test_x")], ["t.py::test_x"],
                "pytest")  # fmt: skip
    mutants = [c.token for c in made.canaries if c.kind == "mutant"]
    assert len(mutants) == 1
    source = made.sources["t.py"]

    class Anything:
        def __eq__(self, other: object) -> bool:
            return True

    def ends(result: object) -> dict[str, bool]:
        lib = types.ModuleType("lib")
        lib.f = lambda: result  # type: ignore[attr-defined]
        lib.g = lambda: 3  # type: ignore[attr-defined]
        scope: dict[str, object] = {}
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "lib", lib)
            exec(compile(source, "t.py", "exec"), scope)  # noqa: S102 (the planted module)
            return _passed(scope, [made.listed["t.py::test_x"], *mutants])

    honest = ends(3)
    assert honest[made.listed["t.py::test_x"]] and not honest[mutants[0]]
    assert ends(Anything())[mutants[0]]  # a lie the verdict names


def _passed(scope: dict[str, object], names: list[str]) -> dict[str, bool]:
    passed = {}
    for name in names:
        try:
            scope[name]()  # type: ignore[operator]
            passed[name] = True
        except AssertionError:
            passed[name] = False
    return passed


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_recorded_members_are_decided_by_their_records(shape: str) -> None:
    """With a recorder, no member holds an expected value (planted and stub alike but
    for names); the grader holds each member's values (`Plan.recorded`), and a member
    the framework passed stays passed only where every site recorded its value."""
    import random

    text = SHAPES[shape]
    test = "t.py::T::test_x" if "class T" in text else "t.py::test_x"
    scope = ("T",) if "class T" in text else ()
    mode = "unittest" if "unittest" in text else "pytest"
    targets = [Target(test, "t.py", scope, "test_x")]
    made = plan(
        {"t.py": text},
        targets,
        [test],
        mode,  # type: ignore[arg-type]
        rng=random.Random(3),
        recorder="witness_mod",
    )
    assert "witness_mod" in made.sources["t.py"]
    original = made.listed[test]
    members = [c.token for c in made.canaries if c.of == test and c.kind in ("mutant", "agree")]
    assert set(made.recorded) == {original, *members}
    values = made.recorded[original]
    assert len({repr(made.recorded[m]) for m in members}) > 1  # a grid
    # What an honest fix records in every member: the original's values.
    records = {
        name: {site: [(repr(v), True)] for site, v in enumerate(values, start=1)}
        for name in made.recorded
    }
    results: dict[str, TestStatus] = {f"t.py::{name}": "PASSED" for name in made.recorded}
    decided = made.recorded_outcomes(results, records)
    assert decided[f"t.py::{original}"] == "PASSED"
    for name in made.recorded:
        want = "PASSED" if made.recorded[name] == values else "FAILED"
        assert decided[f"t.py::{name}"] == want, name
    # A site with no record (swallowed), or one that does not agree, fails it.
    first = {site: seen for site, seen in records[original].items() if site != 1}
    assert made.recorded_outcomes({"x": "PASSED", f"t.py::{original}": "PASSED"}, {original: first}) == {
        "x": "PASSED", f"t.py::{original}": "FAILED"
    }  # fmt: skip
    disagree = {
        site: [(text, False) for text, _ in seen] for site, seen in records[original].items()
    }
    assert made.recorded_outcomes({original: "PASSED"}, {original: disagree}) == {
        original: "FAILED"
    }
