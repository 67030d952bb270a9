"""Each generated notebook matches its generator script in notebooks/src/ (regenerate after editing it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "notebooks" / "src").glob("make_*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_notebook_is_up_to_date(script, tmp_path):
    pytest.importorskip("nbformat")
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--quiet"], check=True, cwd=script.parent)
    (fresh,) = tmp_path.glob("*.ipynb")
    committed = ROOT / "notebooks" / fresh.name
    assert committed.exists(), f"{committed.name} is missing: run python {script.relative_to(ROOT)}"
    assert committed.read_text() == fresh.read_text(), (
        f"{committed.name} differs from what {script.name} generates: run python {script.relative_to(ROOT)}"
    )
