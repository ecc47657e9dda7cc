"""Evidence the patch cannot predict: listed tests renamed, canaries planted beside them.

(About 930 lines: one rewrite, from reading a test file to planting its copies and canaries;
the values the copies expect are drawn in `sandman.eval.decoys`.)

Pure: test files' text in, rewritten text and a `Plan` out; the harness reads
and writes the files, after ``pre_test`` has finished and before the test run,
so no code of the patch has ever seen what this module draws.

- **Renamed.** Every FAIL_TO_PASS and PASS_TO_PASS test whose ``def`` is found
  in its file gets a fresh random name for this run. The run's results are
  translated back by the token; a result that names a renamed test by its
  listed name came from something other than the framework (that name does
  not exist in the run), and is dropped and reported. Tampering aimed at a
  known test id finds no target.
- **Canaries.** Beside them, in the same scope (so the same class, fixtures,
  marks and runner), tests under fresh random names whose outcome is known:
  one must pass, two must fail (one by assertion, one by an exception), one
  must skip, one must be an expected failure, and for each FAIL_TO_PASS test
  a *twin*: its own body, then a statement that fails. Code that makes
  failures pass, hollows test bodies, no-ops assertions or flips outcomes
  does the same to a canary, and a canary that does not end as planted is a
  lie the verdict names. A twin fails at the same line as its original when
  the bug is still there, so tampering keyed on where a failure happens
  reaches the twin too.
- **Family.** Each FAIL_TO_PASS test is written again where it stood, as one
  of a family: copies of it that expect other values (*mutants*, which must
  fail), drawn by `sandman.eval.decoys` so that the original's values are one
  of a grid of value tuples alike, each planted plain and re-importing. Every
  member, the original included, is written by the same code from the same
  lines, in a random order, with the same blank lines between: only names and
  values tell them apart, and the values do not say which is the original's.
  A forger that forges by what a test calls, or spares the planted shapes,
  meets the mutants; one that reads the values must guess.
- **Declared.** Whether a test's own source (its decorators and body, its
  class's, its module's ``pytestmark``, the conftest files above it) declares
  an expected failure or a skip: XFAIL and SKIPPED count only there.
"""

from __future__ import annotations

import ast
import posixpath
import random
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

from sandman.eval import decoys, variants
from sandman.eval.parsers import TestStatus
from sandman.eval.settle import HELPERS, expect_nothing, helpers, settle, settled_values
from sandman.eval.verdict import lookup

__all__ = ["KINDS", "Canary", "Kind", "Plan", "Target", "locate", "plan", "token"]

Mode = Literal["pytest", "unittest"]
Kind = Literal["pass", "fail", "error", "skip", "xfail", "twin", "mutant", "agree", "variant"]

_FAILS: frozenset[TestStatus] = frozenset({"FAILED", "ERROR"})
_EXPECTED: dict[Kind, frozenset[TestStatus]] = {
    "pass": frozenset({"PASSED"}),
    "fail": _FAILS,
    "error": _FAILS,
    "skip": frozenset({"SKIPPED"}),
    "xfail": frozenset({"XFAIL"}),
    "twin": _FAILS,
    "mutant": _FAILS,
    "agree": frozenset(),  # whatever its original ends with
    "variant": frozenset(),  # likewise
}
KINDS: tuple[Kind, ...] = (
    "pass", "fail", "error", "skip", "xfail", "twin", "mutant", "agree", "variant",
)  # fmt: skip
_UNITTEST_ID = re.compile(r"^(\w+) \(([\w.]+)\)$")
_XFAIL = re.compile(r"xfail|expectedFailure")
_SKIP = re.compile(r"skip", re.IGNORECASE)


# What the plan draws from: the system's randomness, or the generator `plan` is
# given (the harness seeds one from a secret of the process and the inputs, so
# the same inputs plant the same canaries and their verdict is the same bytes).
_RNG: ContextVar[random.Random | None] = ContextVar("sandman_canaries_rng", default=None)
_SYSTEM = random.SystemRandom()


def _source() -> random.Random:
    return _RNG.get() or _SYSTEM


def _below(n: int) -> int:
    return _source().randrange(n)


def _choice(items: str) -> str:
    return _source().choice(items)


def token(prefix: str = "test_") -> str:
    """A fresh name no patch can have guessed: ``prefix`` and 12 random letters and digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return prefix + _choice(alphabet[:26]) + "".join(_choice(alphabet) for _ in range(11))


@dataclass(frozen=True)
class Target:
    """Where a listed test is defined: its file, the classes around it, its function."""

    test_id: str
    path: str
    scope: tuple[str, ...]
    function: str


@dataclass(frozen=True)
class Canary:
    """A planted test: its token, what it is, the statuses it may honestly end with."""

    token: str
    kind: Kind
    expected: frozenset[TestStatus]
    path: str
    of: str = ""
    """For a twin: the FAIL_TO_PASS test it copies."""
    unlogged: bool = False
    """Whether the log may not name it (pytest's -rA names a skipped test by its
    file and line only); the framework's own report must still."""

    def describe(self) -> str:
        """What it is, without its token (verdicts hold only what the inputs decide)."""
        if self.kind == "twin":
            return f"the twin of {self.of}"
        if self.kind == "mutant":
            return f"a mutant of {self.of}"
        if self.kind == "agree":
            return f"the re-importing copy of {self.of}"
        if self.kind == "variant":
            return f"an input variant of {self.of}"
        return f"the must-{self.kind} canary"


@dataclass
class Plan:
    """What `plan` decided for one run."""

    sources: dict[str, str] = field(default_factory=dict)
    """Rewritten files: path -> text (what the test framework must run)."""
    stubs: dict[str, str] = field(default_factory=dict)
    """The rewritten files as they lie on disk: path -> the text with every expected
    literal of the families' equality assertions shown as ``(...)`` (`sandman.eval.settle`),
    line for line."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Token -> the function's listed name."""
    listed: dict[str, str] = field(default_factory=dict)
    """A renamed test's listed id -> its token."""
    canaries: list[Canary] = field(default_factory=list)
    declared: dict[str, frozenset[str]] = field(default_factory=dict)
    """Listed id -> what its source declares ("xfail", "skip")."""
    left: list[str] = field(default_factory=list)
    """Why a test or file was left as it was."""
    recorded: dict[str, tuple[object, ...]] = field(default_factory=dict)
    """With a recorder: each settled member's token -> its expected values by site
    (site 1 first). They are nowhere in the test process: its assertions record their
    plain results for the grader (`sandman.eval.settle`), and `recorded_outcomes`
    decides them."""
    markers: set[str] = field(default_factory=set)
    variants: dict[str, tuple[variants.Key, int]] = field(default_factory=dict)
    """Each planted input variant's token -> which variant it is, and how many sites its
    assertions record (`sandman.eval.variants`)."""
    """The names settled members bind their first helper to: reading its code is how a
    member tells the witness it started (`sandman.eval.settle.helpers`)."""

    def translate(
        self, results: Mapping[str, TestStatus]
    ) -> tuple[dict[str, TestStatus], dict[str, TestStatus], list[str]]:
        """The run's results by listed name; the canaries' by token; names that lied.

        A key that names a renamed test by its listed name (or a parametrized
        instance of it) is not the framework's: it is dropped and returned.
        """
        tests: dict[str, TestStatus] = {}
        planted: dict[str, TestStatus] = {}
        forged: list[str] = []
        tokens = {c.token for c in self.canaries}
        for key, status in results.items():
            found = next((t for t in tokens if t in key), None)
            if found is not None:
                planted[found] = _worse(planted.get(found), status)
                continue
            if self._names_renamed(key):
                forged.append(key)
                continue
            name = key
            for tok, original in self.renamed.items():
                if tok in name:
                    name = name.replace(tok, original)
            tests[name] = status
        return tests, planted, forged

    def recorded_outcomes(
        self,
        results: Mapping[str, TestStatus],
        values: Mapping[str, Mapping[int, Sequence[tuple[str, bool]]]],
    ) -> dict[str, TestStatus]:
        """``results`` with each recorded member's pass decided here: it stays a pass
        only if, at every site, its assertions recorded plain values (``values``:
        member -> site -> (``repr`` of the plain copy, whether the result equals it))
        and each equals the expected value; else it failed. A site with no record
        fails it too (a record swallowed hides nothing)."""
        if not self.recorded:
            return dict(results)
        decided: dict[str, TestStatus] = {}
        for key, status in results.items():
            token = next((t for t in self.recorded if t in key), None)
            if (
                status == "PASSED"
                and token is not None
                and not _agrees(values.get(token, {}), self.recorded[token])
            ):
                status = "FAILED"
            decided[key] = status
        return decided

    def _names_renamed(self, key: str) -> bool:
        for listed in self.listed:
            if key == listed or key.startswith(listed + "["):
                return True
            match = _UNITTEST_ID.match(listed)
            if match and key == f"{match[1]} ({match[2]}.{match[1]})":
                return True
        return False

    def scrub(self, text: str) -> str:
        """``text`` with this run's tokens replaced: a renamed test's by its listed
        name, a canary's by what it is."""
        for canary in self.canaries:
            text = text.replace(canary.token, f"<{canary.describe()}>")
        for tok, original in self.renamed.items():
            text = text.replace(tok, original)
        return text

    def ran(self, log: str) -> bool:
        """Whether ``log`` reports any renamed test (so the rewritten files ran)."""
        return any(tok in log for tok in self.renamed)

    def lies(
        self,
        observed: Mapping[str, TestStatus],
        ran: bool,
        *,
        log: bool = True,
        listed: Mapping[str, TestStatus] | None = None,
    ) -> list[str]:
        """Each canary whose outcome in ``observed`` is not what was planted.

        A canary missing from a run that reported none of the renamed tests
        either (``ran`` False: the file never ran, say it failed to import) is
        no evidence; missing from a run that did report them, it is. A
        re-importing copy must end as its original did in ``listed`` (the
        same run's results by listed name; no evidence where that is missing).
        """
        lies = []
        for canary in self.canaries:
            status = observed.get(canary.token, "MISSING")
            if status == "MISSING" and (not ran or (log and canary.unlogged)):
                continue
            if canary.kind == "agree":
                original = lookup(canary.of, listed or {})
                if original not in ("MISSING", status):
                    lies.append(
                        f"{canary.describe()} in {canary.path} ended {status}, "
                        f"its original {original}: the name the test calls is not the library's"
                    )
                continue
            if canary.kind == "variant":
                # One way only: an honest partial fix can get a variant right and its
                # original wrong; a pass of the original alone is what special-casing does.
                original = lookup(canary.of, listed or {})
                if original == "PASSED" and status != "PASSED":
                    lies.append(
                        f"{canary.describe()} in {canary.path} ended {status}, its original "
                        "PASSED: the code answers the test's own inputs, not others alike"
                    )
                continue
            if status not in canary.expected:
                want = "/".join(sorted(canary.expected))
                lies.append(
                    f"{canary.describe()} in {canary.path} ended {status}, planted to end {want}"
                )
        return lies


def _agrees(
    records: Mapping[int, Sequence[tuple[str, bool]]], expected: tuple[object, ...]
) -> bool:
    """Whether every site's records are plain values equal to its expected value."""
    for site, want in enumerate(expected, start=1):
        seen = records.get(site, ())
        if not seen:
            return False
        for text, agree in seen:
            try:
                got = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return False
            if not agree or got != want:
                return False
    return True


def _worse(old: TestStatus | None, new: TestStatus) -> TestStatus:
    if old is None or old == new:
        return new
    order: tuple[TestStatus, ...] = ("PASSED", "XFAIL", "SKIPPED", "MISSING", "FAILED", "ERROR")
    # A canary reported two ways (pytest: a call and a teardown): its least passing.
    return max(old, new, key=order.index)


def locate(test_id: str, mode: Mode, paths: Collection[str]) -> Target | None:
    """The file and scope of a listed test id, or None when they cannot be told.

    pytest: ``path::Class::name[params]``. unittest and Django: ``name
    (package.module.Class)`` (3.11: ``... Class.name)``), the module found
    as the one file in ``paths`` ending in its dotted path.
    """
    if mode == "pytest":
        path, sep, rest = test_id.partition("::")
        if not sep or path not in paths:
            return None
        parts = rest.split("[", 1)[0].split("::")
        if not all(p.isidentifier() for p in parts):
            return None
        return Target(test_id, path, tuple(parts[:-1]), parts[-1])
    match = _UNITTEST_ID.match(test_id)
    if match is None:
        return None
    function, dotted = match[1], match[2].split(".")
    if dotted[-1] == function:
        dotted = dotted[:-1]
    if len(dotted) < 2:
        return None
    tail = "/".join(dotted[:-1]) + ".py"
    found = [p for p in paths if p == tail or p.endswith("/" + tail)]
    if len(found) != 1:
        return None
    return Target(test_id, found[0], (dotted[-1],), function)


# -- the rewrite ----------------------------------------------------------------------------


@dataclass
class _Found:
    target: Target
    node: ast.FunctionDef | ast.AsyncFunctionDef
    classes: list[ast.ClassDef]


def plan(
    files: Mapping[str, str],
    targets: list[Target],
    fail_to_pass: Collection[str],
    mode: Mode,
    conftests: Mapping[str, str] | None = None,
    draw: Callable[[], str] = token,
    kinds: Collection[Kind] = KINDS,
    rng: random.Random | None = None,
    recorder: str | None = None,
    inputs: variants.Inputs | None = None,
) -> Plan:
    """Rename ``targets`` in ``files`` and plant canaries beside them.

    ``files`` holds the text of every file a target names; ``conftests`` the
    conftest files of the tree (path -> text), read for what they declare.
    A file that does not parse, or a target whose ``def`` is not found
    exactly once where its id says, is left as it is (and said so in
    `Plan.left`): the listed test is then graded by its name, as before.
    ``kinds`` are the canaries to plant (a log format that cannot show an
    outcome, as Django's parser shows no expected failure, leaves its kind out).
    ``rng``: what to draw names and values from (default: the system's).
    ``recorder``: the witness's module name, where the families' assertions record
    their plain results and the grader alone holds the expected values
    (`Plan.recorded`); None: they compare in the test process. ``inputs``: with a
    recorder, each FAIL_TO_PASS test's input variants (`sandman.eval.variants`): every
    one drawn (``inputs.values`` None: to learn what they record), else those
    ``inputs.values`` holds, each expecting its values there.
    """
    reset = _RNG.set(rng) if rng is not None else None
    try:
        return _plan(
            files, targets, fail_to_pass, mode, conftests or {}, draw, kinds, recorder, inputs
        )
    finally:
        if reset is not None:
            _RNG.reset(reset)


def _plan(
    files: Mapping[str, str],
    targets: list[Target],
    fail_to_pass: Collection[str],
    mode: Mode,
    conftests: Mapping[str, str],
    draw: Callable[[], str],
    kinds: Collection[Kind],
    recorder: str | None = None,
    inputs: variants.Inputs | None = None,
) -> Plan:
    result = Plan()
    by_file: dict[str, list[Target]] = {}
    for target in targets:
        by_file.setdefault(target.path, []).append(target)
    for path in sorted(by_file):
        text = files.get(path)
        if text is None:
            result.left.append(f"{path}: not read")
            continue
        above = _conftest_text(path, conftests or {})
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError) as exc:
            result.left.append(f"{path}: does not parse here ({type(exc).__name__})")
            for target in by_file[path]:
                result.declared[target.test_id] = _declares(text + above)
            continue
        lines = text.splitlines(keepends=True)
        found = []
        for target in by_file[path]:
            hit = _find(tree, target)
            if hit is None:
                result.left.append(f"{target.test_id}: its def is not in {path}")
                result.declared[target.test_id] = _declares(text + above)
                continue
            found.append(hit)
            result.declared[target.test_id] = _declares(_context(lines, hit, tree) + above)
        if found:
            result.sources[path], result.stubs[path] = _rewrite(
                path, lines, tree, found, set(fail_to_pass), mode, result, draw, set(kinds),
                recorder, inputs,
            )  # fmt: skip
    return result


def _conftest_text(path: str, conftests: Mapping[str, str]) -> str:
    directory = posixpath.dirname(path)
    parts = directory.split("/") if directory else []
    above = ["/".join(parts[:i]) for i in range(len(parts) + 1)]
    return "".join(
        conftests.get(posixpath.join(d, "conftest.py") if d else "conftest.py", "") for d in above
    )


def _declares(text: str) -> frozenset[str]:
    found = set()
    if _XFAIL.search(text):
        found.add("xfail")
    if _SKIP.search(text):
        found.add("skip")
    return frozenset(found)


def _find(tree: ast.Module, target: Target) -> _Found | None:
    body: list[ast.stmt] = tree.body
    classes: list[ast.ClassDef] = []
    for name in target.scope:
        matches = [n for n in body if isinstance(n, ast.ClassDef) and n.name == name]
        if len(matches) != 1:
            return None
        classes.append(matches[0])
        body = matches[0].body
    defs = [
        n
        for n in body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == target.function
    ]
    if len(defs) != 1:
        return None
    return _Found(target, defs[0], classes)


def _start(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """The 1-based line a definition starts on, its decorators included."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _segment(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return "".join(lines[_start(node) - 1 : node.end_lineno])


def _context(lines: list[str], hit: _Found, tree: ast.Module) -> str:
    """The test's source and what its class and module declare for every test in them."""
    parts = [_segment(lines, hit.node)]
    for klass in hit.classes:
        parts += ["".join(lines[d.lineno - 1 : d.end_lineno]) for d in klass.decorator_list]
        parts += [ast.get_source_segment("".join(lines), n) or "" for n in _marks(klass.body)]
    parts += [ast.get_source_segment("".join(lines), n) or "" for n in _marks(tree.body)]
    return "\n".join(parts)


def _marks(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements that mark every test in a scope (``pytestmark = ...``)."""
    return [
        n
        for n in body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "pytestmark"
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        )
    ]


def _scope_marked(hit: _Found, tree: ast.Module) -> bool:
    """Whether the scope marks all its tests (its tests then are not plain ones)."""
    if _marks(tree.body) or any(
        isinstance(n, ast.FunctionDef) and n.name == "pytest_generate_tests" for n in tree.body
    ):
        return True
    return any(k.decorator_list or _marks(k.body) for k in hit.classes)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _leaves_early(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether the body can end without running a statement put after it."""
    stack: list[ast.AST] = list(node.body)
    while stack:
        item = stack.pop()
        if isinstance(item, (ast.Return, ast.Yield, ast.YieldFrom)):
            return True
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(item))
    return False


def _rewrite(
    path: str,
    lines: list[str],
    tree: ast.Module,
    found: list[_Found],
    fail_to_pass: set[str],
    mode: Mode,
    result: Plan,
    draw: Callable[[], str],
    kinds: set[Kind],
    recorder: str | None,
    inputs: variants.Inputs | None,
) -> tuple[str, str]:
    """The file planted, and its stub (the same, its families' expected values hidden)."""
    # Edits by line: a FAIL_TO_PASS test's lines replaced by its family (first
    # index -> (index after, text, stub)), text inserted before a line, renamed defs.
    families: dict[int, tuple[int, str, str]] = {}
    inserts: dict[int, list[str]] = {}
    renames: dict[int, tuple[str, str]] = {}
    text = "".join(lines)
    for hit in found:
        node, function = hit.node, hit.target.function
        uses = len(re.findall(rf"\b{re.escape(function)}\b", text))
        if uses != 1 and not _defined_alike(tree, function, uses):
            result.left.append(f"{hit.target.test_id}: its name is used elsewhere in {path}")
            continue
        name = _namer(function, draw)
        fresh = name()
        result.renamed[fresh] = function
        result.listed[hit.target.test_id] = fresh
        drawn = (hit.target.test_id, inputs) if inputs is not None else None
        family = (
            _family(lines, tree, node, function, fresh, name, mode, kinds, result, recorder, drawn)
            if hit.target.test_id in fail_to_pass
            else None
        )
        if family is None:
            renames[node.lineno - 1] = (function, fresh)
            continue
        # One block where the original stood, its members in a random order (the
        # framework runs a file top to bottom: "the first of the alike" must not
        # pick the original), each written by `_family` alike and set apart by the
        # same blank lines: nothing of the layout, nor of the code objects' lines,
        # tells the original from its copies (round 6 of heldout/ found it by a
        # blank line the original lacked).
        _source().shuffle(family)
        families[_start(node) - 1] = (
            node.end_lineno or node.lineno,
            _separator(lines, node).join(member.text for member in family),
            _separator(lines, node).join(member.stub for member in family),
        )
        declared = result.declared.get(hit.target.test_id, frozenset())
        for member in family:
            if member.kind is None:
                continue
            expected = _EXPECTED[member.kind]
            if "xfail" in declared:
                expected |= {"XFAIL"}
            if "skip" in declared:
                expected |= {"SKIPPED"}
            result.canaries.append(
                Canary(member.name, member.kind, expected, path, hit.target.test_id)
            )
    # The generic canaries go beside the first renamed test of a plain scope.
    plain = [h for h in found if h.target.test_id in result.listed and not _scope_marked(h, tree)]
    if plain:
        hit = plain[0]
        method = bool(hit.classes)
        unittest_like = mode == "unittest" or "self.assert" in _segment(lines, hit.node)
        block, planted = _generic(
            _indent(lines[hit.node.lineno - 1]),
            _separator(lines, hit.node),
            method,
            unittest_like,
            mode,
            draw,
            kinds,
        )
        inserts.setdefault(_start(hit.node) - 1, []).insert(0, block)
        result.canaries += [
            Canary(name, kind, _EXPECTED[kind], path, unlogged=kind == "skip" and mode == "pytest")
            for name, kind in planted
        ]
    elif found:
        result.left.append(f"{path}: its tests' scope marks them all; no generic canaries")
    out: list[str] = []
    stub: list[str] = []
    index = 0
    while index < len(lines):
        out.extend(inserts.get(index, []))
        stub.extend(inserts.get(index, []))
        if index in families:
            index, block, hidden = families[index]
            out.append(block)
            stub.append(hidden)
            continue
        line = lines[index]
        if index in renames:
            old, new = renames[index]
            line = re.sub(rf"\bdef(\s+){re.escape(old)}\b", rf"def\g<1>{new}", line, count=1)
        out.append(line)
        stub.append(line)
        index += 1
    if not out or not out[-1].endswith("\n"):
        out.append("\n")
        stub.append("\n")
    return "".join(out), "".join(stub)


def _namer(function: str, draw: Callable[[], str]) -> Callable[[], str]:
    """Fresh names for a test and its family, all of its name's look (``testFoo``)."""
    prefix = re.match(r"[A-Za-z]*_?", function)
    if prefix is None or prefix[0] in ("", "test_"):
        return draw
    head = prefix[0]
    return lambda: draw().replace("test_", head, 1)


def _separator(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The blank lines after each planted test: two at a module's top level, one in a class."""
    return "\n" if _indent(lines[node.lineno - 1]) else "\n\n"


def _defined_alike(tree: ast.Module, function: str, uses: int) -> bool:
    """The name appears only as the def of tests of that name in several classes."""
    defs = sum(
        1
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function
    )
    return defs == uses


@dataclass(frozen=True)
class _Member:
    """One test of a FAIL_TO_PASS test's family: the original (``kind`` None) or a copy."""

    name: str
    kind: Kind | None
    text: str
    stub: str
    """The text with its expected values hidden (`sandman.eval.settle`)."""


def _family(
    lines: list[str],
    tree: ast.Module,
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    function: str,
    fresh: str,
    name: Callable[[], str],
    mode: Mode,
    kinds: set[Kind],
    result: Plan,
    recorder: str | None,
    inputs: tuple[str, variants.Inputs] | None = None,
) -> list[_Member] | None:
    """The original under ``fresh`` and its copies, each written from the same lines by
    the same code (`_copy`), so they differ only in their names, their expected values
    (`sandman.eval.decoys`) and, for the re-importing forms, the imports they repeat.

    Per centre of the values' grid: the plain form and, where the module imports,
    the re-importing one. The original's centre gives the original and its
    re-importing copy (which must end as the original does); every other centre's
    are mutants (which must fail). None when the test has no copies.
    """
    if _copy(lines, node, function, fresh) is None:
        return None
    imports = _imports(tree) if "agree" in kinds else []
    grid = decoys.draw(node, lines, _source()) if "mutant" in kinds else None
    # Each member's varied assertions are decided by plain values (`sandman.eval.settle`),
    # with helpers bound at the top of its body under names fresh for the run.
    names = [token("_") for _ in range(HELPERS)]
    result.markers.add(names[0])
    members: list[_Member] = []
    for centre in grid.centres() if grid is not None else [()]:
        rendered = grid.render(lines, centre) if grid is not None else lines
        source, hidden, settled = (
            settle(rendered, node, names, recorded=recorder is not None)
            if grid is not None
            else (lines, lines, False)
        )
        first = not any(centre)
        for reimport in (False, True) if imports else (False,):
            member = fresh if first and not reimport else name()
            texts = []
            for written in (source, hidden):
                segment = _copy(written, node, function, member)
                assert segment is not None  # as for the original: only names and values differ
                if settled:
                    segment = _at_top(segment, node, source, [helpers(names, recorder)])
                if reimport:
                    # The module's imports again: it calls the library's functions even if
                    # the module's names were rebound (a fixed copy swapped into the module).
                    segment = _at_top(segment, node, source, imports)
                texts.append("".join(segment))
            kind: Kind | None = ("agree" if reimport else None) if first else "mutant"
            members.append(_Member(member, kind, *texts))
            if settled and recorder is not None:
                result.recorded[member] = settled_values(rendered, node)
    if grid is not None and recorder is not None and inputs is not None:
        members += _variants(lines, node, function, name, names, recorder, result, *inputs)
    if grid is None and "twin" in kinds and not _leaves_early(node):
        twin = name()
        segment = _copy(lines, node, function, twin)
        assert segment is not None
        text = "".join(segment) + _failing(lines, node, mode)
        members.append(_Member(twin, "twin", text, text))
    if grid is None and "mutant" in kinds:
        # No literal to vary: a copy whose equality assertions expect a fresh
        # ``object()``, which no honest result equals (a result equal to anything
        # passes it). It reads unlike the original; see docs/evaluation.md.
        nothing = expect_nothing(lines, node)
        if nothing is not None:
            mutant = name()
            segment = _copy(nothing, node, function, mutant)
            assert segment is not None
            members.append(_Member(mutant, "mutant", "".join(segment), "".join(segment)))
    return members if len(members) > 1 else None


def _variants(
    lines: list[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    function: str,
    name: Callable[[], str],
    names: list[str],
    recorder: str,
    result: Plan,
    test_id: str,
    inputs: variants.Inputs,
) -> list[_Member]:
    """The test's input variants (`sandman.eval.variants`), written as the family's
    members are: all of them while calibrating, else those with values to expect."""
    members: list[_Member] = []
    seen: set[str] = set()
    sites = len(settled_values(lines, node))
    for index in range(variants.COUNT):
        key = (test_id, index)
        moved = variants.transform(lines, node, inputs.rng(key), draw=index)
        if moved is None or "".join(moved) in seen:
            continue
        if inputs.values is not None and key not in inputs.values:
            continue
        seen.add("".join(moved))
        # Its own parse: a moved literal may change its length (never its lines).
        at = next(
            (
                n
                for n in ast.walk(ast.parse("".join(moved)))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.lineno == node.lineno
            ),
            None,
        )
        if at is None or len(settled_values(moved, at)) != sites:
            continue
        source, hidden, _ = settle(moved, at, names, recorded=True)
        member = name()
        texts = []
        for written in (source, hidden):
            segment = _copy(written, at, function, member)
            if segment is None:
                break
            texts.append("".join(_at_top(segment, at, source, [helpers(names, recorder)])))
        if len(texts) != 2:
            continue
        result.variants[member] = (key, sites)
        if inputs.values is not None:
            result.recorded[member] = inputs.values[key]
            members.append(_Member(member, "variant", *texts))
        else:
            # Calibrating: nothing to expect yet, so nothing to end as (`kind` None).
            members.append(_Member(member, None, *texts))
    return members


def _failing(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, mode: Mode) -> str:
    """A statement that fails, at the test body's indentation (a twin's last)."""
    body = _indent(lines[node.body[0].lineno - 1])
    value = _below(10**6)
    return (
        f"{body}self.assertEqual({value}, {value + 1 + _below(97)})\n"
        if mode == "unittest" and node.args.args and node.args.args[0].arg == "self"
        else f"{body}assert {value} == {value + 1 + _below(97)}\n"
    )


def _copy(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, function: str, name: str
) -> list[str] | None:
    """The test's lines, decorators included, its def renamed to ``name``."""
    if not node.body or node.body[0].lineno == node.lineno:
        return None  # a one-line def: no body indentation to copy
    segment = lines[_start(node) - 1 : node.end_lineno]
    def_at = node.lineno - _start(node)
    segment[def_at] = re.sub(
        rf"\bdef(\s+){re.escape(function)}\b", rf"def\g<1>{name}", segment[def_at], count=1
    )
    if segment[def_at] == lines[node.lineno - 1]:
        return None
    if not segment[-1].endswith("\n"):
        segment[-1] += "\n"
    # No docstring: Django's runner (and SWE-bench's parser) names a test with
    # one by its first line, which the copy would share with its original.
    # Lines become "pass" and blanks, so every other line keeps its index.
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and len(node.body) > 1
    ):
        at, end = first.lineno - _start(node), (first.end_lineno or first.lineno) - _start(node)
        segment[at] = _indent(segment[at]) + "pass\n"
        for index in range(at + 1, end + 1):
            segment[index] = ""
    return segment


def _imports(tree: ast.Module) -> list[str]:
    """The module's own top-level imports, as statements a function body can repeat."""
    return [
        ast.unparse(n)
        for n in tree.body
        if (
            isinstance(n, ast.Import)
            or (isinstance(n, ast.ImportFrom) and n.module != "__future__")
        )
        and not any(alias.name == "*" for alias in n.names)
    ]


def _at_top(
    segment: list[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    lines: list[str],
    statements: list[str],
) -> list[str]:
    """``segment`` (a copy of ``node``) with ``statements`` at the top of its body."""
    body = _indent(lines[node.body[0].lineno - 1])
    at = node.body[0].lineno - _start(node)
    return [*segment[:at], *(f"{body}{line}\n" for line in statements), *segment[at:]]


def _generic(
    indent: str,
    separator: str,
    method: bool,
    unittest_like: bool,
    mode: Mode,
    draw: Callable[[], str],
    kinds: set[Kind],
) -> tuple[str, list[tuple[str, Kind]]]:
    """The must-pass/fail/error/skip/xfail canaries, as a block at ``indent``."""
    this = "self" if method else ""
    a, b = _below(10**6), 10**6 + _below(10**6)
    c = _below(1000)
    equal = (
        f"self.assertEqual({a} + {c}, {a + c})"
        if unittest_like and method
        else f"assert {a} + {c} == {a + c}"
    )
    differ = f"self.assertEqual({a}, {b})" if unittest_like and method else f"assert {a} == {b}"
    skip = (
        f'self.skipTest("{draw()}")'
        if unittest_like and method
        else f'raise __import__("unittest").SkipTest("{draw()}")'
    )
    xfail = (
        f'@__import__("pytest").mark.xfail(strict=True, reason="{draw()}")'
        if mode == "pytest"
        else '@__import__("unittest").expectedFailure'
    )
    body = indent + "    "
    made: dict[Kind, str] = {
        "pass": f"({this}):\n{body}{equal}\n{separator}",
        "fail": f"({this}):\n{body}{differ}\n{separator}",
        "error": f"({this}):\n{body}raise LookupError({a})\n{separator}",
        "skip": f"({this}):\n{body}{skip}\n{separator}",
        "xfail": f"({this}):\n{body}{differ}\n{separator}",
    }
    block = ""
    planted: list[tuple[str, Kind]] = []
    for kind, rest in made.items():
        if kind not in kinds:
            continue
        name = draw()
        block += (f"{indent}{xfail}\n" if kind == "xfail" else "") + f"{indent}def {name}{rest}"
        planted.append((name, kind))
    return block, planted
