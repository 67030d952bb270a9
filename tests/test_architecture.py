"""The layering of docs/architecture.md: models/ and ops/ are plain torch, no import runs up a layer or in a circle,
package imports sit at the module top, and nothing in the library points into benchmarks/."""

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
    """Also through what they import (e.g. models/clt_parallel.py, the distributed CLT's collectives)."""
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


# what each layer may import inside lightning_opt (docs/architecture.md, "Layers"); the root helpers
# (_optional, _errors, _internals, _lazy, _serialization) are importable from every layer
LAYERS = {
    "ops": {"ops"},
    "optim": {"optim"},
    "models": {"models", "ops", "optim"},
    "data": {"data", "models", "ops", "optim"},
    "callbacks": {"callbacks", "optim", "strategies._sigterm"},
    "modules": {"modules", "models", "ops", "optim", "data", "callbacks"},
    "strategies": {"strategies", "modules", "models", "ops", "optim", "callbacks"},
    "cli": {"callbacks"},
    "recipes": {"recipes", "cli", "modules", "models", "data", "callbacks", "optim"},
}
ROOT_HELPERS = {"_optional", "_errors", "_internals", "_lazy", "_serialization"}
# package imports that stay inside a function: the Triton kernels (importing them loads triton, an optional
# dependency), and load orders that files outside the CLT's still hold (listed so that the list only shrinks)
LAZY_PACKAGE_IMPORTS = {
    ("lightning_opt.ops.topk", "lightning_opt.ops._topk_triton"),  # loads triton
    ("lightning_opt.ops.global_topk", "lightning_opt.ops._topk_triton"),  # loads triton
    ("lightning_opt.models.clt", "lightning_opt.ops._topk_triton"),  # loads triton
    ("lightning_opt.ops.sparse_decode", "lightning_opt.ops._sparse_decode_triton"),  # loads triton
}


def _package_imports() -> list[tuple[str, str, bool]]:
    """``(importer, imported, inside_a_function)`` for every import of a lightning_opt module in the package."""
    out = []
    for path in sorted((ROOT / "lightning_opt").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")

        def visit(node: ast.AST, in_function: bool, name: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, ast.Import):
                    out.extend((name, a.name, in_function) for a in child.names if a.name.startswith("lightning_opt"))
                elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith(
                        "lightning_opt"):
                    out.append((name, child.module, in_function))
                elif not isinstance(child, ast.If) or not _is_type_checking(child):
                    visit(child, nested)

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _layer(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "root"
    if parts[0] in ROOT_HELPERS:
        return parts[0]
    return parts[0] if parts[0] in LAYERS else parts[0]


def _allowed(importer: str, imported: str) -> bool:
    src, dst = _layer(importer), _layer(imported)
    if dst in ROOT_HELPERS or src in ROOT_HELPERS or imported == "lightning_opt":
        return True
    allowed = LAYERS.get(src, set())
    rest = imported.split(".", 1)[1] if "." in imported else ""
    return dst in allowed or any(rest == a or rest.startswith(a + ".") for a in allowed if "." in a)


def test_no_import_runs_up_a_layer():
    offenders = [f"{a} imports {b}" for a, b, _ in _package_imports() if not _allowed(a, b)]
    assert not offenders, "imports against the layer table of docs/architecture.md:\n" + "\n".join(offenders)


def test_package_imports_are_at_module_top():
    offenders = sorted({f"{a}: {b}" for a, b, inside in _package_imports()
                        if inside and (a, b) not in LAZY_PACKAGE_IMPORTS})
    assert not offenders, "package imports inside functions (move them to the module's top):\n" + "\n".join(offenders)


def test_no_import_cycles_in_the_package():
    graph: dict[str, set[str]] = {}
    for a, b, _ in _package_imports():
        if b != a and not a.startswith(b + ".") and b != "lightning_opt":  # a package's own __init__ is not a cycle
            graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_library_points_nowhere_into_benchmarks():
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "lightning_opt").rglob("*"))
                 if p.is_file() and p.suffix in (".py", ".yaml") and "benchmarks/" in p.read_text()]
    assert not offenders, "the wheel ships no benchmarks/: link the docs instead:\n" + "\n".join(offenders)
