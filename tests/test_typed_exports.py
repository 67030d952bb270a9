"""The lazily re-exported names are visible to type checkers: every subpackage's ``_EXPORTS`` name is imported
under ``if TYPE_CHECKING:`` from the submodule that ``_EXPORTS`` names, and that submodule defines it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_opt"
INITS = sorted(p for p in PACKAGE.glob("*/__init__.py") if "_EXPORTS" in p.read_text())


def _parts(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(``_EXPORTS``, name -> submodule of the ``TYPE_CHECKING`` imports)."""
    tree = ast.parse(path.read_text())
    exports: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            exports = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{alias.name}: re-export it as `import {alias.name} as {alias.name}`"
                    typed[alias.name] = imp.module.rsplit(".", 1)[-1]
    return exports, typed


@pytest.mark.parametrize("init", INITS, ids=[p.parent.name for p in INITS])
def test_lazy_exports_have_typed_imports(init: Path) -> None:
    exports, typed = _parts(init)
    assert exports and typed == exports, f"{init.relative_to(PACKAGE.parent)}: TYPE_CHECKING imports differ from _EXPORTS"
    package = importlib.import_module(f"lightning_opt.{init.parent.name}")
    for name in exports:
        if name == exports[name]:  # ops.attention: importing the submodule binds its name on the package
            continue
        assert getattr(package, name) is getattr(importlib.import_module(f"{package.__name__}.{exports[name]}"), name)
