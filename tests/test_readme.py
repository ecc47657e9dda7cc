"""The README's SDK example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.providers.local.conftest import needs_root_and_crun

README = Path(__file__).resolve().parent.parent / "README.md"


@needs_root_and_crun
def test_sdk_example_runs(tmp_path: Path) -> None:
    text = README.read_text()
    block = re.search(r"<!-- sdk-example.*?-->\n```python\n(.*?)```", text, re.DOTALL)
    assert block is not None, "the SDK example block is missing from the README"
    script = tmp_path / "example.py"
    script.write_text(block[1])
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("0 hello from sb-")
    assert lines[1] == "/work 2"
    assert "handed_out" in lines[2]
