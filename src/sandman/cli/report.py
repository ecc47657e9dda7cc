"""``sandman report FILE``: where a run's time went and what it used, from its events.

The events are what `sandman.EventLog` wrote (``sandman.local(hook=EventLog(path))``,
``sandman serve --events PATH``): each sandbox's timeline when it is gone
(``delete.complete``), what it used (``sandbox.usage``), the failures and the losses.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import click

from sandman import errors

__all__ = ["COMMANDS", "summarize"]

PHASES = (
    ("queue wait", "queued", "create_called"),
    ("create", "create_called", "accepted"),
    ("ready", "create_called", "daemon_ready"),
    ("to the caller", "daemon_ready", "handed_out"),
    ("held", "handed_out", "released"),
    ("delete", "released", "gone"),
)
"""(what, from, to) over each sandbox's timeline (`sandman.pool.records.TimelineEvent`)."""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(lines: list[str]) -> dict[str, Any]:
    """The summary of a run's events (JSON lines), as `sandman report --json` prints it."""
    phases: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    usage: dict[str, float] = {}
    failed: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    images: Counter[str] = Counter()
    gone = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            name, detail = event["name"], event.get("detail") or {}
        except (ValueError, KeyError, TypeError):
            raise errors.ConfigError(f"line {number} is not an event of sandman.EventLog") from None
        if name == "delete.complete":
            gone += 1
            images[str(detail.get("image", "?"))] += 1
            timeline = detail.get("timeline") or {}
            for phase, start, end in PHASES:
                if start in timeline and end in timeline:
                    phases[phase].append(max(0.0, timeline[end] - timeline[start]))
        elif name == "sandbox.usage":
            for key in ("cpu_seconds", "disk_bytes", "net_rx_bytes", "net_tx_bytes"):
                if isinstance(detail.get(key), int | float):
                    usage[key] = usage.get(key, 0.0) + detail[key]
            if isinstance(detail.get("memory_peak_bytes"), int):
                usage["memory_peak_bytes_max"] = max(
                    usage.get("memory_peak_bytes_max", 0.0), detail["memory_peak_bytes"]
                )
        elif name == "create.failed":
            failed[str(detail.get("cause") or detail.get("kind") or "unknown")] += 1
        elif name == "sandbox.lost":
            lost[str(detail.get("reason", "unknown"))] += 1
    return {
        "sandboxes": gone,
        "images": dict(images.most_common()),
        "phases": {
            name: {
                "count": len(values),
                "p50": _quantile(values, 0.5),
                "p95": _quantile(values, 0.95),
                "max": max(values),
                "total": sum(values),
            }
            for name, values in phases.items()
            if values
        },
        "usage": dict(usage),
        "create_failures": dict(failed),
        "lost": dict(lost),
    }


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


@click.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
def report(path: Path, as_json: bool) -> None:
    """Where a run's time went and what it used, from the events sandman.EventLog wrote."""
    summary = summarize(path.read_text(encoding="utf-8", errors="replace").splitlines())
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    if not summary["sandboxes"]:
        click.echo(f"no sandbox was deleted in {path}: nothing to report")
        return
    click.echo(f"{summary['sandboxes']} sandboxes ({len(summary['images'])} images)")
    click.echo(f"{'phase':<14} {'count':>6} {'p50':>9} {'p95':>9} {'max':>9} {'total':>9}")
    for name, p in summary["phases"].items():
        click.echo(
            f"{name:<14} {p['count']:>6} {_seconds(p['p50']):>9} {_seconds(p['p95']):>9} "
            f"{_seconds(p['max']):>9} {_seconds(p['total']):>9}"
        )
    used = summary["usage"]
    if used:
        mib = 2**20
        click.echo(
            f"used: {used.get('cpu_seconds', 0):.1f} CPU s, "
            f"disk {used.get('disk_bytes', 0) / mib:.1f} MiB, "
            f"network in {used.get('net_rx_bytes', 0) / mib:.1f} MiB "
            f"out {used.get('net_tx_bytes', 0) / mib:.1f} MiB, "
            f"largest peak memory {used.get('memory_peak_bytes_max', 0) / mib:.1f} MiB"
        )
    for title, key in (("create failures", "create_failures"), ("lost", "lost")):
        if summary[key]:
            parts = ", ".join(f"{k}: {n}" for k, n in summary[key].items())
            click.echo(f"{title}: {parts}")


COMMANDS: list[click.Command] = [report]
