from __future__ import annotations

import json
import math

import pytest

from lightning_opt.recipes import CONFIGS


def _recipe():
    from lightning_opt.recipes import gpt2

    return gpt2


def test_demo_recipe_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = _recipe().main([
        "--config", str(CONFIGS / "gpt2/demo.yaml"),
        "--trainer.max_steps", "40", "--trainer.val_check_interval", "20",
        "--trainer.enable_progress_bar", "false",
        "--model.model_config.n_layer", "2", "--model.model_config.n_embd", "64",
        "--data.batch_size", "8", "--data.val_tokens", "8192",
    ])
    files = list((tmp_path / "runs").rglob("metrics.json"))
    assert len(files) == 1
    written = json.loads(files[0].read_text())
    assert written["steps"] == 40 and written["tokens_seen"] == 40 * 8 * 128
    history = [row["val_loss"] for row in written["val_history"]]
    assert len(history) == 2 and history[-1] < history[0]
    assert written["final_val_loss"] == pytest.approx(metrics["final_val_loss"])
    assert written["tokens_per_s"] > 0 and "cpu" in written["device"]
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*")), "TensorBoard logs missing"


def test_bad_config_value_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((SystemExit, ValueError)):
        _recipe().main(["--config", str(CONFIGS / "gpt2/demo.yaml"), "--model.optim.lr", "-1"])


# the full-size GPU configs at a size a CPU trains in seconds (built-in corpus, no compile); the speedrun
# config's layer 7 has no attention: a 6-layer model names layer 3
_SHRUNK = ["--model.model_config.n_layer", "6", "--model.model_config.n_embd", "64", "--model.model_config.n_head", "2",
           "--model.compile", "false", "--data.val_tokens", "1024"]
_SPEEDRUN_SHRUNK = [*_SHRUNK, "--model.model_config.skip_attn_layers", "[3]",
                    # the built-in corpus is bytes: a 512-token vocabulary holds it, byte 0 separates documents
                    "--model.model_config.vocab_size", "512", "--model.model_config.eot_token", "0",
                    "--model.model_config.block_size", "256", "--data.seq_len", "256",
                    "--model.model_config.window_schedule", "[128, 256]"]


def test_classic_config_parses_and_runs_shrunk(tmp_path, monkeypatch):
    """The classic GPU config stays valid: run it shrunk to seconds on CPU."""
    monkeypatch.chdir(tmp_path)
    metrics = _recipe().main([
        "--config", str(CONFIGS / "gpt2/gpt2-124m-classic.yaml"), *_SHRUNK,
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--model.model_config.block_size", "64", "--data.seq_len", "64", "--data.batch_size", "2",
    ])
    assert metrics["steps"] == 2 and metrics["final_val_loss"] is not None


def test_classic_config_takes_compile_options_and_saves_them(tmp_path, monkeypatch):
    """``model.compile.options`` on the classic config reach the module and the run's config.yaml."""
    from lightning_opt.cli import build_recipe_cli
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    monkeypatch.chdir(tmp_path)
    cli, _ = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, [
        "--config", str(CONFIGS / "gpt2/gpt2-124m-classic.yaml"), *_SHRUNK[:6], "--data.val_tokens", "1024",
        "--model.model_config.block_size", "64", "--data.seq_len", "64", "--data.batch_size", "2",
        "--trainer.max_steps", "0", "--trainer.enable_progress_bar", "false",
        "--model.compile.options", '{"max_autotune": true}',
    ], cli_class=_recipe().GPT2RecipeCLI)
    assert cli.model.compile_config.enabled and cli.model.compile_config.options == {"max_autotune": True}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # no step: writes config.yaml, compiles nothing
    assert _saved_config(tmp_path)["model"]["compile"]["options"] == {"max_autotune": True}


def _saved_config(tmp_path) -> dict:
    import yaml

    (path,) = tmp_path.rglob("config.yaml")
    return yaml.safe_load(path.read_text())


def _budget_run(tmp_path, monkeypatch, *extra: str):
    """The shipped speedrun config through the recipe's CLI, shrunk; the CLI after fit and the metrics."""
    from lightning_opt.cli import build_recipe_cli, run_recipe
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    monkeypatch.chdir(tmp_path)
    gpt2 = _recipe()
    cli, summary = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, [
        "--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun.yaml"), *_SPEEDRUN_SHRUNK,
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *extra,
    ], cli_class=gpt2.GPT2RecipeCLI)
    return cli, run_recipe(cli, summary, recipe="gpt2_speedrun")


def test_speedrun_config_is_the_long_document_causal_geometry(tmp_path, monkeypatch):
    """The shipped default trains through the recipe in its own geometry: one document-causal sequence per
    micro-batch through the flex backend, a growing window, and its token budget setting max_steps."""
    import yaml

    shipped = yaml.safe_load((CONFIGS / "gpt2/gpt2-124m-speedrun.yaml").read_text())
    accum, data = shipped["trainer"]["accumulate_grad_batches"], shipped["data"]
    assert "max_steps" not in shipped["trainer"] and shipped["train_tokens"] > 0
    assert shipped["model"]["model_config"]["block_size"] == data["seq_len"] > 1024
    steps = math.ceil(shipped["train_tokens"] / (data["batch_size"] * data["seq_len"] * accum))
    assert shipped["train_tokens"] <= steps * data["batch_size"] * data["seq_len"] * accum

    cli, metrics = _budget_run(tmp_path, monkeypatch, "--train_tokens", str(2 * 256 * accum),
                               "--trainer.val_check_interval", str(accum))
    model, saved = cli.model, _saved_config(tmp_path)
    assert model.model_config.doc_causal and model.model_config.eot_token == 0
    assert model.execution.attn_backend == "flex" and model.model_config.window_schedule == (128, 256)
    assert cli.datamodule.batch_size == data["batch_size"] and cli.trainer.accumulate_grad_batches == accum
    assert metrics["steps"] == 2 and metrics["tokens_seen"] == 2 * 256 * accum * data["batch_size"]
    assert [row["step"] for row in metrics["val_history"]] == [1, 2]  # validated on the same sequences
    assert saved["train_tokens"] == 2 * 256 * accum and saved["trainer"]["max_steps"] == -1


@pytest.mark.parametrize("budget", [3 * 256 * 4, 3 * 256 * 4 - 100])
def test_train_tokens_sets_max_steps_and_the_schedule(budget, tmp_path, monkeypatch):
    """train_tokens -> trainer.max_steps = ceil(tokens / (batch x seq_len x accumulation x world)); the run takes
    that many optimizer steps, the learning-rate cooldown ends on the last one, config.yaml keeps train_tokens."""
    cli, metrics = _budget_run(tmp_path, monkeypatch, "--train_tokens", str(budget),
                               "--trainer.accumulate_grad_batches", "4", "--trainer.val_check_interval", "8")
    trainer = cli.trainer
    assert trainer.max_steps == 3 == math.ceil(budget / (256 * 4)) and trainer.world_size == 1
    assert trainer.global_step == metrics["steps"] == 3
    assert metrics["tokens_seen"] == 3 * 4 * 256 >= budget
    (scheduler,) = [c.scheduler for c in trainer.lr_scheduler_configs]
    assert scheduler.last_epoch == 3 and max(scheduler.get_last_lr()) == 0.0  # wsd decays to min_ratio 0 here
    assert _saved_config(tmp_path)["train_tokens"] == budget


def test_train_tokens_divides_by_the_world_size(tmp_path, monkeypatch):
    """Two CPU processes (DDP): each step trains twice the tokens, so half the steps (the Trainer is built, not run)."""
    from lightning_opt.cli import build_recipe_cli
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    monkeypatch.chdir(tmp_path)
    budget = 10 * 256 * 4
    runs = {}
    for devices, strategy in ((1, "auto"), (2, "ddp_spawn")):
        cli, _ = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, [
            "--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun.yaml"), *_SPEEDRUN_SHRUNK, "--train_tokens", str(budget),
            "--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.strategy", strategy,
        ], cli_class=_recipe().GPT2RecipeCLI)
        runs[devices] = (cli.trainer.world_size, cli.trainer.max_steps)
    assert runs == {1: (1, 10), 2: (2, 5)}


def test_train_tokens_and_max_steps_together_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"train_tokens=53215232 and trainer.max_steps=5.*--train_tokens null"):
        _recipe().main(["--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun.yaml"), "--train_tokens", "53215232",
                        "--trainer.max_steps", "5", *_SPEEDRUN_SHRUNK])
    assert not list(tmp_path.rglob("config.yaml"))  # refused before anything ran


def test_half_batch_overlay_is_the_1024_token_geometry(tmp_path, monkeypatch):
    """gpt2-124m-speedrun-halfbatch.yaml layers on the speedrun config: 1024-token windows (64 here), causal over
    the whole window, 4 micro-batches of 64 per step, its own token budget."""
    monkeypatch.chdir(tmp_path)
    overlay = (CONFIGS / "gpt2/gpt2-124m-speedrun-halfbatch.yaml").read_text()
    assert "seq_len: 1024" in overlay and "batch_size: 64" in overlay and "train_tokens: 56623104" in overlay
    metrics = _recipe().main([
        "--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun.yaml"),
        "--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun-halfbatch.yaml"), *_SHRUNK,
        "--model.model_config.skip_attn_layers", "[3]", "--train_tokens", str(2 * 4 * 2 * 64),
        "--model.model_config.block_size", "64", "--data.seq_len", "64", "--data.batch_size", "2",
        "--trainer.val_check_interval", "8", "--trainer.enable_progress_bar", "false",
    ])
    assert metrics["steps"] == 2 and metrics["final_val_loss"] is not None
    saved = _saved_config(tmp_path)
    arch, execution = saved["model"]["model_config"], saved["model"]["execution"]
    assert arch["doc_causal"] is False and arch["window_schedule"] is None and execution["attn_backend"] == "auto"
    assert saved["trainer"]["accumulate_grad_batches"] == 4
