"""``sandman eval``: grade predictions against SWE-bench-style instances in fresh sandboxes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import click
from click._termui_impl import ProgressBar
from pydantic import ValidationError

from sandman import errors
from sandman.cli._common import client_options, fail, local_config, open_client, run_async
from sandman.eval import (
    DEFAULT_ENV,
    BatchResult,
    Conditions,
    Verdict,
    load_instances,
    load_predictions,
    run_batch,
)
from sandman.images import ImageStore


def _show(item: str | None) -> str | None:
    return item


_COLOURS = {"resolved": "green", "unresolved": "yellow", "error": "red"}


def _conditions(
    cpu: float,
    memory: str,
    pids: int,
    network: str,
    timeout: float,
    env: tuple[str, ...],
    audit: Literal["record", "strict"] = "strict",
) -> Conditions:
    variables = dict(DEFAULT_ENV)
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        variables[key] = value
    try:
        return Conditions(
            cpu=cpu,
            memory=memory,
            pids=pids,
            network=network,
            timeout=timeout,
            env=variables,
            audit=audit,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors())
        raise click.BadParameter(problems) from exc


@click.command("eval")
@click.argument("instances", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("predictions", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default="eval-out",
    show_default=True,
    help="Reports and summaries; a re-run here resumes.",
)
@click.option("-j", "--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--model", "models", multiple=True, help="Only these models' predictions.")
@click.option("--cpu", type=float, default=1.0, show_default=True, help="Cores per sandbox.")
@click.option("--memory", default="2Gi", show_default=True, help="Memory per sandbox.")
@click.option("--pids", type=int, default=1024, show_default=True)
@click.option(
    "--network",
    type=click.Choice(["none", "isolated", "egress"]),
    default="none",
    show_default=True,
)
@click.option(
    "--timeout",
    type=float,
    default=1800.0,
    show_default=True,
    help="Wall-clock seconds the test run may take.",
)
@click.option("--env", multiple=True, metavar="KEY=VALUE", help="Set a variable (repeatable).")
@click.option(
    "--audit",
    type=click.Choice(["strict", "record"]),
    default="strict",
    show_default=True,
    help="strict: a run that did what a forging patch does is unresolved; record: only list it.",
)
@click.option(
    "--retry-errors",
    is_flag=True,
    help="Grade again what a past run here left as error or sandbox_died (never a verdict on "
    "the patch: resolved, unresolved, patch_failed, timeout, oom).",
)
@client_options
@click.pass_context
def eval_command(
    ctx: click.Context,
    instances: Path,
    predictions: Path,
    out: Path,
    concurrency: int,
    models: tuple[str, ...],
    cpu: float,
    memory: str,
    pids: int,
    network: str,
    timeout: float,
    env: tuple[str, ...],
    audit: Literal["record", "strict"],
    retry_errors: bool,
    url: str | None,
    api_key: str | None,
) -> None:
    """Grade PREDICTIONS (SWE-bench JSON/JSONL) against INSTANCES, each in a fresh sandbox.

    INSTANCES: SWE-bench dataset rows as published (JSONL, a JSON list, or the
    dataset's parquet with pyarrow installed); the image, test command and log
    parser follow from each row's repo and version unless the row names them.

    Writes OUT/<model>/<instance>/report.json, OUT/summary.json and
    OUT/summary.html. A re-run with the same OUT skips what was already
    graded from the same inputs (with --retry-errors, except infrastructure
    errors).
    """
    conditions = _conditions(cpu, memory, pids, network, timeout, env, audit)
    try:
        loaded = load_instances(instances)
        wanted = [
            p for p in load_predictions(predictions) if not models or p.model_name_or_path in models
        ]
    except errors.SandboxError as exc:
        fail(exc, ctx.obj["debug"])
    images = None if url else ImageStore(local_config(ctx).state_dir / "images")

    bar: ProgressBar[str | None]
    with click.progressbar(
        length=len(wanted),
        label="evaluating",
        file=sys.stderr,
        item_show_func=_show,
    ) as bar:

        def tick(verdict: Verdict, reused: bool) -> None:
            bar.update(1, f"{verdict.model}/{verdict.instance_id}: {verdict.status}")

        async def go() -> BatchResult:
            async with open_client(ctx, url, api_key) as client:
                return await run_batch(
                    loaded,
                    wanted,
                    client=client,
                    out=out,
                    conditions=conditions,
                    concurrency=concurrency,
                    images=images,
                    progress=tick,
                    retry_errors=retry_errors,
                )

        result = run_async(ctx, go())

    summary = result.summary
    for item in summary.items:
        status = click.style(f"{item.status:<13}", fg=_COLOURS[item.category])
        click.echo(f"{status} {item.model}/{item.instance_id}  {item.reason}")
    counts = " · ".join(
        click.style(f"{c} {getattr(summary, c)}", fg=colour) for c, colour in _COLOURS.items()
    )
    click.echo(f"{summary.total} evaluated ({result.reused} reused from {out}): {counts}")
    click.echo(f"summary: {out / 'summary.json'}  {out / 'summary.html'}")


COMMANDS: list[click.Command] = [eval_command]
