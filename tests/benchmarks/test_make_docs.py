"""benchmarks/make_docs.py: pages and plots from result files of any shape, with no typed numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import benchmarks.make_docs
from benchmarks._results import ENV_KEYS, make_result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def make_docs():
    pytest.importorskip("matplotlib")
    return benchmarks.make_docs


def _write(folder: Path, name: str, obj) -> None:
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _result(results, device: str = "cpu", command: str | None = None, notes: str | None = None, **env) -> dict:
    """A result in the schema, as a benchmark writes it."""
    env = {**dict.fromkeys(ENV_KEYS), "device": device, **env}
    return make_result(benchmark="b", env=env, command=command, baseline=None, results=results, notes=notes)


def test_any_shape_gives_pages_index_and_plots(make_docs, tmp_path):
    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    _write(res, "flat_smoke.json", _result({
        "smoke": True,
        "rows": [{"variant": "baseline", "step_ms": 12.5}, {"variant": "ours", "step_ms": 6.25, "error": ""}],
        "speedup": {"baseline/ours": 2.0},
    }, command="python -m benchmarks.flat --smoke"))
    _write(res, "nested.json", _result({
        "workloads": {"a": {"rows": [{"name": "x", "tokens_per_s": 1e6}, {"name": "y", "tokens_per_s": 2e6,
                                                                         "error": "CUDA OOM"}]}},
        "overhead_ratio": 1.03,
    }, device="NVIDIA H100 80GB HBM3", command="python -m benchmarks.nested", torch="2.11",
        date_utc="2026-11-26 03:00"))
    _write(res, "toplist.json", _result([{"k": 1, "ms": 3.0}, {"k": 2, "ms": 4.0}]))
    _write(res, "scalar.json", "42")
    _write(res, "broken.json", "{not json")
    _write(res, "gpt2_speedrun_x.json", _result({}))
    make_docs.main(["--results", str(res), "--out", str(out)])

    index = (out / "index.md").read_text()
    for name in ("flat_smoke", "nested", "toplist", "scalar", "broken", "gpt2_speedrun_x"):
        assert f"{name}.json" in index
    assert index.count("unreadable") == 2  # broken.json and a file outside the schema are listed, not fatal
    assert "gpt2.md" in index and not (out / "gpt2_speedrun_x.md").exists()  # its own generator's page
    nested = (out / "nested.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in nested and "python -m benchmarks.nested" in nested
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
    _write(res, "r.json", _result({"rows": [{"variant": "a", "step_ms": 1.2345678},
                                            {"variant": "b", "step_ms": 9.87654}]}))
    make_docs.main(["--results", str(res), "--out", str(out)])
    page = (out / "r.md").read_text()
    assert "1.235" in page and "9.877" in page
    body = page.split("| variant | step_ms |")[1]
    assert set(re.findall(r"\d+\.\d+", body)) == {"1.235", "9.877"}


def test_one_page_per_benchmark_with_a_section_per_device(make_docs, tmp_path):
    res, out = tmp_path / "results", tmp_path / "out"
    res.mkdir()
    row = {"rows": [{"variant": "a", "step_ms": 1.0}, {"variant": "b", "step_ms": 2.0}]}
    _write(res, "bench_nvidia-h100-80gb-hbm3.json", _result(row, device="NVIDIA H100 80GB HBM3"))
    _write(res, "bench_2x-nvidia-h200.json", _result(row, device="NVIDIA H200", notes="what was measured"))
    (res / "kernel_nvidia-h200.txt").write_text("train sweep 1.5 ms\n")
    make_docs.main(["--results", str(res), "--out", str(out)])
    assert make_docs.split_name("clt_scaling_4x-nvidia-h200") == ("clt_scaling", "4x-nvidia-h200")
    assert make_docs.split_name("muon_orthogonality_cpu") == ("muon_orthogonality", "cpu")
    assert make_docs.split_name("reliability") == ("reliability", "")
    assert sorted(p.name for p in out.glob("*.md")) == ["bench.md", "index.md", "kernel.md"]
    page = (out / "bench.md").read_text()
    assert "## NVIDIA H100 80GB HBM3" in page and "## 2x NVIDIA H200" in page and "what was measured" in page
    assert "train sweep 1.5 ms" in (out / "kernel.md").read_text()


def _doc_references(text: str) -> list[str]:
    """Relative markdown links and ``benchmarks/results/...`` / ``docs/...`` paths named in the text."""
    links = [m for m in re.findall(r"\]\(([^)#\s]+)", text) if not re.match(r"[a-z]+:", m)]
    paths = [m.group(1) for m in re.finditer(r"(?<![\w/.$])((?:benchmarks/results|docs)/[\w./-]+\.(?:json|txt|md|png))", text)
             if not re.search(r"(--[\w-]+[\s=]+|[Ww]rites\s+`?)$", text[max(0, m.start() - 40):m.start()])]  # an output path
    return links + paths


def test_every_file_referenced_from_the_docs_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for ref in _doc_references(page.read_text()):
            # a path written from the repo root (`benchmarks/results/x.json`) or relative to the page
            if not ((page.parent / ref).exists() or (ROOT / ref).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not missing, "\n".join(missing)
