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

The draw, per variant: every whole number of the body (and a decimal's integer part)
shifted by one ``k`` (differences and order kept: touching intervals still touch),
every letter of its plain strings through one permutation (case kept; punctuation and
spaces, where bugs like to live, kept). Each literal keeps its length, so every line
keeps its columns and the family's other edits their places. Expected literals stay as
written. A variant the fix fails, or on which the unpatched code already agrees with
the fix (it does not reach the bug), is not planted (the harness's calibration).
"""

from __future__ import annotations

import ast
import random
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sandman.eval.decoys import pairs

__all__ = ["COUNT", "KEEP", "Inputs", "learnt", "transform"]

COUNT = 4
"""How many variants of a test the calibration tries."""
KEEP = 2
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
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, rng: random.Random
) -> list[str] | None:
    """``lines`` with ``node``'s inputs moved by one draw from ``rng``, every literal its
    own length; None where the test has no input to move (or none moves)."""
    expected = _expected_spans(node)
    numbers: list[tuple[ast.Constant, bool, str]] = []  # constant, negated, integer part
    strings: list[ast.Constant] = []
    for constant, negated in _constants(node):
        if (constant.lineno, constant.col_offset) in expected or constant.lineno != (
            constant.end_lineno or constant.lineno
        ):
            continue
        text = _text(lines, constant)
        value = constant.value
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and _DIGITS.match(text):
            numbers.append((constant, negated, text))
        elif isinstance(value, float) and (match := _DECIMAL.match(text)):
            numbers.append((constant, negated, match[1]))
        elif isinstance(value, str) and _STRING.match(text) and any(c.isalpha() for c in text):
            strings.append(constant)
    edits: list[tuple[ast.Constant, str]] = []
    shifts = [k for k in range(-9, 10) if k and all(_fits(t, n, k) for _, n, t in numbers)]
    if numbers and shifts:
        k = rng.choice(shifts)
        for constant, negated, whole in numbers:
            text = _text(lines, constant)
            moved = int(whole) - k if negated else int(whole) + k
            edits.append((constant, str(moved) + text[len(whole) :]))
    if strings:
        letters = list(string.ascii_lowercase)
        rng.shuffle(letters)
        table = str.maketrans(
            string.ascii_lowercase + string.ascii_uppercase,
            "".join(letters) + "".join(letters).upper(),
        )
        edits += [(c, _text(lines, c).translate(table)) for c in strings]
    edits = [(c, new) for c, new in edits if new != _text(lines, c)]
    if not edits:
        return None
    out = lines[:]
    for constant, new in edits:
        index = constant.lineno - 1
        raw = out[index].encode("utf-8", errors="surrogateescape")
        start, end = constant.col_offset, constant.end_col_offset or constant.col_offset
        out[index] = (raw[:start] + new.encode() + raw[end:]).decode(
            "utf-8", errors="surrogateescape"
        )
    return out


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


def _fits(whole: str, negated: bool, k: int) -> bool:
    """Whether a number written ``whole`` (its integer part) keeps its length and sign
    when the value moves by ``k``."""
    moved = int(whole) - k if negated else int(whole) + k
    return moved >= (1 if negated else 0) and len(str(moved)) == len(whole)


def _expected_spans(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[tuple[int, int]]:
    """Where each constant of an equality assertion's expected side starts: left as written."""
    spans: set[tuple[int, int]] = set()
    for _, expected in pairs(node):
        for inner in ast.walk(expected):
            if isinstance(inner, ast.Constant):
                spans.add((inner.lineno, inner.col_offset))
    return spans


def _constants(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
) -> list[tuple[ast.Constant, bool]]:
    """The constants of the body (not its docstring, not inside an f-string), each with
    whether a unary minus stands before it."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    found: list[tuple[ast.Constant, bool]] = []

    def visit(item: ast.AST, negated: bool) -> None:
        if isinstance(item, ast.JoinedStr):
            return
        if isinstance(item, ast.Constant):
            found.append((item, negated))
            return
        if isinstance(item, ast.UnaryOp) and isinstance(item.op, ast.USub):
            visit(item.operand, True)
            return
        for child in ast.iter_child_nodes(item):
            visit(child, False)

    for statement in body:
        visit(statement, False)
    return found


def _text(lines: list[str], node: ast.Constant) -> str:
    raw = lines[node.lineno - 1].encode("utf-8", errors="surrogateescape")
    end = node.end_col_offset if node.end_col_offset is not None else node.col_offset
    return raw[node.col_offset : end].decode("utf-8", errors="surrogateescape")
