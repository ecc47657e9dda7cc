"""A family's equality assertions, decided by plain values the result cannot speak for.

Pure: a test's ``def`` and its (rendered) lines in, the same lines out with each
equality assertion that `sandman.eval.decoys` varies rewritten, and one line of
helpers for the top of its body; `sandman.eval.canaries` applies both to every
member of a family alike, the original included.

``assert f(x) == 2.5`` hands ``2.5`` to the result's ``__eq__``. A result that is a
subclass of ``float`` (or ``str``, ``list``...) from the code under test can then
accept what is tied to its own wrong output (a value just below it, a subsequence
of it, a constant the test module shares: round 7 of ``heldout/``) while the family's
other values, unrelated to the bug, fail: the mutants cannot tell it from a right
answer. So the result never decides. Rewritten as ``assert SETTLED(f(x)) == 2.5``,
the assertion passes only if both hold:

1. **The plain value agrees.** The result is turned into plain built-in values first,
   by the expected literal's shape and without the literal: a ``str``, ``int``,
   ``float``, ``list`` or ``tuple`` (subclasses included) is copied from its built-in
   storage by the built-in type's own methods, so none of its methods runs; any
   other object is converted (``float(v)``, ``str(v)``, ``list(v)``...) before
   anything hands it the expected value, so what it commits to is blind. The plain
   copy is compared with the literal by the built-in comparison.
2. **The result agrees.** Only then ``result == literal``, as the test wrote it, so
   an honest wrong answer (``5`` where ``"5"`` is expected) still fails. This part
   can only fail an assertion, never pass one.

Both are decided inside ``SETTLED``, which gives ``True`` or, where they disagree,
the plain copy in a tuple (or a fresh ``object()``: the plain copy agrees and the
result does not); the assertion compares that with ``True``, which stands where the
literal stood (``(True, 2.5)[False]``). So a failure shows what the result was and
never the value expected: no member's failure, kept by the framework, tells
another's value (round 8 of ``heldout/`` read the mutants' values out of unittest's
and pytest's failure records, then picked the original's by its bug).

**Recorded** (what the grader does wherever its witness runs): the expected values
never enter the test process. ``SETTLED`` hands the result, and the expression that
makes it plain, to the witness's recorder under the site's number, and the assertion
passes there. The witness makes the plain copy and asks whether the result equals it
while it watches the calls (a line the patch added that runs then decides nothing: the
result's own methods could tell that check from the test's own comparison, by identity
or by the order of calls; red-team round 12), and records the copy only as built-in
values, by their built-in ``repr`` (an element's own ``repr`` never writes a record); the grader, which alone holds each member's literals (`settled_values`),
decides the member from the records (`sandman.eval.canaries.Plan.recorded_outcomes`):
nothing in the process is left to read, or to try values on, and a record swallowed
fails its member. The planted text is then its stub but for the recorder (only the
shape of an expected list or tuple, its length and kinds, stays in the code).

**The stub.** Each member is also written as its *stub*: the same lines with every
expected literal of its equality assertions (in the assertion and in ``SETTLED``)
replaced by ``(...)``, line for line. The stub is what lies on disk while the tests
run (`sandman.eval.canaries`); the planted text reaches the test framework from the
grader's witness, in memory.

The helpers are the test's own locals (no other code can rebind a function's
locals before Python 3.13's write-through ``frame.f_locals``), bound at the top of its
body from literals alone (``"".__class__`` is ``str``: no name the code under test
could rebind) under names drawn for the run, with no closure (what they use is in
their defaults, whose replacement the witness reports); and nothing adds a constant
a value of the grid could equal (no digits: lengths are the literal's own). Literals
of more than `LEAVES` scalars are left as written.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from sandman.eval.decoys import pairs

__all__ = ["HELPERS", "LEAVES", "expect_nothing", "helpers", "settle", "settled_values"]

LEAVES = 32
"""The most scalars an expected literal may hold for its assertion to be rewritten."""
HELPERS = 3
"""How many names `helpers` may bind (drawn by the caller, fresh for the run): two
helpers, and the recorder where the values are recorded."""

_Edit = tuple[int, int, int, int, str]
"""A span of lines (line, byte column, end line, end byte column; 0-based) and its new
text (an insertion where the span is empty)."""
_MASK = "(...)"
"""What a stub shows in place of an expected literal."""

# Built-in types from literals alone (``()`` and ``""`` are never a grid value: a site
# changes a character of a non-empty literal, never its shape).
_KINDS = {
    str: '"".__class__',
    int: '"".__len__().__class__',
    float: '"".__len__().__float__().__class__',
}


def helpers(names: Sequence[str], recorder: str | None = None) -> str:
    """The statement binding the helpers to ``names`` (no indentation, no newline);
    with ``recorder`` (the witness's module name), the third name to its ``record``.

    *plain*: a value's own str, float or int storage, else the value converted to the
    kind it is given; *items*: a list's or tuple's own items as a plain list with its
    kind, else the object iterated. They hold no closure: what they use is in their
    own defaults, whose replacement the witness reports. The statement then reads
    *plain*'s code: the grader's witness hears it and checks that the framework runs
    this member now, on its thread, once, with no line of the patch's below (else the
    code under test could call a member itself, an oracle for the values it tries).
    (``isinstance`` through the built-in type's own check: an object whose
    ``__class__`` lies passes it, then fails the copy, which takes only the real
    thing.)"""
    s, f, n = _KINDS[str], _KINDS[float], _KINDS[int]
    bound = names[:3] if recorder else names[:2]
    record = f", __import__({recorder!r}).record" if recorder else ""
    return (
        f"{', '.join(bound)} = "
        f"(lambda v, k, s={s}, f={f}, n={n}: "
        "s.__add__(s(), v) if s.__instancecheck__(v) else f.__add__(f(), v) "
        "if f.__instancecheck__(v) else n.__add__(n(), v) if n.__instancecheck__(v) "
        "else k.__add__(k(), k(v))), "
        "(lambda v, k, l=[].__class__, u=().__class__: (l, l.__add__([], v)) "
        "if l.__instancecheck__(v) else (u, l(u.__add__((), v))) "
        "if u.__instancecheck__(v) else (k, l(v)))"
        f"{record}"
        # The member's start, told to the witness (a helper's code read, which its
        # audit hook hears): a member run by anything but the framework is named.
        f"; {names[0]}.__code__"
    )


def _plain(expected: object, value: str, names: Sequence[str], mask: str | None) -> str:
    """An expression making ``value`` plain by the shape of ``expected`` (``mask``: with
    the literal, where it is named, as ``(...)``, or ``"len"``: a string as long)."""
    plain, items = names[0], names[1]
    if not isinstance(expected, (list, tuple)):
        return f"{plain}({value}, {_KINDS[type(expected)]})"
    parts = [f"x{i}" for i in range(len(expected))]
    inner = ", ".join(_plain(e, p, names, mask) for e, p in zip(expected, parts, strict=True))
    kind = "[].__class__" if isinstance(expected, list) else "().__class__"
    shown = '"' + "_" * len(expected) + '"' if mask == "len" else _MASK if mask else repr(expected)
    # A length other than the literal's keeps the raw items, which a built-in
    # comparison then finds unequal without asking them.
    return (
        f"(lambda k, w: (lambda {', '.join(parts)}: k([{inner}]))(*w) "
        f"if w.__len__() == {shown}.__len__() else k(w))(*{items}({value}, {kind}))"
    )


def _leaves(value: object) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_leaves(v) for v in value)
    return 1


def settle(
    lines: list[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    names: Sequence[str],
    recorded: bool = False,
) -> tuple[list[str], list[str], bool]:
    """``lines`` with each varied equality assertion of ``node`` decided by plain
    values, using the helpers bound to ``names``; the same as its stub (every expected
    literal of an equality assertion replaced by ``(...)``); and whether any assertion
    was rewritten (then the body needs `helpers`).

    ``recorded``: the expected values stay out of the test process altogether. Each
    assertion hands its plain copy (and whether the result equals it) to the witness's
    recorder under the site's number (a string as long) and passes; the grader, which
    alone holds the literals (`settled_values`), decides the member. The planted text
    is then its stub but for the recorder.

    ``node`` is the test as parsed from the original lines; ``lines`` may carry other
    expected values at the same places (a grid's centre), which are the ones used.
    Line numbers stay, in both.
    """
    edits: list[_Edit] = []
    stub: list[_Edit] = []
    site = 0
    for other, expected, value in _sites(lines, node):
        start, end = (expected.lineno - 1, expected.col_offset), _end(expected)
        # The literal as written, over as many lines (inside parentheses).
        masked = f"({_MASK[1:-1]}" + "\n" * (end[0] - start[0]) + ")"
        if value is None:
            stub.append((*start, *end, masked))
            if recorded:
                edits.append((*start, *end, masked))
            continue
        site += 1
        for out, mask in ((edits, False), (stub, True)):
            literal = _MASK if mask else repr(value)
            if recorded:
                # The result and how to make it plain, to the witness: it makes the
                # plain copy and asks whether the result equals it, watching that no
                # line of the patch's decides either (a result's own methods can tell
                # that check from the test's own comparison), and records both for
                # the grader: the assertion passes here and is decided there
                # (`settled_values`).
                prefix = (
                    f"(lambda v: {names[2]}({'_' * site!r}, v, "
                    f"lambda v: {_plain(value, 'v', names, 'len')}))("
                )
            else:
                # ``p`` is the plain copy, made before ``v`` hears the literal: True
                # where both agree, else ``(p,)``, or a fresh ``object()`` where ``p``
                # agrees and ``v`` does not (an honest wrong 5). Never the literal.
                prefix = (
                    f"(lambda v: (lambda p: p == {literal} and v == {literal} "
                    f'or ((p,) if p != {literal} else "".__class__.__base__()))'
                    f"({_plain(value, 'v', names, '(...)' if mask else None)}))("
                )
            first = other.lineno - 1, other.col_offset
            out.append((*first, *first, prefix))
            out.append((*_end(other), *_end(other), ")"))
            if mask or recorded:
                out.append((*start, *end, f"(True, {masked})[False]"))
            else:
                out.append((*start, *start, "(True, "))
                out.append((*end, *end, ")[False]"))
    return (
        _edited(lines, edits),
        _edited(lines, stub),
        any(value is not None for _, _, value in _sites(lines, node)),
    )


def settled_values(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> tuple[object, ...]:
    """The expected value of each assertion `settle` rewrites, by site (the first is
    site 1): what a recorded member's plain copies must equal."""
    return tuple(value for _, _, value in _sites(lines, node) if value is not None)


def _sites(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> list[tuple[ast.expr, ast.expr, object | None]]:
    """Each equality assertion against a literal: (result, expected, its value), the
    value None where it is not settled (too large); literals that do not evaluate are
    left out."""
    found: list[tuple[ast.expr, ast.expr, object | None]] = []
    for other, expected in pairs(node):
        try:
            value = ast.literal_eval(_text(lines, expected))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        found.append((other, expected, value if _leaves(value) <= LEAVES else None))
    return found


def expect_nothing(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> list[str] | None:
    """``lines`` with every equality assertion of ``node`` expecting a fresh
    ``object()`` (its expected side still evaluated first), or None where it has none.

    The expected side is the right one (``assert got == expected``) or
    ``assertEqual``'s second argument. Every edit is inside a line.
    """
    edits: list[_Edit] = []
    for item in ast.walk(node):
        expected: ast.expr | None = None
        if isinstance(item, ast.Assert) and isinstance(item.test, ast.Compare):
            if len(item.test.ops) == 1 and isinstance(item.test.ops[0], ast.Eq):
                expected = item.test.comparators[0]
        elif (
            isinstance(item, ast.Call)
            and isinstance(item.func, ast.Attribute)
            and item.func.attr in ("assertEqual", "assertEquals")
            and len(item.args) >= 2
            and not any(isinstance(a, ast.Starred) for a in item.args[:2])
        ):
            expected = item.args[1]
        if expected is not None:
            first = expected.lineno - 1, expected.col_offset
            edits.append((*first, *first, "("))
            edits.append((*_end(expected), *_end(expected), ', "".__class__.__base__())[-1]'))
    if not edits:
        return None
    return _edited(lines, edits)


def _edited(lines: list[str], edits: list[_Edit]) -> list[str]:
    """``lines`` with each span (line, byte column, end line, end byte column) replaced
    by its text, right to left; a text holds as many line ends as its span, so every
    other line keeps its index."""
    out = lines[:]
    for line, column, last, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        raw = [out[i].encode("utf-8", errors="surrogateescape") for i in range(line, last + 1)]
        joined = raw[0][:column] + text.encode() + raw[-1][end:]
        pieces = joined.decode("utf-8", errors="surrogateescape").split("\n")
        new = [piece + "\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
        out[line : last + 1] = new
    return out


def _end(node: ast.expr) -> tuple[int, int]:
    return (node.end_lineno or node.lineno) - 1, (
        node.end_col_offset if node.end_col_offset is not None else node.col_offset
    )


def _text(lines: list[str], node: ast.expr) -> str:
    """The source of ``node`` in ``lines`` (byte columns, as ast counts)."""
    first, last = node.lineno - 1, _end(node)[0]
    raw = [line.encode("utf-8", errors="surrogateescape") for line in lines[first : last + 1]]
    end = _end(node)[1]
    if first == last:
        return raw[0][node.col_offset : end].decode("utf-8", errors="surrogateescape")
    middle = b"".join(raw[1:-1])
    return (raw[0][node.col_offset :] + middle + raw[-1][:end]).decode(
        "utf-8", errors="surrogateescape"
    )
