from __future__ import annotations

import json

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.recipes import CONFIGS


@pytest.fixture()
def target_ckpt(tmp_path) -> str:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
    path = tmp_path / "target.pt"
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, path)
    return str(path)


def test_clt_recipe_demo_config_runs_and_writes_metrics(tmp_path, target_ckpt: str) -> None:
    from lightning_opt.recipes import clt as recipe

    export = tmp_path / "export"
    metrics = recipe.main([
        "--config", str(CONFIGS / "clt_demo.yaml"),
        "--data.target", target_ckpt,
        "--data.seq_len", "32", "--data.tokens_per_batch", "128", "--data.val_tokens", "256", "--data.stats_tokens", "1024",
        "--model.clt.n_layers", "2", "--model.clt.d_model", "32", "--model.clt.n_features", "64",
        "--model.clt.activation", "relu",
        "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--export_dir", str(export),
    ])
    files = list((tmp_path / "runs").rglob("metrics.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["steps"] == 6 and saved["recipe"] == "clt"
    for key in ("val/fvu", "val/l0", "val/kl", "val/next_token_agreement", "val/fvu_layer1"):
        assert key in saved["final"], key
    assert metrics["final"]["val/fvu"] == saved["final"]["val/fvu"]
    assert (export / "W_dec_1.safetensors").exists() and (export / "W_enc_0.safetensors").exists()


def test_clt_recipe_rejects_a_layer_mismatch(tmp_path, target_ckpt: str) -> None:
    from lightning_opt.recipes import clt as recipe

    with pytest.raises(ValueError, match="target model has 2 layers"):
        recipe.main([
            "--config", str(CONFIGS / "clt_demo.yaml"),
            "--data.target", target_ckpt, "--data.seq_len", "32", "--data.tokens_per_batch", "128", "--data.stats_tokens", "512",
            "--model.clt.d_model", "32", "--trainer.max_steps", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        ])
