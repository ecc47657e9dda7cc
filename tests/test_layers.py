"""Layers import downward only (docs/architecture.md):
cli | server | eval -> client -> pool -> providers -> daemon | images
-> models | errors | settings | _transport.
The two providers never import each other, and nothing imports server or cli."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "sandman"

LAYERS = {
    "errors": 0, "models": 0, "settings": 0, "_version": 0, "_transport": 0, "_flock": 0,
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
