"""``summary.html``: a batch's summary as one self-contained page."""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["render_summary"]

_COLOURS = {"resolved": "#1a7f37", "unresolved": "#9a6700", "error": "#cf222e"}


def render_summary(summary: dict[str, Any]) -> str:
    """The page for a summary (as ``Summary.model_dump(mode="json")`` gives it)."""
    total = summary["total"] or 1
    bar = "".join(
        f'<div style="width:{100 * summary[c] / total:.2f}%;background:{colour}" '
        f'title="{c}: {summary[c]}"></div>'
        for c, colour in _COLOURS.items()
        if summary[c]
    )
    counts = " · ".join(
        f'<b style="color:{colour}">{c} {summary[c]}</b>' for c, colour in _COLOURS.items()
    )
    statuses = ", ".join(f"{escape(s)} {n}" for s, n in summary["by_status"].items())
    conditions = escape(", ".join(f"{k}={v}" for k, v in summary["conditions"].items()))
    rows = "\n".join(
        f"<tr><td>{escape(item['model'])}</td><td>{escape(item['instance_id'])}</td>"
        f'<td style="color:{_COLOURS[item["category"]]}"><b>{escape(item["status"])}</b></td>'
        f"<td>{escape(item['reason'])}</td>"
        f'<td><a href="{escape(item["report"])}">report</a></td></tr>'
        for item in summary["items"]
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sandman eval: {summary["total"]} evaluations</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; }}
.bar {{ display: flex; height: 1.2em; width: 40em; border: 1px solid #ccc; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: left; }}
</style></head><body>
<h1>sandman eval</h1>
<p>{summary["total"]} evaluations: {counts}</p>
<div class="bar">{bar}</div>
<p>by status: {statuses}</p>
<p>conditions: <code>{conditions}</code></p>
<table><tr><th>model</th><th>instance</th><th>status</th><th>reason</th><th></th></tr>
{rows}
</table></body></html>
"""
