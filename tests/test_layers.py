"""Layers import downward only (docs/architecture.md):
cli | server | eval -> client -> pool -> providers -> daemon | images
-> models | errors | settings | _transport.
The two providers never import each other, and nothing imports server or cli.
And ``import sandman`` loads none of the extras' libraries (`FENCED`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "sandman"

LAYERS = {
    "errors": 0, "egress": 0, "models": 0, "settings": 0, "_version": 0, "_transport": 0, "_flock": 0,
    "_tracing": 0,
    "daemon": 1, "images": 1,
    "providers": 2,
    "pool": 3, "testing": 3,
    "client": 4,
    "server": 5, "eval": 5, "integrations": 5, "cli": 6,
}  # fmt: skip


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "sandman" and node.level == 0:
            found += [f"sandman.{alias.name}" for alias in node.names]  # from sandman import errors
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name == "sandman" or name.startswith("sandman.")]


MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_downward(path: Path) -> None:
    rel = path.relative_to(SRC).with_suffix("")
    own = f"sandman.{'.'.join(rel.parts)}"
    own_layer = LAYERS[_top(own)]
    for imported in _imports(path):
        top = _top(imported)
        assert top, f"{own} imports the package root; import the module instead"
        assert LAYERS[top] <= own_layer, f"{own} (layer {own_layer}) imports {imported}"
        if top == own.split(".")[1] == "providers":
            kinds = {
                own.split(".")[2:3][0],
                imported.split(".")[2:3][0] if imported.count(".") >= 2 else "",
            }
            assert kinds != {"local", "kubernetes"}, f"{own} imports {imported}"


# -- third-party imports: what ``import sandman`` may load ------------------------------------

FENCED = {
    "httpx": "only with an httpx transport (_transport/__init__.py: the daemon client never loads it)",
    "fastapi": "only for the service (sandman.server, the [server] extra)",
    "aiohttp": "only for the Kubernetes provider (the [kubernetes] extra)",
    "pydantic_settings": "only where the environment is read (cli, server)",
    "opentelemetry": "only if the program set up tracing itself (_tracing.py looks, never imports)",
}


def _loaded_after(statement: str) -> set[str]:
    """The top-level modules in sys.modules after ``statement``, in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; {statement}; print(*sorted(sys.modules))"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {name.split(".")[0] for name in done.stdout.split()}


@pytest.fixture(scope="module")
def loaded_by_import() -> set[str]:
    return _loaded_after("import sandman")


@pytest.mark.parametrize("module", FENCED)
def test_import_sandman_loads_no(module: str, loaded_by_import: set[str]) -> None:
    assert module not in loaded_by_import, f"import sandman loads {module}: {FENCED[module]}"


def test_the_fence_sees_what_a_feature_loads() -> None:
    # The same check after features that need them: the fence above can fail.
    loaded = _loaded_after("import sandman.server, sandman.providers.kubernetes")
    assert {"fastapi", "aiohttp"} <= loaded
