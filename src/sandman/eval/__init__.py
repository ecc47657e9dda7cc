"""Evaluation under controlled conditions, SWE-bench style.

``await evaluate(instance, patch, client=client)`` grades one patch in a fresh
sandbox and returns a `Verdict`; `run_batch` grades many, resumably, writing
reports and summaries. Instances and predictions load from SWE-bench JSON or
JSONL (`load_instances`, `load_predictions`).
"""

from sandman.eval.batch import BatchResult, Summary, SummaryItem, report_path, run_batch
from sandman.eval.conditions import DEFAULT_ENV, Conditions
from sandman.eval.harness import DEFAULT_PROTECTED, evaluate, evaluate_report, pin_image
from sandman.eval.instances import Instance, Prediction, load_instances, load_predictions
from sandman.eval.parsers import PARSERS, TestStatus, parse_log
from sandman.eval.verdict import (
    INFRA_ERRORS,
    ApplyAttempt,
    Report,
    Status,
    Verdict,
    category,
    inputs_hash,
)

__all__ = [
    "DEFAULT_ENV",
    "DEFAULT_PROTECTED",
    "INFRA_ERRORS",
    "PARSERS",
    "ApplyAttempt",
    "BatchResult",
    "Conditions",
    "Instance",
    "Prediction",
    "Report",
    "Status",
    "Summary",
    "SummaryItem",
    "TestStatus",
    "Verdict",
    "category",
    "evaluate",
    "evaluate_report",
    "inputs_hash",
    "load_instances",
    "load_predictions",
    "parse_log",
    "pin_image",
    "report_path",
    "run_batch",
]
