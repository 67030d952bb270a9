"""benchmarks/gpt2_speedrun.py --smoke: the classic rows run through the real Trainer, and the shipped classic config
(fused loss) learns exactly what the same config with the torch loss learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import gpt2_speedrun
from benchmarks._results import load_result
from lightning_opt.data.shards import write_shard

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_classic_fused_and_torch_loss_rows(tmp_path):
    bench = gpt2_speedrun
    block = np.random.default_rng(0).integers(0, 512, 37)  # a repeated phrase: the loss falls in a few steps
    data = tmp_path / "data"
    write_shard(data / "tiny_train_000000.bin", np.tile(block, 200_000 // 37))
    write_shard(data / "tiny_val_000000.bin", np.tile(block, 20_000 // 37))
    out = tmp_path / "speedrun.json"
    rows = ("ours-classic-lightning", "ours-classic-torchloss-lightning", "ours-classic-nobias-lightning",
            "ours-classic-mb64-lightning", "ours-classic-cudnn-lightning")
    payload = bench.main(["--smoke", "--data-dir", str(data), "--only", ",".join(rows), "--out", str(out)])
    assert load_result(out)["results"]["results"].keys() == set(rows)
    for r in payload["results"].values():
        assert "error" not in r, r.get("traceback")
        assert r["tokens_per_s"] > 0 and r["runner"] == "lightning"
    fused, torch_loss, nobias, mb64, cudnn = (payload["results"][r] for r in rows)
    assert cudnn["spec"]["execution"]["attn_backend"] == "cudnn"
    assert {**cudnn["spec"]["execution"], "attn_backend": None} == {**fused["spec"]["execution"], "attn_backend": None}
    assert nobias["spec"]["model"]["bias"] is False and fused["spec"]["model"]["bias"] is True
    assert mb64["spec"]["micro_batch"] == 2 * fused["spec"]["micro_batch"]
    assert mb64["spec"]["tokens_per_step"] == fused["spec"]["tokens_per_step"]
    assert fused["spec"]["execution"]["loss_impl"] == "fused"
    assert torch_loss["spec"]["execution"]["loss_impl"] == "torch"
    # same model, data and maths: the same validation curve up to float32 rounding
    a = [p["val_loss"] for p in fused["val_curve"]]
    b = [p["val_loss"] for p in torch_loss["val_curve"]]
    assert len(a) == len(b) >= 2 and a[-1] < a[0]
    assert a == pytest.approx(b, rel=1e-4, abs=1e-4)
    # a CPU has no cuDNN attention: the cudnn backend falls to SDPA's CPU kernels and learns the same
    assert [p["val_loss"] for p in cudnn["val_curve"]] == pytest.approx(a, rel=1e-4, abs=1e-4)
    ratio = payload["summary"]["classic_fused_loss_over_torch_loss"]
    assert ratio == pytest.approx(fused["tokens_per_s"] / torch_loss["tokens_per_s"], rel=1e-3)
    assert payload["summary"]["goal_classic_ge_1p05x_nanogpt"] is None  # no nanoGPT row in this call


def test_smoke_repeats_alternate_the_order_and_report_the_median(tmp_path):
    """--repeats 2: the row list forward then reversed (A B C C B A); each row's step time is the median of its
    repeats; the coordinate-descent row is the classic config with that inductor option, nanoGPT compiles with
    inductor's defaults."""
    bench = gpt2_speedrun
    data = tmp_path / "data"
    block = np.random.default_rng(1).integers(0, 512, 41)
    write_shard(data / "tiny_train_000000.bin", np.tile(block, 100_000 // 41))
    write_shard(data / "tiny_val_000000.bin", np.tile(block, 10_000 // 41))
    rows = ["ours-classic-lightning", "ours-classic-cdt-lightning"]
    if (ROOT / ".peers" / "nanoGPT" / "model.py").exists():
        rows.insert(0, "nanogpt-bias")
    payload = bench.main(["--smoke", "--data-dir", str(data), "--only", ",".join(rows), "--repeats", "2",
                          "--out", str(tmp_path / "speedrun.json")])
    res = payload["results"]
    n = len(rows)
    for i, name in enumerate(rows):
        r = res[name]
        assert "error" not in r, r.get("traceback")
        assert [p["position"] for p in r["repeats"]] == [i, 2 * n - 1 - i]
        steps = [p["step_ms"] for p in r["repeats"]]
        assert r["step_ms"] == pytest.approx(sum(steps) / 2, abs=0.01)
        assert r["tokens_per_s"] == pytest.approx(r["spec"]["tokens_per_step"] / r["step_ms"] * 1000, rel=1e-3)
    classic, cdt = res["ours-classic-lightning"]["spec"], res["ours-classic-cdt-lightning"]["spec"]
    assert cdt["compile_options"] == {**(classic["compile_options"] or {}), "coordinate_descent_tuning": True}
    assert {**cdt, "compile_options": None} == {**classic, "compile_options": None}
    if "nanogpt-bias" in res:
        assert res["nanogpt-bias"]["spec"]["compile_options"] is None
        peer = res["nanogpt-bias"]["spec"]["execution"]
        assert (peer["attn_backend"], peer["loss_impl"]) == ("sdpa", "torch")
    assert payload["summary"]["classic_cdt_lightning_over_classic_lightning"] == pytest.approx(
        res["ours-classic-cdt-lightning"]["tokens_per_s"] / res["ours-classic-lightning"]["tokens_per_s"], rel=1e-3)


def test_median_row_keeps_failed_repeats_and_the_median_of_the_timed_ones():
    median_row = gpt2_speedrun.median_row
    rows = [{"position": 0, "step_ms": 100.0, "tokens_per_s": 1000.0, "mfu": 0.4, "spec": {}},
            {"position": 3, "error": "OutOfMemoryError"},
            {"position": 4, "step_ms": 104.0, "tokens_per_s": 961.5, "mfu": 0.3846},
            {"position": 7, "step_ms": 101.0, "tokens_per_s": 990.1, "mfu": 0.396}]
    r = median_row(rows)
    assert r["step_ms"] == 101.0 and r["tokens_per_s"] == pytest.approx(990.1, abs=0.1)
    assert r["mfu"] == pytest.approx(0.396, abs=1e-4) and r["step_ms_spread_pct"] == pytest.approx(4.0)
    assert [p.get("error") for p in r["repeats"]] == [None, "OutOfMemoryError", None, None]
    assert median_row([rows[1]])["error"] == "OutOfMemoryError"


def test_classic_goal_takes_the_faster_geometry_of_each():
    summarize = gpt2_speedrun.summarize
    res = {"nanogpt": {"tokens_per_s": 100.0}, "nanogpt-mb64": {"tokens_per_s": 102.0},
           "ours-classic-lightning": {"tokens_per_s": 104.0}, "ours-classic-mb64-lightning": {"tokens_per_s": 108.0},
           "ours-classic-torchloss-lightning": {"tokens_per_s": 100.0}}
    s = summarize(res)
    assert s["best_classic_lightning_over_best_nanogpt"] == pytest.approx(108 / 102, abs=1e-4)
    assert s["goal_classic_ge_1p05x_nanogpt"] is True
    assert s["classic_fused_loss_over_torch_loss"] == pytest.approx(1.04)
    assert summarize({**res, "ours-classic-mb64-lightning": {"tokens_per_s": 99.0}})["goal_classic_ge_1p05x_nanogpt"] is False


def test_classic_goal_compares_the_same_architecture_when_both_ran():
    summarize = gpt2_speedrun.summarize
    res = {"nanogpt": {"tokens_per_s": 110.0}, "nanogpt-bias": {"tokens_per_s": 98.0},
           "nanogpt-bias-mb64": {"tokens_per_s": 100.0}, "ours-classic-lightning": {"tokens_per_s": 106.0},
           "ours-classic-nobias-lightning": {"tokens_per_s": 116.0}}
    s = summarize(res)
    assert s["best_classic_lightning_over_best_nanogpt_bias"] == pytest.approx(1.06)
    assert s["classic_nobias_lightning_over_nanogpt"] == pytest.approx(116 / 110, abs=1e-4)
    assert s["goal_classic_ge_1p05x_nanogpt"] is True  # 1.06 with biases, 1.0545 without
    slower = summarize({**res, "ours-classic-nobias-lightning": {"tokens_per_s": 112.0}})
    assert slower["goal_classic_ge_1p05x_nanogpt"] is False  # the pair without biases is at 1.018


def test_smoke_val_every_zero_validates_once_after_the_last_step(tmp_path):
    """--val-every 0: one validation, at the last optimizer step, inside Trainer.fit (after fit, Lightning has
    moved the module back to the CPU); the run's final loss is that point's."""
    bench = gpt2_speedrun
    data = tmp_path / "data"
    block = np.random.default_rng(2).integers(0, 512, 43)
    write_shard(data / "tiny_train_000000.bin", np.tile(block, 100_000 // 43))
    write_shard(data / "tiny_val_000000.bin", np.tile(block, 10_000 // 43))
    payload = bench.main(["--smoke", "--data-dir", str(data), "--only", "ours-classic-lightning,ours-classic-bare",
                          "--val-every", "0", "--out", str(tmp_path / "speedrun.json")])
    assert payload["settings"]["val_every"] == 0
    for r in payload["results"].values():
        assert "error" not in r, r.get("traceback")
        assert [p["step"] for p in r["val_curve"]] == [r["steps"]] == [payload["settings"]["steps"]]
        assert r["final_val_loss"] == r["val_curve"][0]["val_loss"]
