"""benchmarks/make_docs.py: pages and plots from result files of any shape, with no typed numbers."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def make_docs():
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "benchmarks" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_docs"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, name: str, obj) -> None:
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_any_shape_gives_pages_index_and_plots(make_docs, tmp_path):
    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    _write(res, "flat_smoke.json", {
        "benchmark": "flat", "device": "cpu", "command": "python benchmarks/flat.py --smoke", "smoke": True,
        "rows": [{"variant": "baseline", "step_ms": 12.5}, {"variant": "ours", "step_ms": 6.25, "error": ""}],
        "speedup": {"baseline/ours": 2.0},
    })
    _write(res, "nested.json", {
        "env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date_utc": "2026-11-26 03:00",
                "command": ["python", "benchmarks/nested.py"]},
        "workloads": {"a": {"rows": [{"name": "x", "tokens_per_s": 1e6}, {"name": "y", "tokens_per_s": 2e6,
                                                                         "error": "CUDA OOM"}]}},
        "overhead_ratio": 1.03,
    })
    _write(res, "toplist.json", [{"k": 1, "ms": 3.0}, {"k": 2, "ms": 4.0}])
    _write(res, "scalar.json", "42")
    _write(res, "broken.json", "{not json")
    _write(res, "gpt2_speedrun_x.json", {"env": {"device": "cpu"}})
    make_docs.main(["--results", str(res), "--out", str(out)])

    index = (out / "index.md").read_text()
    for name in ("flat_smoke", "nested", "toplist", "scalar", "broken", "gpt2_speedrun_x"):
        assert f"{name}.json" in index
    assert "unreadable" in index  # broken.json is listed, not fatal
    assert "gpt2.md" in index and not (out / "gpt2_speedrun_x.md").exists()  # its own generator's page
    nested = (out / "nested.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in nested and "python benchmarks/nested.py" in nested
    assert "CUDA OOM" in nested and "overhead_ratio" in nested
    assert "smoke run" in (out / "flat_smoke.md").read_text()
    assert "| baseline/ours" not in index  # headline keys are dotted paths
    assert "speedup.baseline/ours = 2" in index
    plots = sorted(p.name for p in (out / "img").glob("*.png"))
    assert plots == ["flat_smoke-t0.png", "nested-t0.png", "toplist-t0.png"]
    for page in out.glob("*.md"):
        for link in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            if not link.startswith("http") and "gpt2.md" not in link:
                assert (page.parent / link).exists(), f"{page.name}: broken link {link}"


def test_numbers_come_from_the_json(make_docs, tmp_path):
    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    _write(res, "r.json", {"device": "cpu", "rows": [{"variant": "a", "step_ms": 1.2345678},
                                                      {"variant": "b", "step_ms": 9.87654}]})
    make_docs.main(["--results", str(res), "--out", str(out)])
    page = (out / "r.md").read_text()
    assert "1.235" in page and "9.877" in page
    body = page.split("| variant | step_ms |")[1]
    assert set(re.findall(r"\d+\.\d+", body)) == {"1.235", "9.877"}
