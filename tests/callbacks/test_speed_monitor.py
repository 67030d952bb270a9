from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_opt.callbacks import SpeedMonitor
from lightning_opt.callbacks.speed_monitor import _batch_counts, peak_flops_for
from tests.callbacks.conftest import StatefulBatches, TinyModule, make_batches, make_trainer


class TokenModule(TinyModule):
    """Integer [B, T] token batches; ``flops_per_batch`` for MFU."""

    flops_per_batch = 1e9

    def __init__(self, **kw):
        super().__init__(**kw)
        self.emb = nn.Embedding(50, 16)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.emb(tokens).pow(2).mean()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return StatefulBatches([(torch.randint(0, 50, (4, 7), generator=g),) for _ in range(8)])


def test_tokens_samples_and_mfu(tmp_path):
    cb = SpeedMonitor(log_every_n_steps=4, peak_flops=1e12)
    trainer = make_trainer(tmp_path, [cb])
    trainer.fit(TokenModule())
    m = cb.metrics
    assert cb.total_tokens == 8 * 4 * 7
    assert m["speed/tokens_per_sec"] == pytest.approx(7 * m["speed/samples_per_sec"])
    # MFU = flops per batch / step time / peak
    assert m["speed/mfu"] == pytest.approx(1e9 / (m["speed/step_time_ms"] / 1e3) / 1e12, rel=1e-6)
    assert m["time/data_wait_ms"] >= 0


def test_tokens_per_batch_attribute_wins(tmp_path):
    class WithTokens(TokenModule):
        tokens_per_batch = 100

    cb = SpeedMonitor(log_every_n_steps=8)
    make_trainer(tmp_path, [cb]).fit(WithTokens())
    assert cb.total_tokens == 800
    assert "speed/mfu" not in cb.metrics  # no peak known on CPU


def test_batch_counts():
    assert _batch_counts(torch.zeros(4, 9, dtype=torch.long)) == (4, 36)
    assert _batch_counts((torch.zeros(4, 9), torch.zeros(4, 1))) == (4, 4)  # float features: samples
    assert _batch_counts({"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == (2, 10)
    assert _batch_counts(["text"]) == (0, 0)


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
        ("NVIDIA H100 PCIe", "bf16-mixed", 756.5),
        ("NVIDIA H100 NVL", "16-mixed", 835.0),
        ("NVIDIA H200", "bf16-true", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0),
        ("NVIDIA L40S", "bf16-mixed", 362.05),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.2),
    ],
)
def test_peak_table(name, precision, tflops):
    assert peak_flops_for(name, precision) == pytest.approx(tflops * 1e12)


def test_unknown_device_and_override():
    assert peak_flops_for("Some Future GPU", "bf16-mixed") is None
    assert peak_flops_for("NVIDIA H200", "bf16-mixed", {"h200": {"bf16": 1.0}}) == 1e12
    with pytest.raises(ValueError, match="peak_flops"):
        SpeedMonitor(peak_flops=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_split_without_syncs(tmp_path):
    class Guard(SpeedMonitor):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("error")
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, *args, **kwargs):
            super().on_train_batch_end(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("default")

    cb = Guard(log_every_n_steps=2, peak_flops=1e12)
    # record_losses=False: the test module's own float(loss) would sync
    make_trainer(tmp_path, [cb], accelerator="gpu").fit(TinyModule(batches=make_batches(8), record_losses=False))
    assert cb.metrics["time/fwd_bwd_ms"] > 0 and cb.metrics["time/optimizer_ms"] > 0
