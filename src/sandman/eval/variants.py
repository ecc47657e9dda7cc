"""Inputs a patch cannot special-case: a FAIL_TO_PASS test again, on other inputs.

Pure: a test's ``def`` and its file's lines in, the same lines with the test's inputs
moved out; `sandman.eval.canaries` plants such a *variant* beside the family, and the
harness learns what each must record by running the instance's own fix (its gold
``patch``) on it once (`sandman.eval.harness`).

A forger that knows the answer the listed test expects (the problem statement often
spells it out: ``median([4, 1, 3, 2])`` should be ``2.5``) can return it for that input
and leave the bug for every other: the family's mutants vary the expected values, not
the inputs, so they cannot tell. A variant runs the same body on inputs moved by one
draw, expects what the fix answers there, and must end as its original: a patch that
answers only the test's own inputs fails it. Its expected values, like the family's,
never enter the test process (they are recorded, `sandman.eval.settle`), and they are
the fix's, so no patch can know them without computing them.

The draw, per variant: every number of the body moved alike, in turns (``draw % 3``) by
a small shift (differences and order kept: touching intervals still touch), by a shift
past every digit the numbers have (low digits kept: cents stay cents), or scaled; every
letter of its plain strings through one permutation (case kept) and every mark through
another (spaces and digits kept), and, every other draw, each run of marks one longer
and a letter of each string repeated; every other pair of draws, a list of numbers (or
of tuples of numbers) grown by two items past its largest (so every combination is
among a test's draws). A literal may change its length (a line never moves: the
caller parses the moved text again), so neither a table of the few inputs a smaller
draw could make nor a gate on the inputs' lengths holds (red-team round 13 beat a
first, length-keeping draw with both, and with fixes of only the structure a shift
keeps). Expected literals stay as written. A variant the fix fails, or on which the
unpatched code already agrees with the fix (it does not reach the bug), is not planted
(the harness's calibration).
"""

from __future__ import annotations

import ast
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sandman.eval.decoys import pairs

__all__ = ["COUNT", "KEEP", "Inputs", "learnt", "transform"]

COUNT = 8
"""How many variants of a test the calibration tries."""
KEEP = 8
"""How many of those that reach the bug a grade plants."""

Key = tuple[str, int]
"""A variant: its test's listed id, and which of the `COUNT` draws."""

_DIGITS = re.compile(r"^\d+$")
_DECIMAL = re.compile(r"^(\d+)(\.\d+)$")
_STRING = re.compile(r"""^(['"])[^'"\\\n]*\1$""")


@dataclass(frozen=True)
class Inputs:
    """What a plan draws its variants from, and what each must record.

    ``seed``: the draws' (the same for the calibration and every grade of an instance);
    ``values``: each planted variant's expected values by site, the fix's; None while
    calibrating (every variant planted, to learn them)."""

    seed: bytes
    values: dict[Key, tuple[object, ...]] | None = field(default=None)

    def rng(self, key: Key) -> random.Random:
        """The generator of one variant's draw."""
        return random.Random(self.seed + f"{key[0]}\0{key[1]}".encode())


def transform(
    lines: list[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    rng: random.Random,
    draw: int = 0,
) -> list[str] | None:
    """``lines`` with ``node``'s inputs moved by one draw from ``rng`` (no line added or
    removed; a literal may change its length); None where the test has no input to
    move, or where the moved text does not parse. ``draw``: which of a test's draws
    (the way numbers move takes turns, so every way is among a test's draws)."""
    expected = _expected_spans(node)
    numbers: list[tuple[ast.expr, float]] = []  # the span (a -n whole), its value
    strings: list[ast.Constant] = []
    lists: list[ast.List] = []
    for item, negated in _constants(node):
        if isinstance(item, ast.List):
            if (item.lineno, item.col_offset) not in expected:
                lists.append(item)
            continue
        constant = item.operand if isinstance(item, ast.UnaryOp) else item
        assert isinstance(constant, ast.Constant)
        if (constant.lineno, constant.col_offset) in expected or constant.lineno != (
            constant.end_lineno or constant.lineno
        ):
            continue
        text, value = _text(lines, constant), constant.value
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and (_DIGITS.match(text) or _DECIMAL.match(text)):
            numbers.append((item, -value if negated else value))
        elif isinstance(value, str) and _STRING.match(text) and any(c.isalpha() for c in text):
            strings.append(constant)
    move = _numbers(rng, [abs(v) for _, v in numbers], draw % 3)
    edits: list[tuple[ast.expr, str]] = [(span, _number(move(v))) for span, v in numbers]
    # Strings grow on every other draw, lists on every other pair: every combination of
    # the ways numbers move, strings grow and lists grow is among a test's draws.
    edits += _strings(rng, [(c, _text(lines, c)) for c in strings], grow=draw % 2 == 1)
    if draw // 2 % 2 == 1:
        edits += [e for e in (_appended(items, move) for items in lists) if e is not None]
    edits = [(span, new) for span, new in edits if new != _span_text(lines, span)]
    if not edits:
        return None
    out = lines[:]
    # Right to left within a line: each edit's columns are the original text's.
    for span, new in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        index = span.lineno - 1  # one line each (a list's end: where its last item ends)
        raw = out[index].encode("utf-8", errors="surrogateescape")
        first = span.col_offset
        last = span.end_col_offset if span.end_col_offset is not None else first
        out[index] = (raw[:first] + new.encode() + raw[last:]).decode(
            "utf-8", errors="surrogateescape"
        )
    try:
        ast.parse("".join(out))
    except (SyntaxError, ValueError):
        return None
    return out


class _End(ast.expr):
    """An empty span where a list's items end: text is inserted there."""


def _numbers(rng: random.Random, sizes: list[float], mode: int) -> Callable[[float], float]:
    """One draw of how the numbers move, all alike: by a small shift (``mode`` 0:
    differences kept), by a shift past every digit they have (1: low digits kept), or
    scaled (2: differences scaled)."""
    width = 10 ** len(str(int(max(sizes, default=1))))
    sign = rng.choice((-1, 1))
    if mode == 0:
        shift = sign * rng.randint(1, 9)
        return lambda v: v + shift
    if mode == 1:
        shift = rng.randint(1, 999) * width
        return lambda v: v + shift
    scale, shift = rng.randint(2, 9), rng.randint(0, 9)
    return lambda v: v * scale + shift


def _number(value: float) -> str:
    return repr(value) if isinstance(value, int) else repr(float(value))


_PUNCTUATION = ",.;:!?/()[]{}-_@#$%&*+=<>|~^"


def _strings(
    rng: random.Random, found: list[tuple[ast.Constant, str]], grow: bool
) -> list[tuple[ast.expr, str]]:
    """Every plain string through one permutation of letters (case kept) and one of
    punctuation (spaces and digits kept), so equal strings stay equal; and, with
    ``grow``, each run of marks one mark longer and one letter of each string repeated
    (so its length and the runs' lengths move: round 13 fixed only runs as long as the
    test's)."""
    letters = list(string.ascii_lowercase)
    marks = list(_PUNCTUATION)
    rng.shuffle(letters)
    rng.shuffle(marks)
    table = str.maketrans(
        string.ascii_lowercase + string.ascii_uppercase + _PUNCTUATION,
        "".join(letters) + "".join(letters).upper() + "".join(marks),
    )
    salt = rng.random()
    edits: list[tuple[ast.expr, str]] = []
    for constant, text in found:
        quote, body = text[0], text[1:-1].translate(table)
        if grow:
            body = re.sub(f"[{re.escape(_PUNCTUATION)}]+", lambda m: m[0][0] + m[0], body)
            # Drawn from the string itself (and the draw): equal strings grow alike.
            at = [i for i, c in enumerate(body) if c.isalpha()]
            if at:
                i = random.Random(f"{salt}\0{body}").choice(at)
                body = body[: i + 1] + body[i] + body[i + 1 :]
        edits.append((constant, quote + body + quote))
    return edits


def _appended(items: ast.List, move: Callable[[float], float]) -> tuple[ast.expr, str] | None:
    """Two more items for a list of numbers (or of tuples of numbers): its last two,
    moved as the numbers were and then past its largest; None for any other list."""
    try:
        values = ast.literal_eval(items)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if len(values) < 2 or not all(_numeric(v) for v in values):
        return None
    moved = [_map(v, move) for v in values]
    leaves = [x for v in moved for x in _leaves(v)]
    past = max(leaves) - min(leaves) + 1
    extra = [_map(v, lambda x: x + past) for v in moved[-2:]]
    last = items.elts[-1]
    end = _End(lineno=last.end_lineno or last.lineno, col_offset=last.end_col_offset or 0)
    end.end_lineno, end.end_col_offset = end.lineno, end.col_offset
    return end, "".join(", " + _literal(v) for v in extra)


def _numeric(value: object) -> bool:
    if isinstance(value, tuple):
        return bool(value) and all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _map(value: object, move: Callable[[float], float]) -> object:
    if isinstance(value, tuple):
        return tuple(_map(v, move) for v in value)
    assert isinstance(value, (int, float))
    return move(value)


def _leaves(value: object) -> list[float]:
    if isinstance(value, tuple):
        return [x for v in value for x in _leaves(v)]
    assert isinstance(value, (int, float))
    return [value]


def _literal(value: object) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    assert isinstance(value, (int, float))
    return _number(value)


def _span_text(lines: list[str], span: ast.expr) -> str:
    if isinstance(span, _End):
        return ""
    raw = lines[span.lineno - 1].encode("utf-8", errors="surrogateescape")
    last = span.end_col_offset if span.end_col_offset is not None else span.col_offset
    return raw[span.col_offset : last].decode("utf-8", errors="surrogateescape")


Planted = Mapping[str, tuple[Key, int]]
"""A run's variants: token -> (which variant, how many sites it records) (`Plan.variants`)."""
Records = Mapping[str, Mapping[int, Sequence[tuple[str, bool]]]]
"""A run's records: token -> site -> (the plain value's ``repr``, whether the result
equals it) (`sandman.eval.judge.Judgement.values`)."""


def learnt(
    fix: tuple[Planted, Records], unpatched: tuple[Planted, Records], keep: int = KEEP
) -> dict[Key, tuple[object, ...]]:
    """What each variant must record, from a run of the instance's fix and one of the
    unpatched code over the same draws: those the fix answers at every site, with one
    plain value each, and the unpatched code answers otherwise (else the variant does
    not reach the bug); at most ``keep`` per test, the first drawn first."""
    right, before = _answers(*fix), _answers(*unpatched)
    kept: dict[Key, tuple[object, ...]] = {}
    for key in sorted(right):
        if right[key] != before.get(key) and sum(k[0] == key[0] for k in kept) < keep:
            kept[key] = right[key]
    return kept


def _answers(planted: Planted, records: Records) -> dict[Key, tuple[object, ...]]:
    """Each variant's plain value at every site, where it recorded one value each (and
    the result agreed with it)."""
    found: dict[Key, tuple[object, ...]] = {}
    for token, (key, sites) in planted.items():
        values = []
        for site in range(1, sites + 1):
            seen = records.get(token, {}).get(site, ())
            texts = {text for text, _ in seen}
            if len(texts) != 1 or not all(agree for _, agree in seen):
                break
            try:
                values.append(ast.literal_eval(texts.pop()))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                break
        else:
            if sites:
                found[key] = tuple(values)
    return found


def _expected_spans(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[tuple[int, int]]:
    """Where each part of an equality assertion's expected side starts: left as written."""
    spans: set[tuple[int, int]] = set()
    for _, expected in pairs(node):
        for inner in ast.walk(expected):
            if isinstance(inner, ast.expr):
                spans.add((inner.lineno, inner.col_offset))
    return spans


def _constants(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
) -> list[tuple[ast.expr, bool]]:
    """The body's constants (not its docstring, not inside an f-string), each as its
    span (``-n`` whole) with whether a unary minus stands before it, and its list
    displays."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    found: list[tuple[ast.expr, bool]] = []

    def visit(item: ast.AST) -> None:
        if isinstance(item, ast.JoinedStr):
            return
        if isinstance(item, ast.Constant):
            found.append((item, False))
            return
        if (
            isinstance(item, ast.UnaryOp)
            and isinstance(item.op, ast.USub)
            and isinstance(item.operand, ast.Constant)
        ):
            found.append((item, True))
            return
        if isinstance(item, ast.List):
            found.append((item, False))
        for child in ast.iter_child_nodes(item):
            visit(child)

    for statement in body:
        visit(statement)
    return found


def _text(lines: list[str], node: ast.Constant) -> str:
    raw = lines[node.lineno - 1].encode("utf-8", errors="surrogateescape")
    end = node.end_col_offset if node.end_col_offset is not None else node.col_offset
    return raw[node.col_offset : end].decode("utf-8", errors="surrogateescape")
