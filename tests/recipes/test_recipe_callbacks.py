"""The callback suite every recipe attaches (``RecipeCLI``): on by default, each switched off with
``--callbacks.<key>.enabled false``, set through its init arguments; a run logs what the suite measures."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lightning_opt.cli import RECIPE_CALLBACKS, RecipeCLI, _callback_class
from lightning_opt.optim.schedules import ScheduleConfig
from lightning_opt.recipes import CONFIGS

torch.set_num_threads(1)

_TINY = ["--model.model_config.n_layer", "1", "--model.model_config.n_embd", "32", "--model.model_config.n_head", "2",
         "--model.model_config.block_size", "32", "--data.seq_len", "32", "--data.batch_size", "2",
         "--data.val_tokens", "256", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false"]


def _cli(*args: str) -> RecipeCLI:
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    return RecipeCLI(GPT2SpeedrunModule, TokenShardDataModule, run=False,
                     args=["--config", str(CONFIGS / "gpt2/demo.yaml"), *_TINY, *args])


def _types(cli: RecipeCLI) -> list[type]:
    return [type(c) for c in cli.trainer.callbacks]


SUITE = {key: _callback_class(path) for key, path in RECIPE_CALLBACKS.items()}


def test_the_suite_is_attached_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    types = _types(_cli())
    assert all(types.count(cls) == 1 for cls in SUITE.values()), types
    lr = next(c for c in _cli().trainer.callbacks if type(c) is SUITE["lr_monitor"])
    assert lr.logging_interval == "step"


@pytest.mark.parametrize("key", sorted(RECIPE_CALLBACKS))
def test_switching_one_off_removes_it(key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    types = _types(_cli(f"--callbacks.{key}.enabled", "false"))
    assert SUITE[key] not in types
    assert all(cls in types for k, cls in SUITE.items() if k != key)


def test_settings_are_typed_init_arguments_and_trainer_callbacks_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _cli("--callbacks.loss_clamp.max", "50", "--callbacks.eval_throttle.max_fraction", "0.1",
               "--callbacks.async_checkpoint.every_n_steps", "100")
    by_type = {type(c): c for c in cli.trainer.callbacks}
    assert by_type[SUITE["loss_clamp"]].config.max == 50.0
    assert by_type[SUITE["eval_throttle"]].config.max_fraction == 0.1
    assert by_type[SUITE["async_checkpoint"]].config.every_n_steps == 100
    with pytest.raises(SystemExit):  # a wrong type is refused by the parser, naming the argument
        _cli("--callbacks.loss_clamp.max", "high")
    # the same class in trainer.callbacks (a config of one's own) replaces the suite's
    cli = _cli("--trainer.callbacks+=lightning_opt.callbacks.NaNSkip", "--trainer.callbacks.mode", "host")
    skips = [c for c in cli.trainer.callbacks if type(c) is SUITE["nan_skip"]]
    assert len(skips) == 1 and skips[0].config.mode == "host"
    # no logger: no LearningRateMonitor (it needs one); checkpointing off: no AsyncCheckpoint
    types = _types(_cli("--trainer.logger", "false", "--trainer.enable_checkpointing", "false"))
    assert SUITE["lr_monitor"] not in types and SUITE["async_checkpoint"] not in types


def test_a_recipe_run_logs_learning_rates_and_checkpoints_into_its_run_dir(tmp_path, monkeypatch):
    from lightning_opt.recipes import gpt2

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(CONFIGS / "gpt2/demo.yaml"), *_TINY, "--trainer.max_steps", "8",
            "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "1",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", "runs", "--trainer.logger.name", "demo"]
    gpt2.main(args)
    gpt2.main(args)  # a second run in the same directory gets its own folder (no lock conflict)
    rows = list(csv.DictReader((tmp_path / "runs/demo/version_0/metrics.csv").open()))
    columns = set(rows[0])
    assert {"lr/muon", "lr/embeddings", "lr/head", "lr/scalars"} <= columns, sorted(columns)
    lrs = [float(r["lr/muon"]) for r in rows if r.get("lr/muon")]
    # one value per step: the demo's muon_lr on its wsd schedule. NaNSkip applies a step's scheduler step when
    # it reads that step's skip decision, without a sync, during the next step: the rate logged at the start
    # of step k is the one step k - 1 used
    schedule = ScheduleConfig(name="wsd", warmup_steps=0, decay_fraction=0.4, min_ratio=0.0, total_steps=8)
    assert lrs == pytest.approx([0.03 * schedule(max(k - 1, 0)) for k in range(8)])
    assert lrs[-1] < lrs[0]
    for key in ("speed/tokens_per_sec", "nan_skip/skipped_steps", "loss_clamp/clamped", "eval_throttle/val_runs"):
        assert key in columns, key
    assert all(float(r["nan_skip/skipped_steps"]) == 0 for r in rows if r.get("nan_skip/skipped_steps"))
    assert all(float(r["loss_clamp/clamped"]) == 0 for r in rows if r.get("loss_clamp/clamped"))
    for version in (0, 1):
        ckpts = tmp_path / f"runs/demo/version_{version}/checkpoints"
        assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 8
    assert not Path("checkpoints").exists()  # nothing in a folder every run in this directory would share
