from __future__ import annotations

import gc
import os

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import CudaMemoryHygiene
from tests.callbacks.conftest import TinyModule, make_batches, make_trainer


class GcProbe(Callback):
    def __init__(self) -> None:
        self.enabled: list[bool] = []
        self.frozen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.frozen.append(gc.get_freeze_count())


def test_gc_frozen_and_disabled_during_fit_and_restored(tmp_path):
    assert gc.isenabled()
    probe = GcProbe()
    cb = CudaMemoryHygiene(gc_every_n_steps=2)
    trainer = make_trainer(tmp_path, [cb, probe], limit_val_batches=1, val_check_interval=3)
    trainer.fit(TinyModule(batches=make_batches(6)))
    assert probe.enabled == [False] * 6
    assert all(n > 0 for n in probe.frozen)
    # every 2 steps (3 collections) + before/after each of the 2 validations
    assert cb.collections == 3 + 2 * 2
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert cb.metrics == {}  # CPU: no CUDA stats


class Boom(TinyModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_gc_restored_after_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(tmp_path, [CudaMemoryHygiene()]).fit(Boom(batches=make_batches(4)))
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_config_is_validated():
    with pytest.raises(ValueError, match="empty_cache"):
        CudaMemoryHygiene(empty_cache="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gc_generation"):
        CudaMemoryHygiene(gc_generation=3)


class Oom(TinyModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            torch.empty(1 << 50, dtype=torch.uint8, device=self.device)  # 1 PiB
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_oom_writes_a_snapshot_and_logs_stats(tmp_path):
    cb = CudaMemoryHygiene(record_history=True, log_every_n_steps=1, snapshot_dir=str(tmp_path))
    trainer = make_trainer(tmp_path, [cb], accelerator="gpu", logger=False)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(Oom(batches=make_batches(4)))
    assert cb.snapshot_path is not None and os.path.getsize(cb.snapshot_path) > 0
    assert cb.metrics["memory/allocated_gib"] > 0
