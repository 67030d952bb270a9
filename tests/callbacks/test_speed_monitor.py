from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import nn

from lightning_opt.callbacks import SpeedMonitor
from lightning_opt.callbacks.speed_monitor import _batch_counts, peak_flops, peak_flops_for
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


def test_tokens_samples_and_mfu(tmp_path, caplog):
    # on CPU, where no peak is known, a given peak_flops logs MFU
    cb = SpeedMonitor(log_every_n_steps=4, peak_flops=1e12)
    trainer = make_trainer(tmp_path, [cb])
    with caplog.at_level(logging.INFO):
        trainer.fit(TokenModule())
    assert any(
        "speed/mfu is against 1 TFLOP/s, the peak_flops given" in r.getMessage() for r in caplog.records
    )
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


class _GpuTrainer:
    """What ``on_train_start`` reads of a Trainer on CUDA device 0, for the peak look-up without a GPU."""

    def __init__(self, precision="bf16-mixed"):
        self.precision = precision
        self.strategy = type("S", (), {"root_device": torch.device("cuda", 0)})()


@pytest.mark.parametrize(
    ("name", "bf16", "fp8"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12, 1978.9e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12, 1513e12),
        ("NVIDIA H100 NVL", 835.5e12, 1670.5e12),
        ("NVIDIA H200", 989.4e12, 1978.9e12),  # SXM
        ("NVIDIA H200 NVL", 835.5e12, 1670.5e12),
    ],
)
def test_hopper_dense_peaks_by_name(monkeypatch, caplog, name, bf16, fp8):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert (
        peak_flops(cuda, torch.bfloat16)
        == peak_flops(cuda, "bf16")
        == peak_flops_for(cuda, "bf16-mixed")
        == bf16
    )
    assert peak_flops(cuda, "fp8") == peak_flops_for(cuda, "transformer-engine") == fp8
    cb, fp8_cb = SpeedMonitor(), SpeedMonitor(peak_precision="fp8")
    with caplog.at_level(logging.INFO):
        cb.on_train_start(_GpuTrainer(), None)
        fp8_cb.on_train_start(_GpuTrainer(), None)
    assert (cb.peak, fp8_cb.peak) == (bf16, fp8)
    said = [r.getMessage() for r in caplog.records if "speed/mfu is against" in r.getMessage()]
    assert said == [
        f"SpeedMonitor: speed/mfu is against {bf16 / 1e12:g} TFLOP/s, the dense bf16 peak of one {name}.",
        f"SpeedMonitor: speed/mfu is against {fp8 / 1e12:g} TFLOP/s, the dense fp8 peak of one {name}.",
    ]


def test_lightning_table_where_it_is_per_device_and_dense(monkeypatch):
    # H100 SXM and PCIe agree with Lightning; for a GPU outside the Hopper table Lightning's figure is used.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        cuda = torch.device("cuda", 0)
        for dtype in (torch.bfloat16, torch.float16):
            assert get_available_flops(cuda, dtype) and peak_flops(cuda, dtype) == get_available_flops(
                cuda, dtype
            )
        assert get_available_flops(cuda, "tfloat32") and peak_flops(cuda, "tf32") == get_available_flops(
            cuda, "tfloat32"
        )
    assert peak_flops(cuda, "fp8") is None  # A100: no FP8 tensor cores, and Lightning has no fp8 column
    # before Ampere there is no TF32: a 32-bit run's peak is the float32 one
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    v100 = get_available_flops(cuda, torch.float32)
    assert v100 and peak_flops(cuda, "tf32") == peak_flops(cuda, torch.float32) == v100
    with pytest.raises(ValueError, match="int4"):
        peak_flops(cuda, "int4")
    with pytest.raises(ValueError, match="peak_precision"):
        SpeedMonitor(peak_precision="bfloat16")


def test_unknown_device_logs_no_mfu_and_tells_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops_for(torch.device("cuda", 0), "bf16-mixed") is None
    assert peak_flops_for(torch.device("cpu"), "bf16-mixed") is None

    cb = SpeedMonitor()
    with caplog.at_level(logging.INFO):
        cb.on_train_start(_GpuTrainer(), None)
        cb.on_train_start(_GpuTrainer(), None)
    assert cb.peak is None
    told = [r.getMessage() for r in caplog.records if "no peak FLOP/s known" in r.getMessage()]
    assert len(told) == 1 and "Some Future GPU (bf16" in told[0] and "SpeedMonitor(peak_flops=...)" in told[0]
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
    make_trainer(tmp_path, [cb], accelerator="gpu").fit(
        TinyModule(batches=make_batches(8), record_losses=False)
    )
    assert cb.metrics["time/fwd_bwd_ms"] > 0 and cb.metrics["time/optimizer_ms"] > 0
