from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops
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
    ("name", "precision", "dtype"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", torch.bfloat16),
        ("NVIDIA H100 PCIe", "16-mixed", torch.float16),
        ("NVIDIA A100-SXM4-80GB", "bf16-true", torch.bfloat16),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", torch.bfloat16),
    ],
)
def test_peak_is_lightnings_number_for_the_gpu_name(monkeypatch, name, precision, dtype):
    # No GPU needed: Lightning reads the name through torch.cuda.get_device_name.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    expected = get_available_flops(cuda, dtype)
    assert expected
    assert peak_flops_for(cuda, precision) == expected
    if name.startswith("NVIDIA H100 80GB"):
        assert expected == pytest.approx(989.4e12)  # H100 SXM dense bf16


def test_unknown_device_logs_no_mfu_and_tells_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops_for(torch.device("cuda", 0), "bf16-mixed") is None
    assert peak_flops_for(torch.device("cpu"), "bf16-mixed") is None

    class Stub:
        precision = "bf16-mixed"

        class strategy:  # noqa: N801
            root_device = torch.device("cuda", 0)

    cb = SpeedMonitor()
    with caplog.at_level(logging.INFO):
        cb.on_train_start(Stub(), None)
        cb.on_train_start(Stub(), None)
    assert cb._peak is None
    assert sum("no peak FLOP/s known" in r.getMessage() for r in caplog.records) == 1
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
