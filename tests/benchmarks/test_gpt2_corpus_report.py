"""benchmarks/gpt2_corpus_report.py: the per-corpus time-to-target table, goal lines and plot of docs/benchmarks/gpt2.md,
from result files written here (synthetic, in tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.gpt2_report
from benchmarks._results import environment, write_result

DEVICE = "NVIDIA H100 80GB HBM3"
SLUG = "nvidia-h100-80gb-hbm3"


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("matplotlib")
    return benchmarks.gpt2_report


def _manifest(folder: Path) -> Path:
    corpora = {"novels": "prose (novels)", "code": "source code (Python)", "docs": "technical documentation"}
    m = {"tuned_on": ["novels", "code"], "held_out": "docs",
         "corpora": {name: {"corpus": name, "kind": kind, "held_out": name == "docs"} for name, kind in corpora.items()}}
    path = folder / "corpora_manifest.json"
    write_result(path, benchmark="build_corpora", env=environment(on_gpu=False), command=None, baseline=None, results=m)
    return path


def _ours(name: str, curve: list[tuple[float, float]], tokens_per_s: float, long: bool = False) -> dict:
    return {"name": f"ours-speedrun-lightning-{name}", "tokens_per_s": tokens_per_s, "final_val_loss": curve[-1][1],
            "val_curve": [{"step": 8 * (i + 1), "train_s": t, "val_loss": v} for i, (t, v) in enumerate(curve)],
            "variant": {"name": name, "accum": 8, "long": long, "budget": 0.85}}


def _result(folder: Path, corpus: str, record: str, ours: dict[str, dict], record_s: float = 100.0,
            target: float = 4.0, record_tps: float = 400_000.0) -> Path:
    command = f"python -m benchmarks.gpt2_record --record {record} --data-dir .data/corpora/{corpus}"
    rec = {"name": f"record-{record}", "tokens_per_s": record_tps, "final_val_loss": target,
           "record_train_s": record_s - 8.0, "record_train_s_adjusted": record_s,
           "val_curve": [{"step": 0, "train_s": 0.0, "val_loss": 10.8}, {"step": 60, "train_s": record_s / 2,
                                                                          "val_loss": target + 0.5},
                         {"step": 127, "train_s": record_s, "val_loss": target}]}
    path = folder / f"gpt2_record_{corpus}_{record}_{SLUG}.json"
    write_result(path, benchmark="gpt2_record", env={**environment(on_gpu=False), "device": DEVICE}, command=command,
                 baseline=None, results={"smoke": False, "settings": {"data_dir": f".data/corpora/{corpus}",
                                                                      "record": record, "val_tokens": 1_048_576},
                                         "results": {"record": rec, **ours}})
    return path


def _rewrite(path: Path, **changes) -> None:
    """The result file with ``changes`` made to its ``results``."""
    d = json.loads(path.read_text())
    write_result(path, **{k: v for k, v in d.items() if k != "schema"} | {"results": {**d["results"], **changes}})


def _row(text: str, *cells: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith("| ") and all(c in line for c in cells)]
    assert len(rows) == 1, (cells, rows)
    return rows[0]


def test_table_ratios_marking_and_goals(report, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    manifest = _manifest(res)
    # novels / 2025-01-04: the shipped recipe reaches 4.0 between (50 s, 4.2) and (70 s, 3.8): 60 s of the record's
    # 100 s; a second variant reaches it at 90 s
    _result(res, "novels", "2025-01-04", {
        "ours": _ours("recipe", [(30.0, 5.0), (50.0, 4.2), (70.0, 3.8)], 600_000.0),
        "ours-half-batch-long": _ours("half-batch-long", [(45.0, 4.5), (90.0, 4.0)], 500_000.0, long=True)})
    # docs (held out) / 2025-08-23: no `recipe` run, one variant that stops above the target
    _result(res, "docs", "2025-08-23", {"ours": _ours("half-batch-85", [(40.0, 4.6), (80.0, 4.1234)], 300_000.0)},
            record_s=80.0)
    doc = report.main(["--corpus-results", str(res), "--manifest", str(manifest), "--doc", str(tmp_path / "gpt2.md")])
    text = doc.read_text()
    section = text.split("## Time to target per corpus")[1].split("\n## ")[0]

    recipe = _row(section, "novels", "recipe")
    assert "novels: prose (novels); tuned on" in recipe and "| 2025-01-04 |" in recipe
    assert "| 100.0 | 4.0000 |" in recipe  # the record's adjusted time and its final val loss (the target)
    assert "**recipe** (shipped default)" in recipe
    assert "| 60.0 | 0.600x | 1.50x |" in recipe  # 60 / 100; 600k / 400k tokens/s
    assert "ours: 1024-token windows" in recipe and "1,048,576 val tokens" in recipe
    assert DEVICE in recipe and "--data-dir .data/corpora/novels" in recipe
    other = _row(section, "half-batch-long")
    assert "**half-batch-long**" not in other  # only the shipped variant is marked where it ran
    assert "| 90.0 | 0.900x | 1.25x |" in other
    assert "both: the record's document-causal long-context evaluation" in other

    docs = _row(section, "half-batch-85")
    assert "docs: technical documentation; **held out**" in docs
    assert "not reached (final 4.1234)" in docs and "| 0.75x |" in docs  # 300k / 400k; no time ratio
    assert "**half-batch-85**" in docs  # no `recipe` in that call: every variant is marked
    # held-out rows come last
    assert section.index("novels: prose") < section.index("docs: technical")

    goals = section.split("Goals:")[1]
    assert ("<= 0.70x the 2025-01-04 record's time and <= 0.75x the 2025-07-13 record's time and <= 0.75x the "
            "2025-08-23 record's time") in goals
    assert f"- novels, 2025-01-04 record (<= 0.70x): `recipe` on {DEVICE}: 0.600x, within 0.70x" in goals
    assert "- docs (held out), 2025-08-23 record (<= 0.75x): `half-batch-85` on " in goals
    assert "target not reached (final 4.1234 vs 4.0000)" in goals
    assert "- code, 2025-01-04 record (<= 0.70x): no result" in goals
    assert "half-batch-long" not in goals  # only the marked rows count toward the goal

    img = tmp_path / "img" / "gpt2_corpora_val_vs_time.png"
    assert img.stat().st_size > 0 and f"](img/{img.name})" in section
    raw = recipe.split("([raw](")[1].split(")")[0]
    assert (doc.parent / raw).resolve() == (res / f"gpt2_record_novels_2025-01-04_{SLUG}.json").resolve()


def test_ratio_above_the_goal_and_plot_panels(report, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    manifest = report.gpt2_corpus_report.load_manifest(_manifest(res))
    a = _result(res, "code", "2025-08-23", {"ours": _ours("recipe", [(60.0, 4.4), (100.0, 3.6)], 450_000.0)},
                record_s=100.0)
    b = _result(res, "docs", "2025-01-04", {"ours": _ours("recipe", [(50.0, 3.9)], 450_000.0)}, record_s=100.0)
    rows = report.gpt2_corpus_report.read_all([a, b], manifest)
    assert [(r.corpus, r.held_out, r.record) for r in rows] == [("code", False, "2025-08-23"), ("docs", True, "2025-01-04")]
    assert rows[0].ours_s == pytest.approx(80.0) and rows[0].time_ratio == pytest.approx(0.8)
    assert rows[1].ours_s == pytest.approx(50.0)  # reached at the first val point: no interpolation
    lines = "\n".join(report.gpt2_corpus_report.goal_lines(rows, manifest))
    assert "code, 2025-08-23 record (<= 0.75x): `recipe`" in lines and "0.800x, above 0.75x" in lines
    assert "docs (held out), 2025-01-04 record (<= 0.70x): `recipe`" in lines and "0.500x, within 0.70x" in lines
    img = tmp_path / "p.png"
    assert report.gpt2_corpus_report.plot([a, b], manifest, img) and img.stat().st_size > 0


def test_record_that_did_not_finish(report, tmp_path):
    path = _result(tmp_path, "code", "2025-01-04", {"ours": _ours("recipe", [(50.0, 4.5)], 450_000.0)})
    results = json.loads(path.read_text())["results"]["results"]
    _rewrite(path, results={**results, "record": {"name": "record-2025-01-04", "error": "record script exited with 1"}})
    mod = report.gpt2_corpus_report
    manifest = mod.load_manifest(_manifest(tmp_path))
    row = _row("\n".join(mod.table(mod.read_all([path], manifest), tmp_path / "gpt2.md")), "recipe")
    assert "| failed: record script exited with 1 | - |" in row
    assert "no target (the record has no final val loss) | - | - |" in row  # no time, no ratios
    assert "no record time to compare with" in "\n".join(mod.goal_lines(mod.read_all([path], manifest), manifest))


def test_no_per_corpus_results(report, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    # neither the 1024-token novels result (no corpus in its name) nor a smoke run is a per-corpus result
    write_result(res / f"gpt2_record_{SLUG}.json", benchmark="gpt2_record", env=environment(on_gpu=False),
                 command=None, baseline=None, results={"smoke": False})
    smoke = _result(res, "code", "2025-01-04", {"ours": _ours("recipe", [(1.0, 3.0)], 1.0)})
    _rewrite(smoke, smoke=True)
    doc = report.main(["--corpus-results", str(res), "--manifest", str(_manifest(res)), "--doc", str(tmp_path / "gpt2.md")])
    section = doc.read_text().split("## Time to target per corpus")[1].split("\n## ")[0]
    assert "No per-corpus results yet" in section and "GPU figures: pending" in section
    assert "| " not in section and "Goals:" not in section  # no table, no standings
    assert not (tmp_path / "img" / "gpt2_corpora_val_vs_time.png").exists()
    assert report.gpt2_corpus_report.is_corpus_file(Path(f"gpt2_record_docs_2025-08-23_{SLUG}.json"))
    assert not report.gpt2_corpus_report.is_corpus_file(Path(f"gpt2_record_{SLUG}.json"))
    assert all(p is None or not report.gpt2_corpus_report.is_corpus_file(p) for p in report.shown("record"))


def test_a_run_of_the_recipe_spec_under_another_name_counts_and_a_failed_call_shows_why(report, tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    manifest = _manifest(res)
    accum, long, budget, *_ = report.gpt2_corpus_report.recipe_spec()
    same = _ours("spec-twin", [(30.0, 5.0), (50.0, 4.2), (70.0, 3.8)], 600_000.0, long=long)
    same["variant"].update(accum=accum, budget=budget, model_overrides={})
    other = _ours("other", [(40.0, 4.5), (90.0, 4.0)], 500_000.0, long=not long)
    # the recipe's geometry and budget with another window (override and recorded spec): not the recipe
    window = report.gpt2_corpus_report.recipe_spec()[3]["window_schedule"]
    wider = [window[0], window[1] + 512]
    widew = _ours("wide-window", [(35.0, 4.6), (80.0, 4.1)], 550_000.0, long=long)
    widew["variant"].update(accum=accum, budget=budget, model_overrides={"window_schedule": wider})
    widew.update(stopped="deadline", steps=80)  # cut by the call's time before the target
    # a run named "recipe" whose recorded spec has another window is not the shipped spec either
    old_recipe = _ours("recipe", [(36.0, 4.6), (85.0, 3.95)], 550_000.0, long=long)
    old_recipe["spec"] = {"model": {"window_schedule": wider}}
    _result(res, "code", "2025-01-04", {"ours": same, "ours-other": other, "ours-wide-window": widew})
    _result(res, "docs", "2025-01-04", {"ours": old_recipe})
    failed = _result(res, "novels", "2025-08-23", {})
    results = json.loads(failed.read_text())["results"]["results"]
    _rewrite(failed, results={**results, "record": {"name": "record-2025-08-23", "error": "record script exited with 1"}},
             record_diagnosis="its loader found no document start in its token window")
    doc = report.main(["--corpus-results", str(res), "--manifest", str(manifest), "--doc", str(tmp_path / "gpt2.md")])
    section = doc.read_text().split("## Time to target per corpus")[1].split("\n## ")[0]
    twin = _row(section, "spec-twin")
    assert "**spec-twin** (= recipe" in twin and "| 0.600x |" in twin
    assert "| other |" in _row(section, "| other |")  # not the recipe's spec: not bold
    assert "code, 2025-01-04 record (<= 0.70x): `spec-twin`" in section and "`other`" not in section.split("Goals:")[1]
    wide = _row(section, "| wide-window |")
    assert "not reached: the call's time stopped it at step 80 (val loss 4.1000)" in wide
    assert "`wide-window`" not in section.split("Goals:")[1]
    # the only run of its call, so bold, but not called the shipped default: it ran another window
    assert "| **recipe** |" in _row(section, "| **recipe** |")
    line = [x for x in section.splitlines() if x.startswith("- novels, 2025-08-23")][0]
    assert "record failed: record script exited with 1 (its loader found no document start" in line
