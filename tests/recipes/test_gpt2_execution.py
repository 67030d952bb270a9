"""A recipe run records how its model was computed: model.execution in config.yaml and the hyperparameters."""

from __future__ import annotations

import torch
import yaml

from lightning_opt.models.gpt2 import GPTConfig, GPTExecution
from lightning_opt.recipes import CONFIGS


def test_execution_is_in_the_saved_config_and_the_checkpoint(tmp_path, monkeypatch):
    from lightning_opt.recipes import gpt2

    monkeypatch.chdir(tmp_path)
    gpt2.main([
        "--config", str(CONFIGS / "gpt2/demo.yaml"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
        "--model.model_config.n_layer", "2", "--model.model_config.n_embd", "64",
        "--model.execution.loss_impl", "chunked", "--model.execution.loss_chunk_size", "64",
        "--model.execution.attn_backend", "math",
        "--data.batch_size", "4", "--data.val_tokens", "2048",
    ])
    [saved] = list((tmp_path / "runs").rglob("config.yaml"))
    model = yaml.safe_load(saved.read_text())["model"]
    assert model["execution"]["loss_impl"] == "chunked" and model["execution"]["attn_backend"] == "math"
    assert "loss_impl" not in model["model_config"]
    ckpts = sorted((tmp_path / "runs").rglob("*.ckpt"))
    assert ckpts, "the demo recipe saves a checkpoint"
    hp = torch.load(ckpts[-1], weights_only=True)["hyper_parameters"]
    assert GPTExecution.from_dict(hp["execution"]) == GPTExecution(loss_impl="chunked", loss_chunk_size=64,
                                                                   attn_backend="math")
    assert GPTConfig.from_dict(hp["model_config"]).n_layer == 2
