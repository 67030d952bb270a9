"""The layering claim of docs/architecture.md: models/ and ops/ are plain torch, no Lightning."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN_TORCH = ("models", "ops")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _imported_modules(path: Path) -> list[str]:
    """Every absolute module name an ``import`` or ``from ... import`` in the file names, at any depth."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _plain_torch_files() -> list[Path]:
    return sorted(p for layer in PLAIN_TORCH for p in (ROOT / "lightning_opt" / layer).rglob("*.py"))


def test_models_and_ops_do_not_import_lightning():
    files = _plain_torch_files()
    assert len(files) > 5
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in _imported_modules(p)
                 if name.split(".")[0] in LIGHTNING]
    assert not offenders, "models/ and ops/ must stay plain torch:\n" + "\n".join(offenders)


def test_importing_models_and_ops_loads_no_lightning():
    """Also through what they import (e.g. strategies/_collectives.py for the distributed CLT)."""
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in _plain_torch_files()]
    code = ("import importlib, sys\n"
            f"LIGHTNING = {LIGHTNING!r}\n"
            f"for m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ImportError as e:\n"  # an optional dependency (triton) that is not installed
            "        if e.name and e.name.split('.')[0] in ('lightning_opt',) + LIGHTNING: raise\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHTNING!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", f"importing models/ and ops/ loaded Lightning: {out}"
