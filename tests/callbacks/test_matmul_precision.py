from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

from lightning_opt.callbacks import MatmulPrecision
from lightning_opt.recipes import CONFIGS


class _Recorder(pl.LightningModule):
    """Records the float32 matmul precision in every training and validation step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen: list[str] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(torch.get_float32_matmul_precision())
        return self.layer(batch).square().mean()

    def validation_step(self, batch, batch_idx):
        self.seen.append(torch.get_float32_matmul_precision())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(6, 4), batch_size=2)

    def val_dataloader(self):
        return DataLoader(torch.randn(2, 4), batch_size=2)


def _trainer(tmp_path, callback, **kw) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_steps=3, accelerator="cpu", callbacks=[callback], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


@pytest.mark.parametrize("before, during", [("highest", "high"), ("medium", "high"), ("high", "medium")])
def test_precision_applies_during_fit_and_is_restored_after(tmp_path, before, during):
    original = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(before)
    try:
        module = _Recorder()
        trainer = _trainer(tmp_path, MatmulPrecision(during))
        trainer.fit(module)
        assert module.seen and set(module.seen) == {during}
        assert torch.get_float32_matmul_precision() == before
        trainer.validate(module, verbose=False)  # every stage: set at setup, restored at teardown
        assert module.seen[-1] == during and torch.get_float32_matmul_precision() == before
    finally:
        torch.set_float32_matmul_precision(original)


def test_precision_is_saved_in_the_checkpoint(tmp_path):
    original = torch.get_float32_matmul_precision()
    try:
        trainer = _trainer(tmp_path, MatmulPrecision("high"), enable_checkpointing=True)
        trainer.fit(_Recorder())
        (path,) = tmp_path.rglob("*.ckpt")
        state = torch.load(path, weights_only=True)["callbacks"]
        assert {"precision": "high"} in state.values()
    finally:
        torch.set_float32_matmul_precision(original)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        MatmulPrecision("tf32")  # type: ignore[arg-type]


@pytest.mark.parametrize("config", ["gpt2/gpt2-124m-classic.yaml", "gpt2/gpt2-124m-speedrun.yaml",
                                    "clt_gpt2_small.yaml"])
def test_gpu_recipes_run_with_tf32(config):
    callbacks = yaml.safe_load((CONFIGS / config).read_text())["trainer"]["callbacks"]
    assert {"class_path": "lightning_opt.callbacks.MatmulPrecision", "init_args": {"precision": "high"}} in callbacks
