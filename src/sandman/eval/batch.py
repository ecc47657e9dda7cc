"""Batch runs: many predictions, a bounded number at a time, resumable, with reports on disk.

Layout of the output directory::

    <out>/<model>/<instance_id>/report.json   one per evaluation (a `Report`)
    <out>/summary.json                        counts and every verdict's status and reason
    <out>/summary.html                        the same for a person to look at

A re-run with the same output directory skips each prediction whose
``report.json`` was graded from the same inputs (its ``inputs_hash``:
instance, patch, conditions, image digest and harness version), unless
``retry_errors`` is set and its status is an infrastructure error
(`INFRA_ERRORS`: ``error``, ``sandbox_died``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from sandman import errors
from sandman.client import AsyncClient
from sandman.eval.conditions import Conditions
from sandman.eval.harness import evaluate_report, pin_image
from sandman.eval.html import render_summary
from sandman.eval.instances import Instance, Prediction
from sandman.eval.verdict import INFRA_ERRORS, Category, Report, Status, Verdict, inputs_hash
from sandman.images import ImageStore

__all__ = ["BatchResult", "Summary", "SummaryItem", "report_path", "run_batch"]

Progress = Callable[[Verdict, bool], None]
"""Called once per prediction as it is graded: the verdict, and whether it was reused."""


class SummaryItem(BaseModel):
    """One line of the summary."""

    model_config = ConfigDict(frozen=True)

    model: str
    instance_id: str
    status: Status
    category: Category
    reason: str
    report: str
    """The report's path, relative to the output directory."""


class Summary(BaseModel):
    """What ``summary.json`` holds: counts by category and by status, and every item."""

    model_config = ConfigDict(frozen=True)

    total: int
    resolved: int
    unresolved: int
    error: int
    by_status: dict[str, int]
    conditions: Conditions
    items: list[SummaryItem]


class BatchResult(BaseModel):
    """A finished batch: the summary, every verdict, and how many were reused from a past run."""

    model_config = ConfigDict(frozen=True)

    summary: Summary
    verdicts: list[Verdict]
    reused: int
    out: Path


def _safe(name: str) -> str:
    """A path component from a model or instance name (``org/model`` -> ``org_model``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".")
    return cleaned or "_"


def report_path(out: Path, model: str, instance_id: str) -> Path:
    """Where the report of ``model``'s prediction for ``instance_id`` is written."""
    return Path(out) / _safe(model) / _safe(instance_id) / "report.json"


def _write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(data)
    partial.replace(path)


def _previous(path: Path, wanted: str, retry_errors: bool) -> Verdict | None:
    """The verdict already on disk for these exact inputs, if any (and not to be retried)."""
    try:
        verdict = Report.model_validate_json(path.read_text()).verdict
    except (OSError, ValidationError):
        return None
    if verdict.inputs_hash != wanted or (retry_errors and verdict.status in INFRA_ERRORS):
        return None
    return verdict


def _pairs(
    instances: Sequence[Instance], predictions: Sequence[Prediction]
) -> list[tuple[Instance, Prediction]]:
    by_id = {instance.instance_id: instance for instance in instances}
    unknown = sorted({p.instance_id for p in predictions} - set(by_id))
    if unknown:
        raise errors.ConfigError(
            f"predictions for unknown instances: {', '.join(unknown[:5])}"
            + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        )
    seen: set[tuple[str, str]] = set()
    for prediction in predictions:
        key = (prediction.model_name_or_path, prediction.instance_id)
        if key in seen:
            raise errors.ConfigError(f"two predictions of model {key[0]!r} for instance {key[1]!r}")
        seen.add(key)
    return [(by_id[p.instance_id], p) for p in predictions]


async def run_batch(
    instances: Sequence[Instance],
    predictions: Sequence[Prediction],
    *,
    client: AsyncClient,
    out: str | Path,
    conditions: Conditions | None = None,
    concurrency: int = 4,
    images: ImageStore | None = None,
    progress: Progress | None = None,
    acquire_timeout: float = 600.0,
    retry_errors: bool = False,
) -> BatchResult:
    """Grade every prediction against its instance, ``concurrency`` at a time, in fresh sandboxes.

    Writes a report per prediction and the summaries under ``out`` (see the
    module's docstring); reuses reports graded from identical inputs. Raises
    `ConfigError` for a prediction of an unknown instance or a duplicate.
    ``images`` is the local `ImageStore` (pins each image to its id), or None.
    With ``retry_errors``, a stored verdict whose status is in `INFRA_ERRORS`
    (the harness or the backend failed, not the patch) is graded again.
    """
    if concurrency < 1:
        raise errors.ConfigError(f"concurrency must be at least 1, not {concurrency}")
    store = images
    conditions = conditions or Conditions()
    out = Path(out)
    pairs = _pairs(instances, predictions)
    digests: dict[str, str | None] = {}
    for instance, _ in pairs:
        if instance.image not in digests:
            try:
                digests[instance.image] = (await pin_image(instance.image, store))[1]
            except errors.ImageError:
                digests[instance.image] = None  # each evaluation reports it
    gate = asyncio.Semaphore(concurrency)
    reused = 0

    async def one(instance: Instance, prediction: Prediction) -> Verdict:
        nonlocal reused
        path = report_path(out, prediction.model_name_or_path, instance.instance_id)
        wanted = inputs_hash(instance, prediction.patch, conditions, digests[instance.image])
        verdict = await asyncio.to_thread(_previous, path, wanted, retry_errors)
        if verdict is not None:
            reused += 1
            if progress is not None:
                progress(verdict, True)
            return verdict
        async with gate:
            report = await evaluate_report(
                instance,
                prediction.patch,
                client=client,
                conditions=conditions,
                images=store,
                model=prediction.model_name_or_path,
                acquire_timeout=acquire_timeout,
            )
        await asyncio.to_thread(_write_atomic, path, report.model_dump_json(indent=2))
        if progress is not None:
            progress(report.verdict, False)
        return report.verdict

    verdicts = list(await asyncio.gather(*(one(i, p) for i, p in pairs)))
    summary = summarize(verdicts, conditions, out)
    await asyncio.to_thread(_write_summaries, out, summary)
    return BatchResult(summary=summary, verdicts=verdicts, reused=reused, out=out)


def summarize(verdicts: Sequence[Verdict], conditions: Conditions, out: Path) -> Summary:
    """Counts and items, sorted by model then instance (so equal runs give equal summaries)."""
    ordered = sorted(verdicts, key=lambda v: (v.model, v.instance_id))
    categories = Counter(v.category for v in ordered)
    items = [
        SummaryItem(
            model=v.model,
            instance_id=v.instance_id,
            status=v.status,
            category=v.category,
            reason=v.reason,
            report=str(report_path(out, v.model, v.instance_id).relative_to(out)),
        )
        for v in ordered
    ]
    return Summary(
        total=len(ordered),
        resolved=categories["resolved"],
        unresolved=categories["unresolved"],
        error=categories["error"],
        by_status=dict(sorted(Counter(v.status for v in ordered).items())),
        conditions=conditions,
        items=items,
    )


def _write_summaries(out: Path, summary: Summary) -> None:
    _write_atomic(out / "summary.json", json.dumps(summary.model_dump(mode="json"), indent=2))
    _write_atomic(out / "summary.html", render_summary(summary.model_dump(mode="json")))
