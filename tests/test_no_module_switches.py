"""No module-level switches: benchmarks and tests never assign upper-case attributes of lightning_opt modules.

Every choice of the library (a kernel's launch shape, a backend, a threshold) is an explicit argument, so a
benchmark or test that wants another value passes it. An AST scan of benchmarks/ and tests/ finds
``<alias>.NAME = ...`` (also augmented, annotated and tuple targets), ``setattr(<alias>, "NAME", ...)``,
``monkeypatch.setattr(<alias>, "NAME", ...)``, ``mock.patch.object(<alias>, "NAME", ...)`` and
``monkeypatch.setattr("lightning_opt....NAME", ...)`` / ``mock.patch("lightning_opt....NAME")``, where
``<alias>`` is a name bound to anything imported from lightning_opt (``import lightning_opt.x as m``,
``from lightning_opt.x import y``, ``importlib.import_module("lightning_opt.x")``) and ``NAME`` is upper case.
Nothing is allow-listed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("benchmarks", "tests")
PACKAGE = "lightning_opt"


def _is_package(module: str | None) -> bool:
    return module is not None and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _is_constant_name(name: str) -> bool:
    return name.isupper()


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _package_aliases(tree: ast.AST) -> set[str]:
    """Names bound (anywhere in the file) to lightning_opt or to something imported from it."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_package(a.name):
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_package(node.module):
            aliases.update(a.asname or a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = _dotted(node.value.func) or ""
            args = node.value.args
            if (func.split(".")[-1] == "import_module" and args and isinstance(args[0], ast.Constant)
                    and isinstance(args[0].value, str) and _is_package(args[0].value)):
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return aliases


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    out: list[ast.AST] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found += t.elts
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            out.append(t)
    return out


def _on_alias(node: ast.AST, aliases: set[str]) -> bool:
    dotted = _dotted(node)
    return dotted is not None and dotted.split(".")[0] in aliases


def module_switches(source: str, filename: str = "<src>") -> list[str]:
    """``line: what`` for every assignment of an upper-case attribute of a lightning_opt import in ``source``."""
    tree = ast.parse(source, filename=filename)
    aliases = _package_aliases(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _is_constant_name(t.attr) and _on_alias(t.value, aliases):
                found.append(f"{node.lineno}: {_dotted(t)} = ...")
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func) or ""
        last = func.split(".")[-1]
        args = node.args
        first = args[0] if args else None
        second = args[1] if len(args) > 1 else None
        if (last == "setattr" or func.endswith("patch.object")) and first is not None:
            if (_on_alias(first, aliases) and isinstance(second, ast.Constant) and isinstance(second.value, str)
                    and _is_constant_name(second.value)):
                found.append(f"{node.lineno}: {func}({_dotted(first)}, {second.value!r}, ...)")
        if (last in ("setattr", "patch") and isinstance(first, ast.Constant) and isinstance(first.value, str)
                and _is_package(first.value) and _is_constant_name(first.value.rsplit(".", 1)[-1])):
            found.append(f"{node.lineno}: {func}({first.value!r}, ...)")
    return found


def test_the_scan_finds_every_form() -> None:
    src = """
import importlib
import lightning_opt.ops.softcap_ce as sc
import lightning_opt
from lightning_opt.ops import _topk_triton as kt
from unittest import mock
tt = importlib.import_module("lightning_opt.ops._topk_triton")

def f(monkeypatch):
    kt.BLOCK = 1
    kt.BLOCK, kt.NUM_WARPS = 1, 2
    sc.BLOCK_V += 1
    lightning_opt.ops.softcap_ce.TILE_V = 3
    tt.BLOCK: int = 4
    setattr(kt, "BLOCK", 5)
    monkeypatch.setattr(sc, "BLOCK_V", 6)
    monkeypatch.setattr("lightning_opt.ops._topk_triton.NUM_WARPS", 7)
    mock.patch.object(kt, "BLOCK", 8)
    mock.patch("lightning_opt.ops.softcap_ce.TILE_M", 9)
"""
    hits = module_switches(src)
    assert len(hits) == 11 and {int(h.split(":")[0]) for h in hits} == set(range(10, 20)), hits
    fine = """
import torch
from lightning_opt.ops import topk as topk_mod

def f(monkeypatch, cfg):
    torch.BLOCK = 1  # not lightning_opt
    monkeypatch.setattr(topk_mod, "_row_lower_bounds", None)  # a function, not a switch
    cfg.BLOCK = 2  # not an import
    x = topk_mod.TRITON_BLOCK  # reading is fine
"""
    assert module_switches(fine) == []


def test_benchmarks_and_tests_assign_no_module_constants() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20
    offenders = [f"{p.relative_to(ROOT)}:{hit}" for p in files
                 for hit in module_switches(p.read_text(), str(p))]
    assert not offenders, ("pass the value as an argument instead of assigning a module constant:\n"
                           + "\n".join(offenders))
