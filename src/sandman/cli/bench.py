"""``sandman bench``: run the benchmarks of a source checkout, with progress bars.

The benchmarks live in the repository's ``benchmarks/`` (they are not part of
the installed package). Each runs as its own process; one that writes
``progress DONE TOTAL`` lines to stderr (``SANDMAN_BENCH_PROGRESS=1`` asks for
them) gets a bar that fills, the others a spinner and a clock. Their output
is printed as each one finishes; the last line of each is its summary.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import click

from sandman import errors
from sandman.cli._common import run_async

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

BENCHMARKS: dict[str, str] = {
    "latency": "latency.py",
    "burst": "burst.py",
    "density": "density.py",
    "service-overhead": "service_overhead.py",
    "expose": "expose.py",
    "handover": "handover.py",
    "runtimes": "runtimes.py",
    "snapshot": "snapshot.py",
    "images": "images.py",
    "dashboard": "dashboard.py",
    "tracing": "tracing.py",
    "run-code": "run_code.py",
    "eval-determinism": "eval_determinism.py",
    "eval-corpus": "eval_corpus.py",
    "chaos": "chaos.py",
    "k8s-burst": "k8s_burst.py",
    "k8s-scale": "k8s_scale.py",
    "agent-sandbox": "peers/agent_sandbox.py",
}
"""Names ``sandman bench`` knows and their scripts in ``benchmarks/``."""
DEFAULT = ("latency", "burst")


def find_checkout(explicit: Path | None) -> Path:
    """The source checkout whose ``benchmarks/`` to run: ``explicit``, else the first
    directory holding ``benchmarks/burst.py`` above the working directory or the package."""
    if explicit is not None:
        candidates = [explicit]
    else:
        here = Path.cwd().resolve()
        candidates = [here, *here.parents, *Path(__file__).resolve().parents]
    for directory in candidates:
        if (directory / "benchmarks" / "burst.py").is_file():
            return directory
    where = explicit or Path.cwd()
    raise errors.ConfigError(
        f"no benchmarks/ found at or above {where}: `sandman bench` runs the benchmarks of a "
        "source checkout (git clone the repository, run it there or pass --checkout DIR)"
    )


class _Run:
    """One benchmark's process, its output, and its bar."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.stdout: list[str] = []
        self.stderr: deque[str] = deque(maxlen=20)
        self.returncode: int | None = None
        self.total = 0  # from its progress lines; 0 if it sends none


async def _run_one(run: _Run, cwd: Path, progress: Progress, task: TaskID) -> None:
    process = await asyncio.create_subprocess_exec(
        *run.argv,
        cwd=cwd,
        env={**os.environ, "SANDMAN_BENCH_PROGRESS": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None

    async def out() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            run.stdout.append(raw.decode(errors="replace").rstrip("\n"))

    async def err() -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            word, _, rest = line.partition(" ")
            numbers = rest.split()
            if word == "progress" and len(numbers) == 2 and all(n.isdigit() for n in numbers):
                run.total = int(numbers[1])
                progress.update(task, completed=int(numbers[0]), total=run.total)
            else:
                run.stderr.append(line)

    try:
        await asyncio.gather(out(), err())
        run.returncode = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _run_all(runs: list[_Run], checkout: Path) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    failed = 0
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ) as progress:
        overall = progress.add_task("benchmarks", total=len(runs))
        for run in runs:
            # One at a time: they measure the machine, so they must not share it.
            task = progress.add_task(run.name, total=None)
            await _run_one(run, checkout, progress, task)
            progress.update(task, total=run.total or 1, completed=run.total or 1)
            script = Path(run.argv[1]).name
            progress.console.rule(f"{run.name}: {shlex.join([script, *run.argv[2:]])}")
            for line in run.stdout:
                progress.console.print(line, markup=False, highlight=False)
            if run.returncode != 0:
                failed += 1
                progress.console.print(f"{run.name} failed (exit {run.returncode}):", style="red")
                for line in run.stderr:
                    progress.console.print(line, markup=False, highlight=False)
            progress.advance(overall)
    return failed


@click.command()
@click.argument("names", nargs=-1, type=click.Choice(list(BENCHMARKS)))
@click.option(
    "--checkout",
    type=click.Path(file_okay=False, path_type=Path),
    help="The source checkout (default: found above the working directory).",
)
@click.option(
    "--args",
    "extra",
    multiple=True,
    metavar="NAME=ARGS",
    help="Arguments for one benchmark, e.g. --args 'burst=--requests 500 --serve'.",
)
@click.pass_context
def bench(
    ctx: click.Context, names: tuple[str, ...], checkout: Path | None, extra: tuple[str, ...]
) -> None:
    """Run benchmarks of the source checkout (default: latency, burst) with progress bars.

    Available: latency, burst, density, service-overhead, expose, handover, runtimes,
    eval-determinism, chaos; on a cluster (give them --kubeconfig through --args, or
    set KUBECONFIG): k8s-burst, k8s-scale, agent-sandbox. Most need root (the local
    provider). Each one's summary is its last line.
    """
    arguments: dict[str, list[str]] = {}
    for item in extra:
        name, sep, args = item.partition("=")
        if not sep or name not in BENCHMARKS:
            raise click.BadParameter(
                f"{item!r}: use NAME=ARGS with a known NAME", param_hint="--args"
            )
        arguments[name] = shlex.split(args)

    async def go() -> int:
        root = find_checkout(checkout)
        runs = [
            _Run(
                name,
                [
                    sys.executable,
                    str(root / "benchmarks" / BENCHMARKS[name]),
                    *arguments.get(name, []),
                ],
            )
            for name in names or DEFAULT
        ]
        return await _run_all(runs, root)

    failed = run_async(ctx, go())
    if failed:
        click.echo(f"error: {failed} benchmark(s) failed", err=True)
        sys.exit(1)


COMMANDS: list[click.Command] = [bench]
