"""A real distribution image: Debian with Python and git, built offline by debootstrap."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sandman.models import SandboxSpec
from sandman.providers.local import LocalProvider
from tests.images.debian import debian_python_tar
from tests.providers.local.conftest import needs_root_and_crun

pytestmark = [
    pytest.mark.anyio,
    needs_root_and_crun,
    pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap"),
    pytest.mark.timeout(1800),  # the first run on a machine builds the image
]


@pytest.fixture(scope="module")
def debian_tar() -> Path:
    return debian_python_tar()


async def test_python_and_git_in_a_debian_sandbox(
    provider: LocalProvider, debian_tar: Path
) -> None:
    await provider.images.import_archive(debian_tar, name="debian-python")
    info = await provider.create(SandboxSpec(image="debian-python", memory="512Mi"))
    assert info.endpoint is not None
    async with info.endpoint.client() as sb:
        await sb.wait_ready(timeout=30)
        await sb.write_file("/repo/calc.py", "def add(a, b):\n    return a + b\n")
        result = await sb.exec(
            "git init -q . && git add . && git -c user.name=t -c user.email=t@t commit -qm init"
            " && python3 -c 'import calc; print(calc.add(2, 3))'",
            cwd="/repo",
            check=True,
        )
        assert result.stdout == "5\n"
        shell = await sb.create_session()
        assert shell.shell == "/bin/bash"
        await sb.run_in_session(shell.id, "cd /repo && shopt -s globstar", check=True)
        assert (await sb.run_in_session(shell.id, "ls **/*.py")).stdout == "calc.py\n"
