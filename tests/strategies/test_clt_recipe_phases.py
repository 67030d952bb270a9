"""The CLT recipe through its entry point on 2 gloo ranks, through every phase of a run, against one process.

Each run is ``lightning_opt.recipes.clt.main(args)``, the console script's function, with a tiny random target
GPT: 8 steps in epochs of 4 (so a resume at step 4 is at an epoch boundary: the online stream keeps no
position), a dead-feature window of 2 steps (AuxK runs from step 3), dead-feature resampling every 3 steps,
validation at steps 4 and 8, a checkpoint at steps 4 and 8, the LR decaying over the second half. The 2-rank
runs share one spawn (2 processes joined as by a launcher), one scenario after the other:

* ``DecoderShardingStrategy`` with ``shard_encoder`` true (AuxK over all features) and false (AuxK over at most 16
  candidates per layer), each against one process with the same batch;
* the first resumed from its step-4 checkpoint to step 8: its step-8 checkpoint equals the uninterrupted one's;
* ``GlobalBatchTopKStrategy`` (2 x 64 tokens) against one process with 128 tokens per step.

Compile stays off (the strategies refuse it; compiled runs are GPU-only, ``benchmarks/documented_commands.py``).
"""

from __future__ import annotations

import csv
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_opt.recipes import CONFIGS
from tests._fork import fork_ranks
from tests.strategies._clt_helpers import free_port
from tests.strategies.test_multinode import _ckpt, _tensors

WORLD = 2
K = 8
STEPS = 8

_COMMON = ["--config", str(CONFIGS / "clt_demo.yaml"),
           "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--trainer.num_sanity_val_steps", "0", "--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1",
           "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
           "--trainer.limit_val_batches", "1",
           "--data.seq_len", "32", "--data.stats_tokens", "512",
           "--model.clt.n_layers", "2", "--model.clt.d_model", "32", "--model.clt.n_features", "64",
           "--model.clt.k", str(K), "--model.aux_k", "8", "--model.aux_coef", "0.5",
           "--model.dead_tokens", "128", "--model.resample_dead_every", "3",
           "--model.schedule.warmup_steps", "1", "--model.schedule.decay_fraction", "0.5",
           "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
           "--trainer.callbacks.every_n_train_steps", "4", "--trainer.callbacks.save_top_k", "-1",
           "--trainer.callbacks.filename", "{step}",
           "--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
# 64 tokens per rank and step, epochs of 4 steps, one validation batch per data rank
_ONE_BATCH = ["--data.tokens_per_batch", "64", "--data.train_tokens", "256", "--data.val_tokens", "64"]
_SHARDED = ["--trainer.strategy.class_path", "lightning_opt.strategies.DecoderShardingStrategy"]
_CAPPED = ["--model.aux_max_dead", "16"]  # AuxK's capped form (16 of the 64 features per layer)

# name -> (devices, arguments)
RUNS: dict[str, tuple[int, list[str]]] = {
    "single_capped": (1, [*_ONE_BATCH, *_CAPPED]),
    "single": (1, _ONE_BATCH),
    "single_big_batch": (1, ["--data.tokens_per_batch", "128", "--data.train_tokens", "512",
                             "--data.val_tokens", "128"]),
    "sharded_encoder": (2, [*_ONE_BATCH, *_SHARDED, "--trainer.strategy.init_args.shard_encoder", "true"]),
    "sharded": (2, [*_ONE_BATCH, *_CAPPED, *_SHARDED, "--trainer.strategy.init_args.shard_encoder", "false"]),
    "global_batchtopk": (2, ["--data.tokens_per_batch", "64", "--data.train_tokens", "512", "--data.val_tokens",
                             "128", "--trainer.strategy.class_path", "lightning_opt.strategies.GlobalBatchTopKStrategy"]),
}
RESUMED = "sharded_encoder_resumed"  # sharded_encoder again, from its step-4 checkpoint


def _args(name: str, root: Path, target: str) -> list[str]:
    devices, args = RUNS[name]
    run = root / name
    return [*_COMMON, *args, "--data.target", target, "--trainer.devices", str(devices),
            "--trainer.logger.init_args.save_dir", str(run / "logs"), "--trainer.callbacks.dirpath", str(run / "ckpt")]


def _resume_args(root: Path, target: str) -> list[str]:
    args = _args("sharded_encoder", root, target)
    run = root / RESUMED
    ckpt = root / "sharded_encoder" / "ckpt" / "step=4.ckpt"
    return [*args, "--trainer.logger.init_args.save_dir", str(run / "logs"), "--trainer.callbacks.dirpath",
            str(run / "ckpt"), "--ckpt_path", str(ckpt)]


def _worker(rank: int, port: int, root: str, target: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), NODE_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lightning_opt.recipes.clt import main

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    out = Path(root)
    jobs = {name: _args(name, out, target) for name, (devices, _) in RUNS.items() if devices == WORLD}
    jobs[RESUMED] = _resume_args(out, target)
    for name, args in jobs.items():
        try:
            main(args)
        except BaseException:  # recorded for the test; the next scenario still runs
            (out / f"{name}.error.rank{rank}").write_text(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


def _read(run: Path) -> dict[str, Any]:
    """The run's per-step logged values (``CSVLogger``) and its ``metrics.json``."""
    import json

    (csv_file,) = run.glob("logs/**/metrics.csv")
    steps: dict[int, dict[str, float]] = {}
    with open(csv_file) as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            steps.setdefault(int(row["step"]), {}).update(values)
    (metrics,) = run.glob("logs/**/metrics.json")
    return {"steps": steps, "metrics": json.loads(metrics.read_text()), "dir": run}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from lightning_opt.models.gpt2 import GPT, GPTConfig
    from lightning_opt.recipes.clt import main

    root = tmp_path_factory.mktemp("clt_recipe_phases")
    torch.manual_seed(0)  # a tiny random byte-level GPT as the target (the demo target would be trained first)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
    target = str(root / "target.pt")
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, target)
    fork_ranks(_worker, (free_port(), str(root), target), WORLD)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: a tiny model on a shared CPU
    try:
        for name, (devices, _) in RUNS.items():
            if devices == 1:
                main(_args(name, root, target))
    finally:
        torch.set_num_threads(threads)
    errors = sorted(root.glob("*.error.rank*"))
    if errors:
        pytest.fail("\n".join(f"--- {p.name}\n{p.read_text()}" for p in errors))
    return {name: _read(root / name) for name in [*RUNS, RESUMED]}


def _series(run: dict[str, Any], key: str) -> dict[int, float]:
    return {step: values[key] for step, values in sorted(run["steps"].items()) if key in values}


@pytest.mark.parametrize("name", ["sharded_encoder", "sharded", "global_batchtopk"])
def test_every_phase_runs_on_two_ranks(runs: dict, name: str) -> None:
    run = runs[name]
    assert run["metrics"]["steps"] == STEPS and run["metrics"]["world_size"] == WORLD
    assert (run["dir"] / "ckpt" / f"step={STEPS}.ckpt").exists()
    assert run["metrics"]["final"]["val/l0"] == pytest.approx(K, abs=1e-6)
    assert sorted(_series(run, "val/fvu")) == [3, 7]  # validation after steps 4 and 8 (0-based steps 3, 7)
    auxk = _series(run, "train/auxk")
    assert any(v != 1.0 for v in auxk.values()) and all(v > 0 for v in auxk.values()), auxk  # AuxK ran on dead features
    assert sum(_series(run, "train/resampled").values()) > 0
    lr = list(_series(run, "lr/decay").values())
    assert lr[-1] < max(lr)  # the schedule's decay was reached


_WHOLE_BATCH = ("train/auxk", "train/resampled", "val/fvu", "val/l0")  # the whole batch's values on every rank


@pytest.mark.parametrize(("name", "reference", "keys"), [
    ("sharded_encoder", "single", ("train/loss", *_WHOLE_BATCH)),  # train/loss: the decoder group's mean
    ("sharded", "single_capped", ("train/loss", *_WHOLE_BATCH)),
    ("global_batchtopk", "single_big_batch", _WHOLE_BATCH),  # train/loss there is rank 0's half of the batch
])
def test_two_ranks_follow_one_process(runs: dict, name: str, reference: str, keys: tuple[str, ...]) -> None:
    got, want = runs[name], runs[reference]
    for key in keys:
        a, b = _series(got, key), _series(want, key)
        assert a.keys() == b.keys() and a, (key, a, b)
        torch.testing.assert_close(torch.tensor(list(a.values())), torch.tensor(list(b.values())),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{name} vs {reference}, {key}: {m}")


def test_resume_from_the_step_4_checkpoint_is_exact(runs: dict) -> None:
    resumed, whole = runs[RESUMED]["dir"], runs["sharded_encoder"]["dir"]
    assert not (resumed / "ckpt" / "step=4.ckpt").exists()  # it started at step 4
    got, want = _ckpt(resumed, STEPS), _ckpt(whole, STEPS)
    assert got["global_step"] == want["global_step"] == STEPS
    a = _tensors({"model": got["state_dict"], "optim": got["optimizer_states"], "loops": got["loops"],
                  "resampling": got["clt_resampling"]})
    b = _tensors({"model": want["state_dict"], "optim": want["optimizer_states"], "loops": want["loops"],
                  "resampling": want["clt_resampling"]})
    assert a.keys() == b.keys() and any(k.startswith("/optim") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # bit for bit
    assert got["lr_schedulers"] == want["lr_schedulers"] and got["tokens_seen"] == want["tokens_seen"]
