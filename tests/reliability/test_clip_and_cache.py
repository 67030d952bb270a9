"""Gradient clipping must not hide a non-finite gradient from NaNSkip, and an activation cache must not be read
for another target, other token files or settings, or when a shard is cut short.

NaNSkip: Inf/NaN gradients at fixed steps under no clipping, norm clipping and value clipping (which turns an Inf
into a finite +-clip_val), through Lightning's own clipping of a plain LightningModule and through
``TrainingModule.configure_gradient_clipping``, in both modes, with and without accumulation. Each run must be
bit-identical to a run that never saw the optimizer steps those batches belong to.

Activation cache: the CLT recipe ``main(args)`` builds a cache, then runs again on the same ``cache_dir`` with
another target of the same shape, other ``train_files``, another ``seq_len``: each is refused before training,
naming what differs; a truncated shard is refused at setup, naming the file and its sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_opt.callbacks import NaNSkip
from lightning_opt.modules.base import TrainingModule
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig
from tests.reliability._harness import VOCAB, Batches, TinyLM, inject, random_batches, state, state_diff, trainer
from tests.reliability._recipes import run_bad

STEPS = 12
# batch 0: the optimizer has no state yet (NaNSkip decides on the host); later ones take the device path
FAULTS = {0: "inf_grad", 5: "inf_grad", 8: "nan_grad"}
CLIPS = {
    "none": {},
    "norm": {"gradient_clip_val": 0.5},
    "value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
}


class TinyTrainingLM(TrainingModule):
    """Embedding -> linear head on the shared base (its optimizer, schedule and configure_gradient_clipping)."""

    def __init__(self, faults: dict[int, str] | None = None) -> None:
        super().__init__(OptimConfig(lr=0.02, weight_decay=0.01), ScheduleConfig(warmup_steps=2, total_steps=STEPS))
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
        self.faults = faults or {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        kind = self.faults.get(batch_idx)
        return loss if kind is None else inject(loss, self.model[1].weight, kind)


MODULES = {"lightning": lambda faults=None: TinyLM(dropout=0.0, faults=faults), "training_module": TinyTrainingLM}


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("clip", list(CLIPS))
def test_nonfinite_gradient_is_skipped_under_every_clipping(fault, tmp_path, module: str, clip: str) -> None:
    fault(f"Inf/NaN gradient with {clip} clipping ({module})",
          f"Inf/NaN gradients at steps {sorted(FAULTS)}, Trainer clipping {CLIPS[clip] or 'off'}")
    make = MODULES[module]
    batches = random_batches(STEPS, 0)
    problems = []
    for accumulate in (1, 2):
        bad = {b // accumulate for b in FAULTS}
        kw = {"accumulate_grad_batches": accumulate, **CLIPS[clip]}
        clean = make()
        t = trainer(tmp_path / f"ref{accumulate}", [], **kw)
        t.fit(clean, train_dataloaders=Batches([b for i, b in enumerate(batches) if i // accumulate not in bad]))
        reference = state(clean, t)
        for mode in ("device", "host"):
            skip = NaNSkip(mode=mode, max_consecutive_skips=None)
            faulty = make(faults=FAULTS)
            t = trainer(tmp_path / f"{mode}{accumulate}", [skip], **kw)
            t.fit(faulty, train_dataloaders=Batches(batches))
            diffs = state_diff(state(faulty, t), reference)
            ok = skip.skipped_total == len(bad) and not diffs
            fault.trial(ok, data_lost=bool(diffs), note="" if ok else f"{mode} x{accumulate}: {diffs[:3]}")
            if not ok:
                problems.append((mode, accumulate, skip.skipped_total, len(bad), diffs[:5]))
    assert not problems, problems
