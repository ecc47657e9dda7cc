"""``sandman report``: a real run's events, written by `sandman.EventLog`, summarized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import sandman
from sandman.cli import build
from sandman.providers.local import LocalProvider
from tests.providers.local.conftest import needs_root_and_crun


@needs_root_and_crun
@pytest.mark.anyio
async def test_a_run_is_summarized_from_its_events(
    local_state: Path, imported: LocalProvider, tmp_path: Path
) -> None:
    events = tmp_path / "run.jsonl"
    with sandman.EventLog(events) as log:
        async with sandman.local(state_dir=local_state, hook=log) as client:
            for _ in range(2):
                async with client.sandbox("busybox") as sb:
                    await sb.exec(["sh", "-c", "i=0; while [ $i -lt 50000 ]; do i=$((i+1)); done"])
    assert events.read_text().count('"delete.complete"') == 2
    text = CliRunner().invoke(build(), ["report", str(events)])
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0] == "2 sandboxes (1 images)"
    assert lines[1].split() == ["phase", "count", "p50", "p95", "max", "total"]
    shown = {line.split()[0] for line in lines[2:8]}
    assert {"queue", "create", "ready", "held", "delete"} <= shown
    assert any(line.startswith("used: ") and "CPU s" in line for line in lines)
    summary = json.loads(CliRunner().invoke(build(), ["report", "--json", str(events)]).output)
    assert summary["sandboxes"] == 2 and summary["phases"]["ready"]["count"] == 2
    assert summary["usage"]["cpu_seconds"] > 0


def test_a_file_of_something_else_is_one_clear_line(tmp_path: Path) -> None:
    wrong = tmp_path / "notes.txt"
    wrong.write_text("hello\n")
    result = CliRunner().invoke(build(), ["report", str(wrong)])
    assert result.exit_code == 1
    assert "line 1 is not an event of sandman.EventLog" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nothing = CliRunner().invoke(build(), ["report", str(empty)])
    assert nothing.exit_code == 0 and "nothing to report" in nothing.output
