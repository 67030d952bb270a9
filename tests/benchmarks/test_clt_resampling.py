"""benchmarks/clt_resampling.py --smoke: every variant trains on both seeds through a Trainer, and the JSON holds
the held-out FVU, the dead fractions, the resamplings and the step cost the docs quote, with sane values."""

from __future__ import annotations

import json
import math

import torch

from benchmarks import clt_resampling
from benchmarks._results import load_result


def test_smoke_result_has_every_variant_and_seed_with_sane_metrics(tmp_path):
    bench = clt_resampling
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    res = bench.main(["--smoke", "--out", str(out), "--plot", str(png)])
    written = load_result(out)
    assert written["env"]["device"].startswith("cpu") and written["env"]["torch"] == torch.__version__
    assert written["command"]
    saved = written["results"]
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    assert saved["smoke"] is True
    w = saved["workload"]
    rows = {(r["variant"], r["seed"]): r for r in saved["rows"]}
    assert set(rows) == {(v, s) for v in bench.VARIANTS for s in (0, 1)}
    for (name, seed), r in rows.items():
        assert r["steps"] == w["steps"], (name, seed)
        for key in ("final_dead_fraction", "heldout_never_fired_fraction"):
            assert 0.0 <= r[key] <= 1.0, (name, seed, key)
        for key in ("final_val_fvu", "heldout_fvu_first_position", "heldout_fvu_other_positions"):
            assert math.isfinite(r[key]) and r[key] >= 0, (name, seed, key)
        assert r["step_cpu_ms"] > 0 and r["steps_per_s_cpu"] > 0
        curve = r["curve"]
        assert [p["step"] for p in curve] == sorted({p["step"] for p in curve}) and curve[-1]["step"] == w["steps"]
        assert curve[-1]["val_fvu"] == r["final_val_fvu"]
        resamples = name in ("resample", "both")
        assert (r["resample_dead_every"] is not None) == resamples
        assert (r["aux_coef"] > 0) == (name in ("auxk", "both"))
        if resamples:
            assert {d["step"] for d in r["resamplings"]} <= set(w["resample_steps"])  # the ones with dead features
            assert sum(d["features"] for d in r["resamplings"]) == r["resampled_total"]
            assert all(1 <= d["distinct_columns"] <= d["features"] for d in r["resamplings"])
            # distinct tokens per layer (fewer dead features than tokens): distinct columns but for tokens whose
            # inputs coincide (a window's first token sees only its byte)
            assert all(d["distinct_columns"] >= 0.9 * d["features"] for d in r["resamplings"]), r["resamplings"]
        else:
            assert r["resampled_total"] == 0 and r["resamplings"] == [] and r["resample_step_cpu_ms"] is None
    # training reduces the held-out error below the variance (FVU 1 = predicting the mean)
    for seed in (0, 1):
        assert rows[("none", seed)]["final_val_fvu"] < 1.0
    assert any(rows[(v, s)]["resampled_total"] > 0 for v in ("resample", "both") for s in (0, 1))
    summary = saved["summary"]
    assert set(summary) == set(bench.VARIANTS)
    assert summary["none"]["steps_per_s_ratio_to_none"]["mean"] == 1.0
    for name, entry in summary.items():
        fvus = [rows[(name, s)]["final_val_fvu"] for s in (0, 1)]
        assert entry["final_val_fvu"]["min"] == min(fvus) and entry["final_val_fvu"]["max"] == max(fvus)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_subset_of_variants_with_another_weighting(tmp_path):
    bench = clt_resampling
    res = bench.main(["--smoke", "--seeds", "1", "--variants", "none,resample", "--resample_weighting", "uniform",
                      "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")])
    assert [r["variant"] for r in res["rows"]] == ["none", "resample"] and set(res["summary"]) == {"none", "resample"}
    assert res["workload"]["resample_weighting"].startswith("uniform")
    assert res["rows"][1]["resampled_total"] > 0
