"""LazyProgressBar: shows logged metrics read at redraw time only."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_opt.callbacks import LazyProgressBar


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss, prog_bar=False)  # nothing for Lightning to convert per batch
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


class _Reads(LazyProgressBar):
    """Counts the redraws that read the metric."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[str] = []

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        if "loss" in items:
            self.seen.append(items["loss"])
        return items


def test_shows_the_loss_without_prog_bar_logging_and_reads_it_at_redraws(tmp_path):
    bar = _Reads(refresh_rate=4, keys=["train/loss"])
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, callbacks=[bar], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Tiny())
    # 8 batches, redraw every 4: the value was read at the redraws (plus the bar's epoch-end refresh)
    assert 2 <= len(bar.seen) <= 4
    assert all(float(v) >= 0 for v in bar.seen)
    assert "train/loss" not in trainer.progress_bar_metrics  # Lightning had nothing to convert


def test_keys_must_be_a_list():
    with pytest.raises(ValueError, match="list of metric names"):
        LazyProgressBar(keys="train/loss")
