"""Build a notebook from a list of ``("md" | "code", source)`` cells with nbformat.

Notebooks are generated from the small ``make_<name>.py`` scripts next to this file, so that reviews
read plain Python; outputs are never stored. Cell ids are derived from the cell's position, so
regenerating an unchanged script gives a byte-identical notebook.
"""

from __future__ import annotations

import sys
from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1]


def write_notebook(name: str, cells: list[tuple[str, str]]) -> Path:
    """Write ``notebooks/<name>.ipynb`` from ``cells`` and return its path."""
    nb = new_notebook()
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        text = dedent(source).strip("\n")
        if kind == "md":
            cell = new_markdown_cell(text)
        elif kind == "code":
            cell = new_code_cell(text)
        else:
            raise ValueError(f"cell {i} of {name}: kind {kind!r} is neither 'md' nor 'code'")
        cell.id = f"{name[:2]}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    # ``--out DIR`` writes elsewhere (tests/test_notebook_sources.py compares with the committed notebook)
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else NOTEBOOKS
    path = out / f"{name}.ipynb"
    path.write_text(nbformat.writes(nb) + "\n")
    if "--quiet" not in sys.argv:
        print(f"wrote {path}")
    return path
