"""The scaling benchmarks end to end on CPU: real gloo process groups (4 for the CLT strategies, 2 for GPT-2
DDP), the JSON they write, and the page made from it."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest

from benchmarks._results import load_result, payload
from benchmarks.clt_scaling import default_gpus
from benchmarks.gpt2_ddp_scaling import _interpolate
from benchmarks.scaling_report import COMMANDS, write_report

ROOT = Path(__file__).resolve().parents[2]
CLT_SMOKE_4 = ("clt_scaling.py", "--smoke", "--gpus", "1", "2", "4")  # 1, 2 and 4 gloo processes


def _run(script: str, *args: str) -> None:
    """``python -m benchmarks.<script> ARGS`` from the repository root, in this process: the smoke runs fork their
    gloo ranks from here instead of starting an interpreter that imports torch and Lightning again."""
    module = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        patch.setattr(sys, "argv", [script, *args])
        module.main()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scaling_results")
    _run(*CLT_SMOKE_4, "--no-peer", "--out", str(out / "clt_scaling_4gpu.json"))
    _run("gpt2_ddp_scaling.py", "--smoke", "--out", str(out / "gpt2_ddp_scaling_smoke.json"))
    return out


def _unused_in_smoke_model() -> list[str]:
    from dataclasses import replace

    from benchmarks.gpt2_common import load_yaml_config
    from benchmarks.gpt2_ddp_scaling import SMOKE_SHAPE, freeze_unused
    from lightning_opt.models.gpt2 import GPT

    cfg = replace(load_yaml_config("gpt2-124m-speedrun", geometry="short")[0], block_size=64, **SMOKE_SHAPE)
    model = GPT(cfg)
    unused = freeze_unused(model)
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind
    return unused


def _load(path: Path) -> dict:
    """A result file, checked against the schema, as the page generators see it (results beside env, command)."""
    return payload(load_result(path))


def _env_ok(data: dict) -> None:
    env = data["env"]
    assert env["torch"] and env["lightning"] and "--smoke" in data["command"]
    assert env["device"].startswith("cpu")


def test_clt_scaling_runs_every_strategy_at_1_2_4_processes(results):
    data = _load(results / "clt_scaling_4gpu.json")
    _env_ok(data)
    assert data["sizes"] == [1, 2, 4] and data["scaling_run"] is True
    rows = {(r["variant"], r["features_per_layer"]): r for r in data["rows"]}
    assert set(rows) == {
        (v, 64)
        for v in [
            "ours_1gpu",
            "ours_global_batchtopk_2gpu",
            "ours_decoder_sharding_sharded_encoder_2gpu",
            "ours_global_batchtopk_4gpu",
            "ours_decoder_sharding_sharded_encoder_4gpu",
            "ours_2d_sharded_encoder_4gpu",
        ]
    }  # the 2D mesh needs two data groups of 2: only at 4
    base = rows[("ours_1gpu", 64)]
    k = data["config"]["k"]
    for r in rows.values():
        assert "error" not in r and r["tokens_per_s"] > 0
        assert r["tokens_per_step"] == 64  # the same global batch at every size
        assert r["active_per_token"] == pytest.approx(k, abs=1e-9) and r["l0_is_k"]
        # efficiency from the measured numbers: tokens/s at N / (N x tokens/s at 1)
        assert r["scaling_efficiency"] == pytest.approx(
            r["tokens_per_s"] / (r["world"] * base["tokens_per_s"])
        )
        if r["world"] > 1:
            assert r["bytes_per_step_total"] > 0
    two_d = rows[("ours_2d_sharded_encoder_4gpu", 64)]
    assert (two_d["data_parallel_size"], two_d["model_parallel_size"], two_d["tokens_per_rank"]) == (2, 2, 32)
    assert 0 < two_d["grad_allreduce_bytes_per_step_2d"] <= two_d["collective_bytes_per_step_ours"]
    dp = rows[("ours_global_batchtopk_4gpu", 64)]
    assert dp["tokens_per_rank"] == 16 and dp["ddp_grad_allreduce_bytes_per_step"] == 4 * dp["params"]


def test_gpt2_ddp_scaling_same_optimisation_at_every_size(results):
    data = _load(results / "gpt2_ddp_scaling_smoke.json")
    _env_ok(data)
    assert data["env"]["devices"] == []  # no CUDA here; GPU names are listed per device on a GPU machine
    rows = {r["world"]: r for r in data["rows"]}
    assert set(rows) == {1, 2}
    assert rows[1]["accum"] == 2 * rows[2]["accum"]
    assert rows[1]["global_tokens_per_step"] == rows[2]["global_tokens_per_step"]
    for r in rows.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["steps"] == data["settings"]["steps"]
        # plain DDP runs: parameters no loss reaches (if the model has any) are frozen before wrapping
        assert r["unused_params_frozen"] == _unused_in_smoke_model()
        assert r["scaling_efficiency"] == pytest.approx(
            r["tokens_per_s"] / (r["world"] * rows[1]["tokens_per_s"]), rel=1e-3
        )
        assert math.isfinite(r["final_val_loss"])
    # same global batch and data: 2 DDP processes train the same model as 1 process with twice the accumulation
    assert rows[2]["final_val_loss"] == pytest.approx(rows[1]["final_val_loss"], abs=2e-3)
    t = data["target_run"]
    assert "error" not in t and t["world"] == 2 and t["target_loss"] == data["goals"]["loss"]
    curve = t["val_curve"]
    assert t["reached_target"] == any(p["val_loss"] <= t["target_loss"] for p in curve)
    if t["reached_target"]:
        hit = next(i for i, p in enumerate(curve) if p["val_loss"] <= t["target_loss"])
        lo = curve[hit - 1]["train_s"] if hit else 0.0
        assert lo <= t["time_to_target_s"] <= curve[hit]["train_s"]
        assert t["stopped"] == "target reached" or curve[hit]["step"] == t["steps"]
        assert t["steps"] == curve[hit]["step"]  # every rank stopped at the same validation
        est = data["summary"]["estimated_time_to_target_s"]
        assert est["1"] == pytest.approx(t["steps_to_target"] * rows[1]["step_ms"] / 1e3, abs=0.01)


def test_report_tables_and_plot_from_the_smoke_results(results, tmp_path):
    page = write_report(results, tmp_path / "scaling.md", include_smoke=True)
    text = page.read_text()
    assert (tmp_path / "img" / "scaling.png").stat().st_size > 10_000
    assert "ours_2d_sharded_encoder | 64 | 4 | strong | 64 | 2 x 2 |" in text
    gpt2 = _load(results / "gpt2_ddp_scaling_smoke.json")
    tps = {r["world"]: r["tokens_per_s"] for r in gpt2["rows"]}
    eff2 = tps[2] / (2 * tps[1])  # recomputed by the report from the measured tokens/s
    assert f"| {eff2:.1%} |" in text
    assert "Time to val loss" in text


def test_report_without_results_says_pending_with_the_commands(tmp_path):
    (tmp_path / "results").mkdir()
    page = write_report(tmp_path / "results", tmp_path / "docs" / "scaling.md")
    text = page.read_text()
    assert text.count("GPU figures: pending") >= 2
    assert COMMANDS[4] in text and COMMANDS[8] in text and ".data/novels" in text
    assert not (tmp_path / "docs" / "img" / "scaling.png").exists()


def test_interpolation_and_default_sizes():
    curve = [{"step": 4, "train_s": 2.0, "val_loss": 5.0}, {"step": 8, "train_s": 4.0, "val_loss": 4.0}]
    assert _interpolate(curve, 4.5, "train_s") == pytest.approx(3.0)
    assert _interpolate(curve, 4.5, "step") == pytest.approx(6.0)
    assert _interpolate(curve, 3.0, "step") is None
    assert _interpolate(curve, 5.5, "step") == 4.0
    assert [default_gpus(n) for n in (0, 1, 2, 4, 6, 8)] == [
        [1],
        [1],
        [1, 2],
        [1, 2, 4],
        [1, 2, 4],
        [1, 2, 4, 8],
    ]


def test_no_time_left_skips_every_size_and_still_writes_the_json(tmp_path):
    _run(*CLT_SMOKE_4, "--deadline-s", "1", "--out", str(tmp_path / "c.json"))
    _run("gpt2_ddp_scaling.py", "--smoke", "--deadline-s", "1", "--out", str(tmp_path / "g.json"))
    clt = _load(tmp_path / "c.json")
    assert len(clt["rows"]) == 6 and all("skipped" in r and "tokens_per_s" not in r for r in clt["rows"])
    gpt2 = _load(tmp_path / "g.json")
    assert [r["world"] for r in gpt2["rows"]] == [1, 2] and all("skipped" in r for r in gpt2["rows"])
    assert "skipped" in gpt2["target_run"] and gpt2["summary"]["tokens_per_s"] == {}


def test_freeze_unused_finds_parameters_no_loss_reaches():
    import torch

    from benchmarks.gpt2_ddp_scaling import freeze_unused

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Embedding(10, 4)
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return self.used(idx).square().mean()

    model = Toy()
    assert freeze_unused(model) == ["unused.weight", "unused.bias"]
    assert model.used.weight.requires_grad and not model.unused.weight.requires_grad
    assert model.used.weight.grad is None  # the probe's gradient is not left for the first step


def test_clt_weak_scaling_rows_and_profiled_step(tmp_path):
    """--weak: data-parallel rows at fixed tokens per GPU beside the strong ones; --profile: one extra step per
    rank of the named variant, split into compute, collective-only and idle time (all summing to its window)."""
    _run(
        "clt_scaling.py", "--smoke", "--weak", "--gpus", "1", "2", "--no-peer", "--features", "64",
        "--variants", "ours_1gpu", "ours_global_batchtopk_bf16grad", "ours_decoder_sharding_sharded_encoder",
        "--profile", "ours_decoder_sharding_sharded_encoder_2gpu", "--out", str(tmp_path / "clt_scaling_weak.json"),
    )  # fmt: skip
    data = _load(tmp_path / "clt_scaling_weak.json")
    k, tokens = data["config"]["k"], data["config"]["tokens"]
    rows = {(r["variant"], r["features_per_layer"], r["scaling"]): r for r in data["rows"]}
    dp = "ours_global_batchtopk_bf16grad_2gpu"
    se = "ours_decoder_sharding_sharded_encoder_2gpu"
    assert set(rows) == {
        ("ours_1gpu", 64, "strong"), (dp, 64, "strong"), (dp, 64, "weak"), (se, 64, "strong"),
    }  # weak rows only for the data-parallel kinds
    for (variant, features, _), r in rows.items():
        assert "error" not in r and r["l0_is_k"] and r["active_per_token"] == pytest.approx(k, abs=1e-9)
        base = rows[("ours_1gpu", features, "strong")]
        assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_s"] / (r["world"] * base["tokens_per_s"]))
        assert ("profile" in r) == (variant == se)
    weak, strong = rows[(dp, 64, "weak")], rows[(dp, 64, "strong")]
    assert (weak["tokens_per_rank"], weak["tokens_per_step"]) == (tokens, 2 * tokens)
    assert (strong["tokens_per_rank"], strong["tokens_per_step"]) == (tokens // 2, tokens)
    assert weak["tokens_per_s"] == pytest.approx(weak["tokens_per_step"] / (weak["step_ms"] / 1e3))
    # the 16-bit comm hook is saved with the run (fp16 on gloo: torch's bf16 hook needs NCCL); half the bytes
    assert weak["grad_compression"] == strong["grad_compression"] == "fp16"
    assert weak["ddp_grad_allreduce_bytes_per_step"] == 2 * weak["params"]
    profile = rows[(se, 64, "strong")]["profile"]
    assert len(profile) == 2  # one per rank
    for p in profile:
        assert p["timeline"] == "cpu_ops" and p["window_ms"] > 0
        parts = (p["compute_ms"], p["collective_only_ms"], p["idle_ms"])
        assert min(parts) >= 0 and sum(parts) == pytest.approx(p["window_ms"], rel=1e-6)
        assert 0 < p["collective_ms"] <= p["window_ms"]  # the candidates' gather and the loss all-reduce
        top = p["top_kernels"]
        assert 0 < len(top) <= 10 and [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    page = write_report(tmp_path, tmp_path / "scaling.md", include_smoke=True).read_text()
    assert (
        f"| ours_global_batchtopk_bf16grad | fp16 | 64 | 2 | {weak['scaling_efficiency']:.1%} | "
        f"{strong['scaling_efficiency']:.1%} |" in page
    )
    p0 = rows[(se, 64, "strong")]["profile"][0]
    assert f"| ours_decoder_sharding_sharded_encoder | 64 | 2 | strong | 0 | {p0['window_ms']:.2f} |" in page
