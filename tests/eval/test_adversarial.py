"""The adversarial corpus (examples/eval/adversarial.jsonl): every patch graded as it deserves.

Each leaves its instance's bug in place and tries to make the grade say
otherwise: none may be ``resolved``, and the audit lists what each did.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from sandman.client import AsyncClient
from sandman.eval import harness, load_instances, load_predictions, run_batch
from sandman.eval.evidence import read_witness
from sandman.images import ImageStore
from tests.eval.conftest import CONDITIONS, EXAMPLES, Demo
from tests.providers.local.conftest import needs_root_and_crun


def _corpus() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adversarial", EXAMPLES / "adversarial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_corpus_is_what_its_script_writes() -> None:
    assert (EXAMPLES / "adversarial.jsonl").read_text() == _corpus().render()


def test_a_record_that_does_not_verify_is_counted_as_forged() -> None:
    import hashlib
    import hmac

    key = b"k" * 32
    body = '{"kind":"start","seq":0}'
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    good = f"SANDMAN-WITNESS {body} {mac}"
    assert read_witness(good, key).started
    forged = read_witness(good.replace("start", "strat"), key)
    assert not forged.started and forged.forged == 1
    # A valid record replayed (or from another key) breaks the chain.
    assert read_witness(f"{good}\n{good}", key).forged == 1
    assert read_witness(good, b"x" * 32).forged == 1


@needs_root_and_crun
@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)  # the first run on a machine builds the image
async def test_every_forging_patch_is_graded_as_it_deserves(
    demo: Demo, client: AsyncClient, tmp_path: Path
) -> None:
    rows = [json.loads(line) for line in (EXAMPLES / "adversarial.jsonl").read_text().splitlines()]
    result = await run_batch(
        load_instances(demo.instances), load_predictions(EXAMPLES / "adversarial.jsonl"),
        client=client, out=tmp_path, conditions=CONDITIONS, concurrency=4,
        images=ImageStore(demo.state_dir / "images"),
    )  # fmt: skip
    got = {v.model: v for v in result.verdicts}
    assert {m: v.status for m, v in got.items()} == {
        r["model_name_or_path"]: r["expected"] for r in rows
    }, {m: v.reason for m, v in got.items()}
    assert {m: bool(v.suspicious) for m, v in got.items()} == {
        r["model_name_or_path"]: r["flagged"] for r in rows
    }, {m: v.suspicious for m, v in got.items()}
    assert not any(v.resolved for v in got.values())
    # The routes that beat the grader once: each claimed a pass for the F2P test
    # under the name this run gave it, and none counted.
    for model in ("adversarial-mark-and-exit", "adversarial-mark-and-carry-on"):
        report = json.loads((tmp_path / model / "calc-1" / "report.json").read_text())
        token = next(t for t, name in report["renamed"].items() if name == "test_median_even")
        assert f"PASSED tests/test_stats.py::{token}" in report["test_output"]
        assert "test_median_even" not in report["test_output"]
    assert got["adversarial-nonce-unittest"].fail_to_pass != {
        "test_punctuation_collapses (tests.test_slug.SlugifyTest)": "PASSED"
    }


HELD_OUT = sorted((EXAMPLES / "heldout").glob("*.jsonl"))


def test_the_held_out_corpora_cover_their_classes() -> None:
    rows = [json.loads(line) for path in HELD_OUT for line in path.read_text().splitlines()]
    assert len(rows) >= 100
    assert len({row["class"] for row in rows}) >= 8
    assert all(not row.get("known_gap") or row.get("round", 1) > 1 for row in rows)
    own = [json.loads(line) for line in (EXAMPLES / "adversarial.jsonl").read_text().splitlines()]
    assert {row["class"] for row in own} <= {row["class"] for row in rows}


@needs_root_and_crun
@pytest.mark.anyio
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1800)
async def test_no_held_out_route_is_resolved(
    demo: Demo, client: AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routes written by people who never saw the defence: none may grade itself resolved.

    The planting's draws are fixed here, so each run grades the same way: a route
    that gambles on the order (heldout-f-10, -11) gets through one grade in 120, one
    that picks a family member's values (heldout-h-03, -04, -10, -11 take the first
    in a class) one in 8 or 16 (`sandman.eval.decoys`), and a test must not pass or
    fail by that chance; a test's code read from the patch's lines decides as well."""
    monkeypatch.setattr(harness, "_PLANT_KEY", b"held-out routes, fixed draws".ljust(32))
    predictions = [p for path in HELD_OUT for p in load_predictions(path)]
    result = await run_batch(
        load_instances(demo.instances), predictions, client=client, out=tmp_path,
        conditions=CONDITIONS, concurrency=4, images=ImageStore(demo.state_dir / "images"),
    )  # fmt: skip
    assert len(result.verdicts) == len(predictions)
    got = {v.model: (v.status, v.reason) for v in result.verdicts}
    # A known gap is a route the grader does not catch and says why (a wrong fix
    # that special-cases the tests, docs/evaluation.md): exactly those resolve,
    # and a gap that closes is dropped from its file.
    gaps = {
        str(row["model_name_or_path"])
        for path in HELD_OUT
        for row in map(json.loads, path.read_text().splitlines())
        if row.get("known_gap")
    }
    assert len(gaps) <= 3
    assert {m for m, (s, _) in got.items() if s == "resolved"} == gaps, got
    # Each was graded on its tests, not lost to an error of the grader's.
    assert not [m for m, (status, _) in got.items() if status in ("error", "sandbox_died")], got
