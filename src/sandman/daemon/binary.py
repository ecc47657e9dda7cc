"""Where the sandmand binary built with this package lives."""

from __future__ import annotations

from pathlib import Path

from sandman import errors

__all__ = ["daemon_path"]


def daemon_path() -> Path:
    """The path of the static sandmand binary that ships with this package.

    It is built by the package build (``pip install .``); a missing binary
    means the install skipped that step.
    """
    path = Path(__file__).resolve().parent.parent / "_bin" / "sandmand"
    if not path.is_file():
        raise errors.ConfigError(
            f"sandmand binary not found at {path}: reinstall the package "
            "(pip install -e .) so its build compiles the daemon"
        )
    return path
