"""Determinism of evaluation: the shipped batch graded three times, once under a CPU burst.

Builds the shipped instances (``examples/eval/build.py``: a cached Debian
image with four small repositories, one a Django app), then grades every
shipped prediction (gold, wrong, non-applying, fuzzy, 3-way, hanging, OOM and
tampering patches, and the adversarial corpus ``adversarial.jsonl``: patches
that try to grade themselves) three times, each into a fresh output directory so nothing
is reused. During the second run a burst of other sandboxes (``--burst``,
each spinning its whole CPU share) competes for the machine. The verdicts of each run are
compared, as canonical JSON bytes, with the first run's. The last line is

    expected=<n>/<N> identical_runs=<k>/3

``n``: predictions whose verdict is, in every run, the status the prediction
was built to get (its ``expected`` field); ``N``: predictions; ``k``: runs
whose verdicts are byte-identical to run 1's (run 1 included).

Run as root: ``.venv/bin/python benchmarks/eval_determinism.py [--burst 6] [--timeout 60]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

from _eval_image import DEMO, EXAMPLES, build

import sandman
from sandman.client import AsyncClient
from sandman.eval import (
    Conditions,
    Report,
    Verdict,
    load_instances,
    load_predictions,
    report_path,
    run_batch,
)
from sandman.images import ImageStore

# The shipped batch, and the patches that try to grade themselves.
PREDICTIONS = ("predictions.jsonl", "adversarial.jsonl")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def burst(client: AsyncClient, stack: AsyncExitStack, image: str, size: int) -> None:
    """``size`` sandboxes, each with a process spinning one core, until ``stack`` closes."""

    async def one() -> None:
        sb = await stack.enter_async_context(client.sandbox(image, cpu=1, memory="256Mi"))
        await sb.spawn("while :; do :; done")

    await asyncio.gather(*(one() for _ in range(size)))


async def grade(
    client: AsyncClient, state_dir: Path, out: Path, conditions: Conditions, concurrency: int
) -> tuple[list[Verdict], float]:
    started = time.monotonic()
    result = await run_batch(
        load_instances(EXAMPLES / "instances.jsonl"),
        [p for name in PREDICTIONS for p in load_predictions(EXAMPLES / name)],
        client=client, out=out, conditions=conditions, concurrency=concurrency,
        images=ImageStore(state_dir / "images"),
    )  # fmt: skip
    ordered = sorted(result.verdicts, key=lambda v: (v.model, v.instance_id))
    return ordered, time.monotonic() - started


def median_test_seconds(out: Path, verdicts: list[Verdict]) -> float:
    """The median duration of the test runs that ran to the end: how slow the machine was."""
    durations = [
        Report.model_validate_json(report_path(out, v.model, v.instance_id).read_text()).durations[
            "tests"
        ]
        for v in verdicts
        if v.status in ("resolved", "unresolved")
    ]
    return statistics.median(durations)


async def main(args: argparse.Namespace) -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="sm-det-", dir="/tmp"))
    try:
        built = build(DEMO, state_dir)
        print(f"image {built['image']} {built['image_id'][:19]}")
        expected = {
            (p["model_name_or_path"], p["instance_id"]): p["expected"]
            for name in PREDICTIONS
            for p in map(json.loads, (EXAMPLES / name).read_text().splitlines())
        }
        conditions = Conditions(timeout=args.timeout, memory="1Gi")
        runs: list[list[Verdict]] = []
        async with sandman.local(state_dir=state_dir) as client:
            for number in (1, 2, 3):
                async with AsyncExitStack() as stack:
                    loaded = number == 2 and args.burst > 0
                    if loaded:
                        await burst(client, stack, built["image"], args.burst)
                    busy0, total0 = cpu_ticks()
                    verdicts, took = await grade(
                        client, state_dir, state_dir / f"run{number}", conditions, args.concurrency
                    )
                    busy1, total1 = cpu_ticks()
                runs.append(verdicts)
                statuses = dict(sorted(Counter(v.status for v in verdicts).items()))
                burst_note = f"{args.burst} spinning sandboxes" if loaded else "none"
                busy = 100 * (busy1 - busy0) / max(1, total1 - total0)
                median = median_test_seconds(state_dir / f"run{number}", verdicts)
                print(f"run {number}: {len(verdicts)} verdicts in {took:.1f} s, burst: "
                      f"{burst_note}, host CPU busy {busy:.0f}%, median test run "
                      f"{median:.2f} s, {statuses}")  # fmt: skip
        first = [v.canonical() for v in runs[0]]
        identical = 0
        for number, verdicts in enumerate(runs, start=1):
            if [v.canonical() for v in verdicts] == first:
                identical += 1
                continue
            for a, b in zip(runs[0], verdicts, strict=True):
                if a.canonical() != b.canonical():
                    print(f"run {number} differs on {b.model}/{b.instance_id}: "
                          f"{a.status} ({a.reason}) vs {b.status} ({b.reason})")  # fmt: skip
        good = sum(
            all(run[i].status == expected[run[i].model, run[i].instance_id] for run in runs)
            for i in range(len(runs[0]))
        )
        print(f"expected={good}/{len(expected)} identical_runs={identical}/3")
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=6, help="sandboxes spinning during run 2")
    parser.add_argument("--timeout", type=float, default=60.0, help="test run wall-clock limit")
    parser.add_argument("-j", "--concurrency", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
