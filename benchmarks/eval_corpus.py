"""The forgery corpus by class, the honest patches, and what the defences cost.

Builds the demo instances (``examples/eval/build.py``) and the honest corpus's
projects (``examples/eval/honest/build.py``), then:

1. grades every forging route, the ones the defence was built against
   (``adversarial.jsonl``, "own") and the ones written by red-teamers who
   never saw it (``heldout/*.jsonl``), and prints a table: class, count,
   own or held-out, caught (not ``resolved``);
2. grades the honest patches (``honest/predictions.jsonl`` and the demo's
   gold, wrong and fallback patches) and counts false positives: a verdict
   other than the one the patch was made to get, or one whose ``official``
   (SWE-bench's grading of the same log) differs from ``status``;
3. with ``--baseline REV``: the cost. The shipped gold patches graded by this
   tree and by ``REV`` (a ``git worktree``, the same daemon), alternating,
   ``--rounds`` times each; the median test-run time of each and their ratio.

Lines to read:

    corpus <class> own=<caught>/<n> held_out=<caught>/<n>
    caught own=<k>/<n> held_out=<k>/<n>
    honest false_positives=<k>/<n>
    timing median_tests now=<s> baseline=<s> ratio=<r>

Run as root: ``.venv/bin/python benchmarks/eval_corpus.py [--baseline 77ca40f --rounds 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from _eval_image import DEMO, EXAMPLES, HONEST, build

import sandman
from sandman.eval import Conditions, Report, load_instances, load_predictions, run_batch
from sandman.eval.batch import report_path
from sandman.images import ImageStore

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = Conditions(timeout=120, memory="1Gi")


def rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def corpus(state_dir: Path, out: Path) -> None:
    own = rows(EXAMPLES / "adversarial.jsonl")
    held = [row for path in sorted((EXAMPLES / "heldout").glob("*.jsonl")) for row in rows(path)]
    predictions = [
        p
        for path in [
            EXAMPLES / "adversarial.jsonl",
            *sorted((EXAMPLES / "heldout").glob("*.jsonl")),
        ]
        for p in load_predictions(path)
    ]
    async with sandman.local(state_dir=state_dir) as client:
        result = await run_batch(
            load_instances(EXAMPLES / "instances.jsonl"), predictions, client=client, out=out,
            conditions=CONDITIONS, concurrency=4, images=ImageStore(state_dir / "images"),
        )  # fmt: skip
    status = {v.model: v.status for v in result.verdicts}
    table: dict[str, dict[str, list[bool]]] = defaultdict(lambda: {"own": [], "held_out": []})
    for side, group in (("own", own), ("held_out", held)):
        for row in group:
            table[str(row["class"])][side].append(
                status[str(row["model_name_or_path"])] != "resolved"
            )
    for name in sorted(table):
        cells = " ".join(f"{side}={sum(v)}/{len(v)}" for side, v in table[name].items())
        print(f"corpus {name:<28} {cells}")
    for model, got in sorted(status.items()):
        if got == "resolved":
            print(f"  NOT CAUGHT: {model}")
    total = {side: [c for cls in table.values() for c in cls[side]] for side in ("own", "held_out")}
    print(" ".join(["caught", *(f"{side}={sum(v)}/{len(v)}" for side, v in total.items())]))


async def honest(state_dir: Path, honest_dir: Path, out: Path) -> None:
    demo = EXAMPLES / "instances.jsonl"
    projects = EXAMPLES / "honest" / "instances.jsonl"
    files = (EXAMPLES / "predictions.jsonl", EXAMPLES / "honest" / "predictions.jsonl")
    expected = {
        (str(r["model_name_or_path"]), str(r["instance_id"])): str(r["expected"])
        for path in files
        for r in rows(path)
    }
    graded = ("resolved", "unresolved", "patch_failed")  # not the hang and OOM patches
    wrong, total = [], 0
    for number, (state, instances) in enumerate(((state_dir, demo), (honest_dir, projects))):
        loaded = load_instances(instances)
        ids = {i.instance_id for i in loaded}
        chosen = [
            p
            for path in files
            for p in load_predictions(path)
            if p.instance_id in ids and expected[p.model_name_or_path, p.instance_id] in graded
        ]
        async with sandman.local(state_dir=state) as client:
            result = await run_batch(
                loaded, chosen, client=client, out=out / str(number), conditions=CONDITIONS,
                concurrency=4, images=ImageStore(state / "images"),
            )  # fmt: skip
        for v in result.verdicts:
            total += 1
            want = expected[v.model, v.instance_id]
            if v.status != want or v.official not in (v.status, None):
                wrong.append(
                    f"{v.model}/{v.instance_id}: {v.status} (official {v.official}, "
                    f"expected {want}): {v.reason}"
                )
    for line in wrong:
        print(f"  FALSE POSITIVE: {line}")
    print(f"honest false_positives={len(wrong)}/{total}")


def baseline_tree(rev: str, into: Path) -> Path:
    """A worktree of ``rev`` beside this one, with this tree's daemon binary."""
    tree = into / "baseline"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True
    )
    daemon = ROOT / "src" / "sandman" / "_bin" / "sandmand"
    (tree / "src" / "sandman" / "_bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(daemon, tree / "src" / "sandman" / "_bin" / "sandmand")
    return tree


def grade_gold(src: Path, state_dir: Path, out: Path) -> list[float]:
    """The gold patches graded by the package in ``src``; each test run's seconds."""
    gold = out.parent / "gold.jsonl"
    gold.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in rows(EXAMPLES / "predictions.jsonl")
            if r["model_name_or_path"] == "gold"
        )
    )
    code = "import sys; sys.argv[0] = 'sandman'; from sandman.cli import main; main()"
    subprocess.run(
        [sys.executable, "-c", code, "--state-dir", str(state_dir), "eval",
         str(src / "examples" / "eval" / "instances.jsonl"), str(gold), "--out", str(out),
         "--memory", "1Gi", "--timeout", "120", "-j", "1"],
        env={**os.environ, "PYTHONPATH": str(src / "src")},
        check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    return [
        Report.model_validate_json(
            report_path(out, "gold", str(r["instance_id"])).read_text()
        ).durations["tests"]
        for r in rows(gold)
    ]


def timing(rev: str, rounds: int, state_dir: Path, work: Path) -> None:
    tree = baseline_tree(rev, work)
    try:
        now: list[float] = []
        then: list[float] = []
        for number in range(rounds):
            # Interleaved: the machine's drift falls on both alike.
            now += grade_gold(ROOT, state_dir, work / f"now{number}")
            then += grade_gold(tree, state_dir, work / f"then{number}")
        a, b = statistics.median(now), statistics.median(then)
        print(f"timing median_tests now={a:.3f}s baseline={b:.3f}s ratio={a / b:.2f} "
              f"(gold patches, {rounds} interleaved rounds, {len(now)} runs each)")  # fmt: skip
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
        )


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="sm-corpus-", dir="/tmp"))
    try:
        demo, projects = work / "demo", work / "honest"
        build(DEMO, demo)
        build(HONEST, projects)
        if not args.timing_only:
            await corpus(demo, work / "corpus")
            await honest(demo, projects, work / "honest-out")
        if args.baseline:
            timing(args.baseline, args.rounds, demo, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a revision to compare the grading time with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timing-only", action="store_true")
    asyncio.run(main(parser.parse_args()))
