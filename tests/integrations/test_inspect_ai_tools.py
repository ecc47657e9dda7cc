"""inspect's own agent tools on Sandman: ``bash_session()`` and ``text_editor()`` inject
inspect's sandbox-tools server (a glibc binary, so a Debian image: built offline by
debootstrap and cached) and talk to it through the adapter's ``exec``, polling."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai")

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash_session, text_editor

from sandman.integrations.inspect_ai import SandmanSandboxEnvironmentConfig
from sandman.providers.local import LocalProvider
from tests.images.debian import debian_python_tar
from tests.integrations.conftest import adapters_on, needs_local, state_with

pytestmark = [
    pytest.mark.integrations,
    needs_local,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the image
    # inspect's own, whatever the sandbox: see test_inspect_ai._inspects_own_warnings
    pytest.mark.filterwarnings("ignore:Unclosed <MemoryObjectReceiveStream:ResourceWarning"),
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

IMAGE = "debian-python"
MODEL = "mockllm/model"


@pytest.fixture(scope="module")
def debian() -> Iterator[LocalProvider]:
    with (
        state_with({IMAGE: debian_python_tar()}) as provider,
        pytest.MonkeyPatch.context() as monkeypatch,
        adapters_on(provider, monkeypatch),
    ):
        yield provider


def test_bash_session_and_text_editor(debian: LocalProvider, tmp_path: Path) -> None:
    calls = [
        ("bash_session", {"action": "type_submit", "input": "cd /tmp && echo hi > x && cat x"}),
        ("bash_session", {"action": "type_submit", "input": "pwd"}),  # the same shell
        ("text_editor", {"command": "str_replace", "path": "/tmp/x", "old_str": "hi",
                         "new_str": "bye"}),
        ("text_editor", {"command": "view", "path": "/tmp/x"}),
    ]  # fmt: skip
    outputs = [ModelOutput.for_tool_call(MODEL, name, args) for name, args in calls]
    outputs.append(ModelOutput.from_content(MODEL, "done"))
    for output in outputs:
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    task = Task(
        dataset=[Sample(input="edit /tmp/x")],
        solver=[use_tools([bash_session(), text_editor()]), generate()],
        sandbox=("sandman", SandmanSandboxEnvironmentConfig(image=IMAGE)),
    )
    [log] = eval(
        task, model=get_model(MODEL, custom_outputs=outputs), display="none",
        log_dir=str(tmp_path), ctl_server=False,
    )  # fmt: skip
    gc.collect()
    assert log.status == "success", log.error
    assert log.samples is not None
    said = [m for m in log.samples[0].messages if m.role == "tool"]
    assert [m.error for m in said] == [None] * 4
    assert "hi\n" in said[0].text
    assert said[1].text.startswith("/tmp\n")  # the same shell, still in /tmp
    assert "\tbye\n" in said[3].text and "\thi\n" not in said[3].text
