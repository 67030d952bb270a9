"""The pure helpers behind the GPT-2 GPU benchmarks: the record-script patch, its log parser, time to target."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.gpt2_record import (
    OURS_VARIANTS,
    ours_spec,
    parse_model_override,
    parse_record_log,
    summarize,
    time_to_target,
)
from benchmarks.peers.patch_record import SEPARATOR, patch, record_code

# a stand-in for a record log: code with the four hyperparameters, the separator, then log lines
CODE = """import os
class Hyperparameters:
    train_bin = 'data/fineweb10B/fineweb_train_*.bin' # input .bin to train on
    val_bin = 'data/fineweb10B/fineweb_val_*.bin' # input .bin to eval validation loss on
    num_iterations = 1390 # number of iterations to run
    val_tokens = 10485760 # how many tokens of validation data?
print0('=' * 100)
"""
LOG = CODE + SEPARATOR + "\nstep:0/1390 val_loss:10.8258 train_time:0ms step_avg:nanms\n"


def test_patch_changes_exactly_four_values():
    code = record_code(LOG)
    assert code == CODE
    out = patch(code, "/d/train.bin", "/d/val.bin", 127, 1048576)
    changed = [(a, b) for a, b in zip(code.splitlines(), out.splitlines()) if a != b]
    assert len(changed) == 4 and len(out.splitlines()) == len(code.splitlines())
    assert "train_bin = '/d/train.bin' # input" in out
    assert "num_iterations = 127 #" in out and "val_tokens = 1048576 #" in out


@pytest.mark.parametrize("text, match", [
    (CODE.replace("    num_iterations = 1390", "    iterations = 1390"), "iterations"),
    (CODE + "    val_tokens = 5\n", "val tokens"),
])
def test_patch_refuses_other_files(text, match):
    with pytest.raises(ValueError, match=match):
        patch(text, "a", "b", 1, 1)


def test_record_code_needs_separator():
    with pytest.raises(ValueError, match="not a modded-nanogpt record log"):
        record_code(CODE)


def test_parse_record_log_adds_back_the_untimed_steps():
    lines = ["step:0/20 val_loss:10.8000 train_time:0ms step_avg:nanms",
             "step:1/20 train_time:70000ms step_avg:nanms"]
    lines += [f"[rank0]:step:{s}/20 train_time:{(s - 10) * 1000}ms step_avg:1000.00ms" for s in range(11, 21)]
    lines += ["step:20/20 val_loss:5.5000 train_time:10000ms step_avg:1000.00ms",
              "peak memory consumption: 2048 MiB"]
    out = parse_record_log("\n".join(lines))
    assert out["tokens_per_s"] == pytest.approx(524288.0)
    assert out["final_val_loss"] == 5.5 and out["steps"] == 20
    assert out["record_train_s"] == 10.0 and out["record_train_s_adjusted"] == 20.0
    assert out["compile_s"] == pytest.approx(69.0) and out["peak_mem_gb"] == 2.0


def test_time_to_target_interpolates():
    curve = [{"step": 8, "val_loss": 6.0, "train_s": 8.0}, {"step": 16, "val_loss": 5.0, "train_s": 16.0},
             {"step": 24, "val_loss": 4.0, "train_s": 24.0}]
    row, t = time_to_target(curve, 4.5)
    assert row["step"] == 24 and t == pytest.approx(20.0)
    assert time_to_target(curve, 3.0) == (None, None)
    assert time_to_target(curve, 6.5)[1] == 8.0


def test_summarize_ratios_under_both_clock_rules():
    record = {"record_train_s": 90.0, "record_train_s_adjusted": 100.0, "tokens_per_s": 400.0}
    curve = [{"step": 8, "val_loss": 5.0, "train_s": 60.0}, {"step": 16, "val_loss": 4.0, "train_s": 80.0}]
    ours = {"val_curve": curve, "step_ms": 500.0, "tokens_per_s": 500.0, "final_val_loss": 4.0}
    s = summarize(record, ours, 4.5)
    assert s["ours_time_to_target_s_interpolated"] == pytest.approx(70.0)
    # every step counted on both sides: 70 / 100
    assert s["time_ratio_ours_over_record"] == pytest.approx(0.7) and s["goal_le_0p75"] is True
    # the record's own clock (first 10 steps left out) against ours without its first 10 steps: 65 / 90
    assert s["time_ratio_both_without_first_10_steps"] == pytest.approx(65 / 90, abs=1e-4)
    # a half-batch variant: the record's first 10 steps of tokens are 20 of ours: (70 - 10) / 90
    half = summarize(record, {**ours, "variant": {"accum": 8}}, 4.5)
    assert half["time_ratio_both_without_first_10_record_steps_of_tokens"] == pytest.approx(60 / 90, abs=1e-4)
    assert s["time_ratio_both_without_first_10_record_steps_of_tokens"] == pytest.approx(65 / 90, abs=1e-4)
    assert s["tokens_per_s_ratio_ours_over_record"] == pytest.approx(1.25)
    assert summarize(record, {"val_curve": curve}, 3.0)["ours_reached_target"] is False


def test_ours_spec_budget_and_micro_batch_keep_tokens_per_step():
    args = argparse.Namespace(steps=127, ours_val_every=4, smoke=False, ours_loss_impl=None, ours_micro_batch=64)
    accum, long, budget = OURS_VARIANTS["half-batch-85"]
    spec = ours_spec(args, 4.3, accum, long, budget)
    assert spec.steps == round(127 * 2 * 0.85) and spec.stop_at_loss == 4.3
    assert spec.micro_batch * spec.accum * spec.seq_len == 262_144  # half the record's 524,288 tokens per step
    with pytest.raises(ValueError, match="budget"):
        ours_spec(args, 4.3, 8, False, 1.5)
    with pytest.raises(ValueError, match="micro-batch"):
        ours_spec(argparse.Namespace(**{**vars(args), "ours_micro_batch": 48}), 4.3, 8, False, 1.0)
    # model overrides read as YAML values, validated by GPTConfig / GPTExecution
    assert parse_model_override("mlp_fp8=auto") == ("mlp_fp8", "auto")
    assert parse_model_override("logit_softcap=30") == ("logit_softcap", 30)
    spec = ours_spec(argparse.Namespace(**{**vars(args), "ours_model": ["mlp_fp8=true"]}), 4.3, 8, False, 1.0)
    assert spec.execution.mlp_fp8 is True
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_model_override("mlp_fp8")
    with pytest.raises(ValueError, match="mlp_fp8"):
        ours_spec(argparse.Namespace(**{**vars(args), "ours_model": ["mlp_fp8=maybe"]}), 4.3, 8, False, 1.0)


def test_parse_record_log_of_an_unfinished_run_sets_no_target():
    out = parse_record_log("step:0/127 val_loss:10.8258 train_time:0ms step_avg:nanms\n"
                           "step:1/127 train_time:90000ms step_avg:nanms\n")
    assert out["final_val_loss"] is None and out["last_val_loss"] == 10.8258


def test_oom_retry_halves_the_micro_batch_and_keeps_tokens_per_step():
    import torch

    from benchmarks.gpt2_common import Deadline, RunSpec, guarded, oom_retry
    from lightning_opt.models.gpt2 import GPTConfig
    from lightning_opt.optim.factory import OptimConfig
    from lightning_opt.optim.schedules import ScheduleConfig

    spec = RunSpec(GPTConfig(n_layer=1), OptimConfig(), ScheduleConfig(), micro_batch=32, accum=2, val_batch=32)
    seen = []

    def run(s):
        seen.append((s.micro_batch, s.accum))
        if s.micro_batch > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"tokens_per_s": 1.0}

    out = oom_retry(run, spec)
    assert seen == [(32, 2), (16, 4), (8, 8)] and len(out["oom_fallback"]) == 2
    # an error that persists is recorded by guarded, not raised; a variant past the deadline is skipped
    failed = guarded("v", lambda: oom_retry(lambda s: run(RunSpec(**{**s.__dict__, "micro_batch": 64})), spec))
    assert failed["name"] == "v" and "out of memory" in failed["error"] and failed["oom"] is True
    assert "skipped" in guarded("late", lambda: {}, Deadline(1.0), need_s=5.0)


def test_recipe_variants_and_the_no_fp8_matmul_variant():
    """The recipe turns the FP8 MLP / attention projections on ('auto'); the -nofp8mm record variant of ours
    turns exactly those two off."""
    args = argparse.Namespace(steps=127, ours_val_every=4, smoke=False, ours_loss_impl=None, ours_micro_batch=64)
    spec = ours_spec(args, 4.3, *OURS_VARIANTS["half-batch-85"])
    ex = spec.execution
    assert ex.mlp_fp8 == "auto" and ex.attn_fp8 == "auto" and ex.head_fp8 == "auto"
    accum, long, budget, overrides = OURS_VARIANTS["half-batch-85-nofp8mm"]
    assert (accum, long, budget) == OURS_VARIANTS["half-batch-85"]
    assert overrides == {"mlp_fp8": False, "attn_fp8": False}


def test_speedrun_summary_goals_from_the_64_sequence_pair():
    from benchmarks.gpt2_speedrun import summarize as speed_summary

    res = {"nanogpt": {"tokens_per_s": 100.0}, "nanogpt-mb64": {"tokens_per_s": 104.0},
           "ours-speedrun-mb64-bare": {"tokens_per_s": 120.0}, "ours-speedrun-mb64-lightning": {"tokens_per_s": 117.0},
           "ours-speedrun-nofp8mm-mb64-lightning": {"tokens_per_s": 99.0}}
    s = speed_summary(res)
    assert s["lightning_overhead_pct_speedrun_mb64"] == pytest.approx(2.5)
    assert s["goal_lightning_overhead_le_2pct"] is False  # 2.5% > 2%
    assert s["best_ours_lightning_over_best_nanogpt"] == pytest.approx(117 / 104, abs=1e-4)
    assert s["goal_speedrun_ge_1p1x_nanogpt"] is True
    # the variants without the recipe's options are reported, never counted as the recipe
    assert s["best_ours_lightning_tokens_per_s"] == 117.0
    assert speed_summary({**res, "ours-speedrun-mb64-lightning": {"tokens_per_s": 110.0}})[
        "goal_speedrun_ge_1p1x_nanogpt"] is False


def test_record_variants_apply_model_and_optimizer_overrides():
    from benchmarks.gpt2_record import apply_overrides

    args = argparse.Namespace(steps=127, ours_val_every=4, smoke=False, ours_loss_impl=None, ours_micro_batch=64)
    accum, long, budget, overrides = OURS_VARIANTS["half-batch-85-polar"]
    spec = apply_overrides(ours_spec(args, 4.3, accum, long, budget), overrides)
    assert spec.optim.muon_ns_coefficients == "polar_express" and spec.execution.mlp_fp8 == "auto"
    assert overrides == {"optim": {"muon_ns_coefficients": "polar_express"}}  # the table is not consumed
    spec = apply_overrides(ours_spec(args, 4.3, accum, long, budget), OURS_VARIANTS["half-batch-85-nofp8mm"][3])
    assert spec.execution.mlp_fp8 is False and spec.optim.muon_ns_coefficients == "jordan"
    spec = apply_overrides(ours_spec(args, 4.3, accum, long, budget), OURS_VARIANTS["half-batch-85-cdt"][3])
    assert spec.compile_options["coordinate_descent_tuning"] is True and spec.model == ours_spec(
        args, 4.3, accum, long, budget).model
    # a window override replaces the long geometry's window schedule and nothing else of the model
    accum, long, budget, overrides = OURS_VARIANTS["half-batch-long-80-w1856"]
    plain = ours_spec(args, 4.3, accum, long, budget)
    spec = apply_overrides(plain, overrides)
    assert plain.model.window_schedule == (128, 1024) and spec.model.window_schedule == (128, 1856)
    assert spec.model.doc_causal and replace(spec.model, window_schedule=plain.model.window_schedule) == plain.model


def test_find_shards_reads_the_data_dir_argument_then_the_environment(tmp_path, monkeypatch):
    from benchmarks.gpt2_common import DATA_DIR, DATA_DIR_ENV, find_shards

    arg_dir, env_dir = tmp_path / "arg", tmp_path / "env"
    for d in (arg_dir, env_dir):
        d.mkdir()
        for split in ("train", "val"):
            (d / f"novels_{split}_000000.bin").write_bytes(b"")
    monkeypatch.setenv(DATA_DIR_ENV, str(env_dir))
    assert find_shards(str(arg_dir))[0] == arg_dir / "novels_train_000000.bin"  # --data-dir wins
    assert find_shards()[1] == env_dir / "novels_val_000000.bin"  # then LIGHTNING_OPT_DATA_DIR
    monkeypatch.delenv(DATA_DIR_ENV)
    if not (DATA_DIR / "novels_train_000000.bin").exists():  # then .data/novels; the error says how to set it
        with pytest.raises(FileNotFoundError, match=f"--data-dir DIR, set {DATA_DIR_ENV}=DIR"):
            find_shards()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        find_shards(str(tmp_path / "missing"))


CODE_0823 = """class Hyperparameters:
    train_files = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
    val_files = "data/fineweb10B/fineweb_val_*.bin" # input .bin to eval validation loss on
    val_tokens = 10485760 # how many tokens of validation data?
    num_iterations = 1695 # number of iterations to run
args.train_files = os.path.join(data_path, args.train_files)
"""


def _shard(path, tokens):
    import numpy as np

    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())
    return path


def test_the_newer_record_is_patched_in_its_own_quoting_and_only_its_four_values():
    from benchmarks.peers.patch_record import RECORDS

    out = patch(CODE_0823, "/d/train_*.bin", "/d/val.bin", 169, 1048576, RECORDS["2025-08-23"].edits)
    changed = [b for a, b in zip(CODE_0823.splitlines(), out.splitlines()) if a != b]
    assert changed == ['    train_files = "/d/train_*.bin" # input .bin to train on',
                       '    val_files = "/d/val.bin" # input .bin to eval validation loss on',
                       "    val_tokens = 1048576 # how many tokens of validation data?",
                       "    num_iterations = 169 # number of iterations to run"]
    with pytest.raises(ValueError, match="train data"):  # the older record's file is refused, not half-patched
        patch(CODE, "a", "b", 1, 1, RECORDS["2025-08-23"].edits)


def test_record_data_gives_the_newer_record_enough_passes_and_a_val_window(tmp_path):
    import numpy as np

    from benchmarks.peers.patch_record import RECORDS, _passes_needed, _shard_tokens, record_data

    eot = 50256
    docs = [[eot] + list(range(1, 300)) for _ in range(40)]  # 40 documents of 300 tokens
    train = _shard(tmp_path / "c_train_000000.bin", [t for d in docs for t in d])
    val = _shard(tmp_path / "c_val_000000.bin", np.arange(1000) % 7)
    # steps of 8 sequences of 256 tokens, each from one 300-token document to the next: a step reads 2400 tokens
    # and needs 2 x 8 x 256 + 1 ahead of it, so 4 steps fit in one pass of 12,000 tokens
    assert _passes_needed(train, 12, 256, bos_window=True) == 3
    assert _passes_needed(train, 13, 256, bos_window=True) == 4
    # the older record cycles over its shards and has no val window: the shards themselves
    assert record_data("2025-01-04", train, val, 5, 512, tmp_path / "a") == (str(train), str(val))
    rec = RECORDS["2025-08-23"]
    # its 49,152-token sequences from 40 documents of 50,000 tokens: 4 steps of 8 a pass
    long_docs = _shard(tmp_path / "l_train_000000.bin", ([eot] + [1] * 49_999) * 40)
    assert _passes_needed(long_docs, 4, rec.tokens_per_step // 8, bos_window=True) == 1
    assert _passes_needed(long_docs, 5, rec.tokens_per_step // 8, bos_window=True) == 2
    with pytest.raises(ValueError, match="token_window"):  # 300-token documents never fill a sequence
        record_data("2025-08-23", train, val, 2, 512, tmp_path / "d")
    train = long_docs
    tr, va = record_data("2025-08-23", train, val, 2, 512, tmp_path / "b")
    links = sorted((tmp_path / "b" / "train").glob("train_*.bin"))
    assert tr == str(tmp_path / "b" / "train" / "train_*.bin") and len(links) >= 2
    assert all(link.resolve() == train.resolve() for link in links)
    n = _shard_tokens(Path(va))
    assert n > rec.val_window_tokens  # the loader's window fits in one file
    body = np.fromfile(va, dtype=np.uint16, offset=1024)
    assert np.array_equal(body[:1000], np.arange(1000) % 7)  # the val tokens first, unchanged
    with pytest.raises(ValueError, match="fewer than --val-tokens"):
        record_data("2025-08-23", train, val, 2, 5000, tmp_path / "c")


def test_ours_gets_the_newer_records_token_budget():
    args = argparse.Namespace(steps=169, ours_val_every=4, smoke=False, ours_loss_impl=None, ours_micro_batch=32,
                              record="2025-08-23")
    spec = ours_spec(args, 3.5, 8, False, 1.0)
    tokens = spec.steps * spec.micro_batch * spec.accum * spec.seq_len
    assert abs(tokens - 169 * 8 * 48 * 1024) <= spec.micro_batch * spec.accum * spec.seq_len / 2


def test_find_shards_takes_any_corpus_and_refuses_two(tmp_path):
    from benchmarks.gpt2_common import find_shards

    for split in ("train", "val"):
        (tmp_path / f"docs_{split}_000000.bin").write_bytes(b"")
    assert find_shards(str(tmp_path)) == (tmp_path / "docs_train_000000.bin", tmp_path / "docs_val_000000.bin")
    for split in ("train", "val"):
        (tmp_path / f"code_{split}_000000.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="several corpora"):
        find_shards(str(tmp_path))


def test_short_geometry_is_the_1024_token_form_of_the_long_recipe():
    """The throughput benchmarks compare at 1024 tokens: short_geometry turns the shipped (long, document-causal)
    speedrun config into whole-window causal attention over 32 x 1024-token micro-batches, nothing else changed."""
    from benchmarks.gpt2_common import load_yaml_config, yaml_execution

    model, optim, sched, raw = load_yaml_config("gpt2-124m-speedrun")
    s_model, s_optim, s_sched, s_raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    assert model.doc_causal and model.window_schedule is not None and model.block_size == raw["data"]["seq_len"] > 1024
    assert yaml_execution(raw).attn_backend == "flex"
    assert (s_model.block_size, s_model.doc_causal, s_model.window_schedule) == (1024, False, None)
    assert yaml_execution(s_raw).attn_backend == "auto"
    assert (s_raw["data"]["seq_len"], s_raw["data"]["batch_size"]) == (1024, 32) and s_raw["train_tokens"] is None
    assert s_raw["trainer"]["accumulate_grad_batches"] == 1 and s_raw["trainer"]["max_steps"] > 0
    same = ("block_size", "doc_causal", "window_schedule")
    assert {k: v for k, v in vars(s_model).items() if k not in same} == {k: v for k, v in vars(model).items() if k not in same}
    assert (s_optim, s_sched) == (optim, sched)
    with pytest.raises(ValueError, match="geometry"):
        load_yaml_config("gpt2-124m-speedrun", geometry="long")


def test_recipe_variant_is_the_shipped_config_at_0_8_of_the_record_budget():
    """OURS_VARIANTS['recipe']: the shipped config's tokens per step and sequence geometry read from its YAML,
    its schedule 0.8 of the record's token budget; long=False gives the 1024-token geometry."""
    import math

    from benchmarks.gpt2_common import load_yaml_config

    model, _, _, raw = load_yaml_config("gpt2-124m-speedrun")
    data = raw["data"]
    per_step = data["batch_size"] * data["seq_len"] * raw["trainer"]["accumulate_grad_batches"]
    args = argparse.Namespace(steps=127, ours_val_every=4, smoke=False, ours_loss_impl=None, ours_micro_batch=32)
    spec = ours_spec(args, 4.3, *OURS_VARIANTS["recipe"])
    assert (spec.micro_batch, spec.seq_len, spec.micro_batch * spec.seq_len * spec.accum) == (
        data["batch_size"], data["seq_len"], per_step)
    assert spec.steps == round(127 * 524_288 / per_step * 0.8)
    # the shipped budget is the same number of steps: train_tokens / tokens per step, rounded up
    assert math.ceil(raw["train_tokens"] / per_step) == spec.steps
    assert (spec.model.block_size, spec.model.doc_causal, spec.model.window_schedule, spec.model.eot_token) == (
        model.block_size, model.doc_causal, model.window_schedule, model.eot_token)
    assert spec.execution.attn_backend == "flex" and spec.val_batch == data["batch_size"]
    short = ours_spec(args, 4.3, OURS_VARIANTS["recipe"][0], False, 0.8)
    assert (short.seq_len, short.model.block_size, short.model.doc_causal, short.execution.attn_backend) == (
        1024, 1024, False, "auto")


CODE_0713 = """class Hyperparameters:
    train_files = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
    val_files = "data/fineweb10B/fineweb_val_*.bin" # input .bin to eval validation loss on
    val_tokens = 10485760 # how many tokens of validation data?
    num_iterations = 1770 # number of iterations to run
for _ in range(warmup_steps):
    inputs, targets = next(train_loader)
    model(inputs, targets, get_window_size_blocks(1)).backward()
for step in range(train_steps + 1):
    # --------------- TRAINING SECTION -----------------
    inputs, targets = next(train_loader)
    model(inputs, targets, get_window_size_blocks(step)).backward()
    for opt in optimizers:
        opt.step()
"""


def test_the_2025_07_13_record_gets_its_four_values_and_the_accumulation_loop():
    from benchmarks.peers.patch_record import RECORDS

    edits = RECORDS["2025-07-13"].edits
    out = patch(CODE_0713, "/d/train_*.bin", "/d/val.bin", 169, 1048576, edits)
    assert out.splitlines()[:5] == ["class Hyperparameters:",
                                    '    train_files = "/d/train_*.bin" # input .bin to train on',
                                    '    val_files = "/d/val.bin" # input .bin to eval validation loss on',
                                    "    val_tokens = 1048576 # how many tokens of validation data?",
                                    "    num_iterations = 169 # number of iterations to run"]
    # the warm-up is left as it is; the training step takes 8 // world_size sequences
    assert out.splitlines()[5:] == CODE_0713.splitlines()[5:10] + [
        "    for _ in range(8 // world_size):",
        "        inputs, targets = next(train_loader)",
        "        model(inputs, targets, get_window_size_blocks(step)).backward()"] + CODE_0713.splitlines()[12:]
    compile(out, "train_gpt.py", "exec")
    # a script that accumulates already (the 2025-08-23 loop) or lacks the line is refused, not half-patched
    accumulating = CODE_0713.replace("    inputs, targets = next(train_loader)\n    model(inputs, targets, "
                                     "get_window_size_blocks(step))",
                                     "    for _ in range(grad_accum_steps):\n        inputs, targets = "
                                     "next(train_loader)\n        model(inputs, targets, get_window_size_blocks(step))")
    assert accumulating != CODE_0713
    for text in (accumulating, CODE_0823):
        with pytest.raises(ValueError, match="accumulation"):
            patch(text, "a", "b", 1, 1, edits)


def test_record_data_for_the_2025_07_13_record_reads_in_order_and_fills_its_val_batches(tmp_path):
    import numpy as np

    from benchmarks.peers.patch_record import RECORDS, _passes_needed, _shard_tokens, record_data

    eot = 50256
    train = _shard(tmp_path / "n_train_000000.bin", [eot] + list(range(1, 12000)))  # one 12,000-token document
    # in order, 256 tokens a sequence while 256 + 1 more are there: 46 sequences a pass, 8 a step
    assert _passes_needed(train, 12, 256, bos_window=False) == 3
    # the BOS-window loader cannot start a second sequence inside its 4096-token window: refused before a run
    with pytest.raises(ValueError, match="token_window"):
        _passes_needed(train, 1, 256, bos_window=True)
    rec = RECORDS["2025-07-13"]
    train = _shard(tmp_path / "m_train_000000.bin", np.arange(100_001) % 50_000)
    per_pass = (_shard_tokens(train) - 2) // (rec.tokens_per_step // 8)
    assert per_pass == 2
    val_tokens = rec.val_window_tokens
    short = _shard(tmp_path / "n_val_000000.bin", np.arange(val_tokens) % 5)
    tr, va = record_data("2025-07-13", train, short, 1, val_tokens, tmp_path / "a")
    links = sorted((tmp_path / "a" / "train").glob("train_*.bin"))
    assert len(links) == -(-8 // per_pass) + 1 and all(link.resolve() == train.resolve() for link in links)
    # its val loader reads a batch only while 1 + 1 tokens follow it: the shard is repeated, the first tokens kept
    assert _shard_tokens(Path(va)) >= val_tokens + 2
    assert np.array_equal(np.fromfile(va, dtype=np.uint16, offset=1024)[:val_tokens], np.arange(val_tokens) % 5)
    enough = _shard(tmp_path / "e_val_000000.bin", np.arange(val_tokens + 2) % 5)
    assert record_data("2025-07-13", train, enough, 1, val_tokens, tmp_path / "b")[1] == str(enough)


def test_the_2025_07_13_log_lines_parse_with_no_steps_left_out():
    lines = ["step:0/169 val_loss:10.8258 train_time:0ms step_avg:0.02ms"]
    lines += [f"step:{s}/169 train_time:{s * 800}ms step_avg:800.00ms" for s in range(1, 170)]
    lines += ["step:169/169 val_loss:3.9000 train_time:135200ms step_avg:800.00ms",
              "peak memory allocated: 33278 MiB reserved: 48294 MiB"]
    from benchmarks.peers.patch_record import RECORDS

    rec = RECORDS["2025-07-13"]
    out = parse_record_log("\n".join(lines), rec.warm_reset, rec.tokens_per_step)
    assert out["final_val_loss"] == 3.9 and out["steps"] == 169
    assert out["record_train_s"] == out["record_train_s_adjusted"] == 135.2  # nothing to add back
    assert out["tokens_per_s"] == pytest.approx(rec.tokens_per_step / 0.8)
    assert out["peak_mem_gb"] == round(33278 / 1024, 2) and "compile_s" not in out


@pytest.mark.parametrize("record", ["2025-07-13", "2025-08-23", "2025-01-04"])
def test_smoke_patches_the_exported_record_log(tmp_path, record):
    """With the record's log exported to .peers/modded-nanogpt/ (git-ignored): gpt2_record's CPU smoke patches
    the real script, which still compiles, and parses log lines in its format."""
    import numpy as np

    from benchmarks.gpt2_record import _smoke_record
    from benchmarks.peers.patch_record import RECORDS

    rec = RECORDS[record]
    if not rec.log.exists():
        pytest.skip(f"{rec.log} is not exported")
    eot = 50256
    train = _shard(tmp_path / "s_train_000000.bin", ([eot] + [1] * 99) * 10_000)  # 100-token documents
    val = _shard(tmp_path / "s_val_000000.bin", np.arange(1_048_576 + 2) % 50000)
    args = argparse.Namespace(record=record, steps=30, val_tokens=1_048_576)
    out = _smoke_record(train, val, args)
    text = Path(out["patched_script"]).read_text()
    compile(text, "train_gpt.py", "exec")
    assert out["patched_lines"] == 1 and out["val_data"] in text and out["train_data"] in text
    assert ("for _ in range(8 // world_size):" in text) == (record == "2025-07-13")
    assert out["final_val_loss"] == 4.5 and out["tokens_per_s"] == pytest.approx(rec.tokens_per_step / 1.1)


def test_a_run_stops_at_the_wall_time_deadline_even_when_validation_kept_its_clock_still():
    """The call's time limit is wall time: a run whose training clock (validation left out) is still early stops
    once the wall time is past ``deadline_unix``, at its next validation."""
    import sys
    import time

    import torch

    class FixedLoss:  # the validation result; the point here is the stop rule
        def evaluate(self, *args):
            return 5.0

    spec = ours_spec(argparse.Namespace(steps=127, ours_val_every=4, smoke=True, ours_loss_impl=None,
                                        ours_micro_batch=32), None, 8, False)
    common = sys.modules[type(spec).__module__]  # gpt2_common as gpt2_record imports it
    Clock, _validate = common.Clock, common._validate
    assert spec.deadline_unix is None
    model, clock = torch.nn.Linear(2, 2), Clock(torch.device("cpu"))
    assert _validate(spec, model, None, FixedLoss(), clock, [], 1, 10) is None
    spec = replace(spec, deadline_unix=time.time() + 0.2)
    assert _validate(spec, model, None, FixedLoss(), clock, [], 2, 20) is None
    clock.pause()
    time.sleep(0.3)  # wall time passes while the training clock stands still (as during validation)
    clock.resume()
    curve: list = []
    assert clock.now() < 0.2 and _validate(spec, model, None, FixedLoss(), clock, curve, 3, 30) == "deadline"
    assert curve[0]["step"] == 3 and curve[0]["val_loss"] == 5.0
