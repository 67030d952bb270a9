from __future__ import annotations

import pytest
import torch

from benchmarks import callbacks_overhead
from benchmarks._results import load_result


def _bench():
    return callbacks_overhead


def test_schedule_puts_the_baseline_around_every_group_and_alternates_the_order():
    order = _bench().schedule(["none", "a", "b", "c", "d"], "none", rounds=2, per_baseline=3)
    assert order == [(0, "none"), (0, "a"), (0, "b"), (0, "c"), (0, "none"), (0, "d"), (0, "none"),
                     (1, "d"), (1, "c"), (1, "b"), (1, "none"), (1, "a"), (1, "none")]


def test_overhead_is_taken_against_the_baseline_interpolated_between_its_runs():
    """The baseline drifts linearly from run to run; a variant 1% slower than the baseline at its own time gets
    exactly +1%, whatever the drift (the nearest baseline run alone would give 1.01 * 103 / 102 - 1 here)."""
    bench = _bench()
    order = bench.schedule(["none", "a", "b"], "none", rounds=2, per_baseline=2)
    runs = []
    for i, (rnd, name) in enumerate(order):
        base = 100.0 + i  # the device slows down by 1 ms per run
        ms = base * (1.01 if name == "a" else 1.0)
        runs.append({"variant": name, "round": rnd, "order": i, "median_step_ms": ms, "mean_step_ms": ms,
                     "step_ms": [ms]})
    summary = bench.summarize(runs, "none")
    assert summary["a"]["overhead_vs_none_rounds"] == pytest.approx([0.01, 0.01])
    assert summary["b"]["overhead_vs_none"] == pytest.approx(0.0, abs=1e-12)
    assert summary["a"]["overhead_spread"]["n"] == 2
    assert summary["none"]["overhead_vs_none"] == 0.0


def test_smoke_runs_both_workloads_and_checks_the_skip(tmp_path):
    out = tmp_path / "overhead.json"
    report = _bench().main(["--smoke", "--out", str(out)])
    assert load_result(out)["results"]["attribution"].keys() == report["attribution"].keys()
    for name in ("none", "nanskip", "lossclamp", "asyncckpt", "evalthrottle", "cudamem", "speedmon", "all6",
                 "lightning_throughput_monitor", "all6_nanskip_host_mode"):
        assert "errors" not in report["results"][name], report["results"][name].get("errors")
        assert report["results"][name]["median_step_ms"] > 0
    assert "overhead_vs_none" in report["attribution"]["all6"]
    speedrun = report["speedrun"]
    assert speedrun["optimizer"] == "CombinedOptimizer(Muon, AdamW)"
    assert "overhead_vs_none" in speedrun["summary"]["speedrun_all6"]
    # a NaN loss at one step: every parameter and optimizer tensor unchanged across it, Muon's counter too
    assert report["skip_check"]["main"]["ok"], report["skip_check"]["main"]
    assert report["skip_check"]["speedrun"]["ok"], report["skip_check"]["speedrun"]
    before, after = report["skip_check"]["speedrun"]["muon_steps_done_before_and_after_the_next_step"]
    assert after == [before[0] + 1]
    costs = report["device_costs"]
    assert costs["main_gradient_check"]["nan_skip_check_ms"] > 0
    assert costs["speedrun_muon_flagged_copy"]["tensors"] > 0


def test_a_failing_speedrun_workload_keeps_the_main_results(tmp_path, monkeypatch):
    bench = _bench()

    def broken(settings, nan_at=None):
        raise RuntimeError("no such model")

    monkeypatch.setattr(bench, "speedrun_module", broken)
    report = bench.main(["--smoke", "--variants", "none,nanskip", "--out", str(tmp_path / "o.json")])
    assert "overhead_vs_none" in report["attribution"]["nanskip"]
    assert "no such model" in report["speedrun"]["error"]
    assert report["speedrun_attribution"] is None


def test_costs_only_speedrun_and_the_paths_nan_skip_took(tmp_path):
    """``--speedrun-rounds 0`` keeps the flagged copy's device cost without speedrun runs; the costs are measured on
    the device the runs train on (the modules are back on the host after a fit), and each NaNSkip run says which
    check and which way of applying the skip it took."""
    report = _bench().main(["--smoke", "--variants", "none,nanskip", "--speedrun-rounds", "0",
                            "--out", str(tmp_path / "o.json")])
    assert report["speedrun"] == {"device_costs_only": True}
    costs = report["device_costs"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert costs["main_gradient_check"]["device"] == costs["speedrun_muon_flagged_copy"]["device"] == dev
    assert costs["main_gradient_check"]["torch_check_ms"] > 0
    assert costs["speedrun_muon_flagged_copy"]["good_step_ms"] > 0
    paths = report["results"]["nanskip"]["runs"][0]["nan_skip"]["paths"]
    assert paths["check"] == costs["main_gradient_check"]["nan_skip_check_path"]
    assert paths["0:AdamW"] == ("found_inf" if dev == "cuda" else "flagged_copy_torch")
