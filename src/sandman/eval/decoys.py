"""The values a FAIL_TO_PASS test's family expects: the original's among decoys alike.

Pure: a test's ``def`` and its file's lines in, a `Grid` out; `sandman.eval.canaries`
renders one copy of the test per centre of the grid (the original's included) through
the same code, so the copies differ only in their names and these values.

A family whose decoys are edits of the original has the original at its centre: each
mutant one edit from it and two from each other, the original's value the plurality of
every assertion and every character (red-team round 6 read it off four ways). So the
values are drawn so that no function of the family's values can point at the original:

- Each expected literal (an *axis*) takes ``k`` values that differ at one place (a
  *site*: a digit of a number, a character of a string) and nowhere else: the
  original's and ``k - 1`` drawn without repeats from the site's class (digits, lower
  case, upper case, separators, other punctuation), the same class whichever of them
  is the original's. Any two differ the same way.
- The family holds every combination of the axes' values (a full grid): each value
  comes as often as every other of its axis, and for each value tuple the ones that
  differ from it in any set of axes are there too. A forger that runs its own code
  on the calls it gets right, and so knows those axes' right values, is left with
  the grid of the axes it gets wrong (more than `AXES` literals share axes: there
  one it gets right tells the others).
- Each value keeps the original's equalities with the test's other constants, at
  every level of the literal (an expected value that repeats an input, a tuple
  that repeats one of the input's): equal constants show in the text and merge in
  ``co_consts``, so they say the same of every centre. (Where no other value
  keeps them, ``assert f("abc") == "abc"``, any is drawn: the mutants still catch a
  forger that forges by what a test calls, and the original is the one that repeats.)
- Which site, which class, how many values: decided from what all ``k`` values
  share (the site's class and place, those equalities), never from the original's
  own value.

So, given the family, the original's value tuple is any of the grid's ``∏ k`` with
the same likelihood: a forger must know which is right (then it could fix the bug),
or guess (docs/evaluation.md has the odds and the cost).
"""

from __future__ import annotations

import ast
import itertools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["AXES", "CENTRES", "CHOICES", "Grid", "draw", "literals", "pairs"]

CHOICES = 8
"""The most values one expected literal takes in a family (the original's among them)."""
CENTRES = 16
"""The most value tuples (centres) a family holds: each is planted plain and, where
the module imports, re-importing, so a family is at most 32 tests."""
AXES = 4
"""The most axes varied apart: with more expected literals than this, the literals are
dealt at random into this many axes whose values change together (log2 of `CENTRES`)."""

# Each class is closed: a site's value and every value drawn for it are of one class,
# so the class, read from any of them, is the same.
_CLASSES = (
    "0123456789",
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    " -_.,:;/",
    "!#$%&()*+<=>?@[]^`{|}~",
)
_LEADING = "123456789"  # the first digit of a number of several: "05" is not Python
_SIGNIFICANT = 15  # a double tells apart a change in any of a decimal's first 15 digits
_PLAIN_STRING = re.compile(r"""^(['"])[^'"\\\n]+\1$""")
_PLAIN_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


@dataclass(frozen=True)
class _Site:
    line: int  # 0-based
    column: int  # in UTF-8 bytes, as ast counts
    pool: str  # what the character may become: its class
    path: tuple[ast.expr, ...]  # the expected literal down to the constant holding it
    text: str  # that constant as written
    at: int  # the character's index in ``text``


@dataclass(frozen=True)
class Grid:
    """The values a family's copies expect: per site its axis and its values."""

    sites: tuple[tuple[int, int], ...]
    """(0-based line, byte column) of each changed character."""
    axis: tuple[int, ...]
    """Each site's axis."""
    values: tuple[tuple[str, ...], ...]
    """Each site's values; index 0 is the original's."""
    sizes: tuple[int, ...]
    """Each axis's number of values."""

    def centres(self) -> list[tuple[int, ...]]:
        """Every combination of the axes' value indices; all zeros is the original."""
        return list(itertools.product(*(range(k) for k in self.sizes)))

    def render(self, lines: list[str], centre: tuple[int, ...]) -> list[str]:
        """``lines`` with ``centre``'s values at the sites (each one byte, so nothing moves)."""
        out = lines[:]
        for (line, column), axis, values in zip(self.sites, self.axis, self.values, strict=True):
            raw = out[line].encode("utf-8", errors="surrogateescape")
            new = raw[:column] + values[centre[axis]].encode() + raw[column + 1 :]
            out[line] = new.decode("utf-8", errors="surrogateescape")
        return out


def draw(
    node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], rng: random.Random
) -> Grid | None:
    """The grid of values for ``node``'s expected literals, or None when none can vary."""
    constants = _constants(node)
    axes: list[list[_Site]] = []
    for side in literals(node):
        found = _sites(side, lines)
        if found:
            rng.shuffle(found)  # so the first that fits is any that fits
            axes.append(found)
    if not axes:
        return None
    # Each value a site may take keeps the original's equalities with the test's
    # other constants (an input it repeats, a sibling, another literal) at every
    # level: equal constants show in the text and merge in ``co_consts``, so they
    # must say the same of every centre. Where that leaves no choice, any value.
    known: dict[_Site, str] = {}

    def allowed(site: _Site) -> str:
        if site not in known:
            known[site] = _alike(site, constants)
        return known[site]

    loose = set()
    widest = []
    for number, found in enumerate(axes):
        best = 1
        for site in found:
            best = max(best, len(allowed(site)))
            if best >= CHOICES:
                break
        if best == 1:
            loose.add(number)
            best = max(len(site.pool) for site in found)
        widest.append(min(best, CHOICES))

    def values_of(number: int, site: _Site) -> str:
        return site.pool if number in loose else allowed(site)

    # More literals than axes: deal them into AXES groups whose values change together.
    order = list(range(len(axes)))
    rng.shuffle(order)
    groups = [order[i :: min(AXES, len(axes))] for i in range(min(AXES, len(axes)))]
    most = [min(widest[member] for member in group) for group in groups]
    sizes = [2] * len(groups)
    grown = True
    while grown:
        grown = False
        for g in rng.sample(range(len(groups)), len(groups)):
            if sizes[g] < most[g] and math.prod(sizes) // sizes[g] * (sizes[g] + 1) <= CENTRES:
                sizes[g] += 1
                grown = True
    sites: list[tuple[int, int]] = []
    axis: list[int] = []
    values: list[tuple[str, ...]] = []
    taken: set[object] = set()  # what earlier sites' values are, at every level
    for g, group in enumerate(groups):
        for member in group:
            site = next(s for s in axes[member] if len(values_of(member, s)) >= sizes[g])
            original = site.text[site.at]
            # Apart from every value of the sites before: no centre's literals may
            # equal each other where the original's do not.
            choices = values_of(member, site)
            apart = [
                c for c in choices if c != original and not set(_keys(site, c, constants)) & taken
            ]
            if len(apart) < sizes[g] - 1:
                apart = [c for c in choices if c != original]
            drawn = (original, *rng.sample(apart, sizes[g] - 1))
            for value in drawn:
                taken.update(_keys(site, value, constants))
            sites.append((site.line, site.column))
            axis.append(g)
            values.append(drawn)
    return Grid(tuple(sites), tuple(axis), tuple(values), tuple(sizes))


def literals(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    """The expected sides of the test's equality assertions that are plain literals.

    ``assert call(...) == <literal>`` and ``self.assertEqual(call(...), <literal>)``
    (either order): the side that is a constant, or a list or tuple of them,
    when the other side is not.
    """
    return [expected for _, expected in pairs(node)]


def pairs(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.expr, ast.expr]]:
    """Each of `literals` with the side it is compared with: (result, expected)."""
    found: list[tuple[ast.expr, ast.expr]] = []
    for item in ast.walk(node):
        pair: list[ast.expr] = []
        if isinstance(item, ast.Assert) and isinstance(item.test, ast.Compare):
            compare = item.test
            if len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
                pair = [compare.left, compare.comparators[0]]
        elif (
            isinstance(item, ast.Call)
            and isinstance(item.func, ast.Attribute)
            and item.func.attr in ("assertEqual", "assertEquals")
            and len(item.args) >= 2
        ):
            pair = list(item.args[:2])
        if len(pair) == 2:
            plain = [_is_literal(side) for side in pair]
            if plain.count(True) == 1:
                at = plain.index(True)
                found.append((pair[1 - at], pair[at]))
    return found


def _is_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, str)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return bool(node.elts) and all(_is_literal(e) for e in node.elts)
    return False


def _sites(side: ast.expr, lines: list[str]) -> list[_Site]:
    """Where one expected literal can take another value of the same look."""
    found = []
    for leaf, path in _paths(side, ()):
        raw = lines[leaf.lineno - 1].encode("utf-8", errors="surrogateescape")
        start, end = leaf.col_offset, leaf.end_col_offset or leaf.col_offset
        text = raw[start:end].decode("utf-8", errors="replace")
        if _PLAIN_NUMBER.match(text):
            places = _digits(text)
        elif _PLAIN_STRING.match(text):
            places = [
                (i, pool)
                for i, char in enumerate(text[1:-1], 1)
                for pool in _CLASSES
                if char in pool
            ]
        else:
            continue
        for i, pool in places:
            column = start + len(text[:i].encode())
            found.append(_Site(leaf.lineno - 1, column, pool, path, text, i))
    return found


def _paths(
    node: ast.expr, above: tuple[ast.expr, ...]
) -> list[tuple[ast.expr, tuple[ast.expr, ...]]]:
    """The single-line scalar constants in a literal, each with the literals holding it."""
    path = (*above, node)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [found for e in node.elts for found in _paths(e, path)]
    return [(node, path)] if node.lineno == node.end_lineno else []


@dataclass
class _Constants:
    """Every literal in a test (constants, and lists and tuples of them): its key, and
    how many stand free or in a literal list or tuple per key (the compiler folds those
    into one constant: equal constants merge in ``co_consts`` only where both stand free)."""

    keys: dict[int, object]
    nested: dict[int, bool]
    free: Counter[object]
    folded: Counter[object]


def _constants(node: ast.AST) -> _Constants:
    inside = {
        id(child)
        for item in ast.walk(node)
        if isinstance(item, (ast.List, ast.Tuple))
        for child in item.elts
    }
    found = _Constants({}, {}, Counter(), Counter())
    for item in ast.walk(node):
        if isinstance(item, (ast.Constant, ast.UnaryOp, ast.Tuple, ast.List)):
            try:
                value = ast.literal_eval(item)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            key = found.keys[id(item)] = _key(value)
            found.nested[id(item)] = id(item) in inside
            (found.folded if id(item) in inside else found.free)[key] += 1
    return found


def _key(value: object) -> object:
    """What equality of constants means here: by value (1 == 1.0), lists as tuples."""
    if isinstance(value, (tuple, list)):
        return ("c", tuple(_key(v) for v in value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("n", value)
    return (type(value).__name__, value if isinstance(value, (str, bytes)) else repr(value))


def _keys(site: _Site, char: str, constants: _Constants) -> list[object]:
    """The keys of the literals holding ``site`` (itself up to the expected side) with
    ``char`` at its place."""
    leaf = _key(_value(site.text[: site.at] + char + site.text[site.at + 1 :]))
    held = {id(node) for node in site.path}

    def key(node: ast.expr) -> object:
        if node is site.path[-1]:
            return leaf
        if id(node) in held and isinstance(node, (ast.List, ast.Tuple)):
            return ("c", tuple(key(e) for e in node.elts))
        return constants.keys[id(node)]

    return [key(node) for node in site.path]


def _value(text: str) -> object:
    """A plain number's or string's value, as written (no escapes: `_sites` saw to it)."""
    if _PLAIN_NUMBER.match(text):
        return float(text) if "." in text else int(text)
    return text[1:-1]


def _alike(site: _Site, constants: _Constants) -> str:
    """The characters of ``site``'s class with which each literal holding it equals
    another constant of the test, one standing free and one in a list or tuple, where
    and only where the original's does (its own character included): an expected value
    that repeats an input stays one that does, and ``co_consts`` keeps its length."""
    own: Counter[tuple[bool, object]] = Counter(
        (constants.nested[id(node)], constants.keys[id(node)]) for node in site.path
    )  # the literals holding the site are not others

    def pattern(char: str) -> tuple[tuple[bool, bool], ...]:
        return tuple(
            (constants.free[k] > own[False, k], constants.folded[k] > own[True, k])
            for k in _keys(site, char, constants)
        )

    mine = pattern(site.text[site.at])
    return "".join(c for c in site.pool if pattern(c) == mine)


def _digits(text: str) -> list[tuple[int, str]]:
    """The digits of a number that can change, each with what it may become: those
    of its whole part (``2.5`` takes ``7.5``, never ``2.0``, which a wrong answer of
    2 would equal)."""
    at = len(text) - len(text.lstrip("-"))
    whole = text[at:].split(".")[0]
    if len(whole) > 1 and whole[0] == "0" and "." not in text:
        return []  # "00": any other digit makes it "05", which is not Python
    places: list[tuple[int, str]] = []
    for i in range(at, at + min(len(whole), _SIGNIFICANT)):
        # By place, not by value (so any of the values gives the same places); a
        # float tells apart a change in any of its first digits.
        if i > at or len(whole) == 1:
            places.append((i, "0123456789"))
        elif whole[0] in _LEADING:
            places.append((i, _LEADING))
    return places
