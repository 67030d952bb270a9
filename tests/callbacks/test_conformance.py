"""Every callback through the same checks: constructible, trains, fit twice, state round trip,
idempotent teardown, and (all together, shared to keep it fast) 2-process DDP on gloo."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_opt.callbacks import (
    AsyncCheckpoint,
    CudaMemoryHygiene,
    EvalThrottle,
    LossClamp,
    NaNSkip,
    SpeedMonitor,
)
from tests._fork import one_thread_for_forks
from tests.callbacks.conftest import TinyModule, make_batches, make_trainer


def _make(name: str, tmp_path: Any) -> Callback:
    return {
        "NaNSkip": lambda: NaNSkip(),
        "LossClamp": lambda: LossClamp(max=0.5),
        "AsyncCheckpoint": lambda: AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_n_steps=2),
        "EvalThrottle": lambda: EvalThrottle(every_n_steps=2, max_val_batches=1),
        "CudaMemoryHygiene": lambda: CudaMemoryHygiene(gc_every_n_steps=2),
        "SpeedMonitor": lambda: SpeedMonitor(log_every_n_steps=2),
    }[name]()


NAMES = ["NaNSkip", "LossClamp", "AsyncCheckpoint", "EvalThrottle", "CudaMemoryHygiene", "SpeedMonitor"]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_conformance(tmp_path, name):
    cb = _make(name, tmp_path)
    for run in range(2):  # the same instance survives two fits
        module = TinyModule(batches=make_batches(4), val_batches=3)
        trainer = make_trainer(
            tmp_path / f"run{run}",
            [cb],
            limit_val_batches=3,
            logger=CSVLogger(tmp_path / f"run{run}"),
            log_every_n_steps=2,
        )
        trainer.fit(module)
        assert trainer.global_step == 4
        assert all(torch.isfinite(p).all() for p in module.parameters())
    state = cb.state_dict()
    other = _make(name, tmp_path)
    other.load_state_dict(state)
    assert _equal(other.state_dict(), state)
    torch.save(state, tmp_path / "state.pt")  # serialisable, and loadable without pickled code
    torch.load(tmp_path / "state.pt", weights_only=True)
    cb.teardown(trainer, module, "fit")
    cb.teardown(trainer, module, "fit")


class _DDPChecks(Callback):
    """Runs inside each spawned rank; raises there when the ranks disagree."""

    def on_train_end(self, trainer, pl_module):
        by_type = {type(c).__name__: c for c in trainer.callbacks}
        skip, throttle = by_type["NaNSkip"], by_type["EvalThrottle"]
        skip.resolve()
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        mine = torch.tensor([flat.sum().item(), skip.skipped_total, throttle.val_runs], dtype=torch.float64)
        all_ranks = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(all_ranks, mine)
        if not torch.equal(all_ranks[0], all_ranks[1]):
            raise AssertionError(f"ranks disagree: {all_ranks}")
        if skip.skipped_total != 1:
            raise AssertionError(f"expected 1 skipped step on every rank, got {skip.skipped_total}")
        if throttle.val_runs != 3:  # steps 2 and 4, and the final full validation at step 6
            raise AssertionError(f"expected 3 validations, got {throttle.val_runs}")
        if not torch.isfinite(flat).all():
            raise AssertionError("non-finite parameters")


def test_ddp_all_callbacks_nan_on_one_rank(tmp_path):
    """2 ranks (gloo): a NaN loss on rank 1 only must skip the step on both, without a hang."""
    callbacks = [
        NaNSkip(),
        LossClamp(max=50.0),
        # Time-based triggers: rank 0 decides and broadcasts (every 3 and every 2 steps here).
        AsyncCheckpoint(dirpath=str(tmp_path / "ck"), every_minutes=1e-9, decide_every_n_steps=3),
        EvalThrottle(every_seconds=1e-9, decide_every_n_steps=2, max_val_batches=1),
        CudaMemoryHygiene(gc_every_n_steps=2),
        SpeedMonitor(log_every_n_steps=2),
        _DDPChecks(),
    ]
    module = TinyModule(batches=make_batches(6), nan_at=(2,), nan_rank=1, val_batches=2)
    trainer = make_trainer(
        tmp_path,
        callbacks,
        strategy="ddp_fork",  # the ranks start with what this process imported instead of importing it again
        devices=2,
        limit_val_batches=2,
        use_distributed_sampler=False,
    )
    with one_thread_for_forks():
        trainer.fit(module)
    names = sorted(n for n in os.listdir(tmp_path / "ck") if n.endswith(".ckpt"))
    assert names == ["last.ckpt", "step=000000003.ckpt", "step=000000006.ckpt"]
    ck = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    assert ck["global_step"] == 6
