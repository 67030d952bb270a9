"""Tiny LightningModules and data for the callback tests (CPU, seconds)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint
from torch import nn

os.environ.setdefault("PL_DISABLE_FORK", "1")


def make_batches(
    n: int = 8, batch_size: int = 8, dim: int = 16, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, dim, generator=g), torch.randn(batch_size, 1, generator=g)) for _ in range(n)
    ]


class StatefulBatches:
    """An iterable of fixed batches that Lightning checkpoints (state_dict/load_state_dict)."""

    def __init__(self, batches: list[Any], shuffle: bool = False) -> None:
        self.batches = batches
        self.shuffle = shuffle
        self.pos = 0
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        # Shuffle per epoch with a seed derived from the epoch, so the order is part of the state.
        n = len(self.batches)
        if self.pos >= n:  # the previous epoch ended (Lightning may stop iterating at len())
            self.pos = 0
            self.epoch += 1
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(self.epoch))
            if self.shuffle
            else range(n)
        )
        while self.pos < len(self.batches):
            i = int(order[self.pos])
            self.pos += 1
            yield self.batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.epoch = state["pos"], state["epoch"]


class TinyModule(pl.LightningModule):
    """A small MLP regressor with AdamW and a per-step LR schedule.

    ``nan_at``: batch indices whose loss is made NaN (on ``nan_rank`` only when given);
    ``grad_nan_at``: batch indices whose loss stays finite but whose gradients are NaN.
    """

    def __init__(
        self,
        batches: Any = None,
        fused: bool = False,
        nan_at: tuple[int, ...] = (),
        nan_rank: int | None = None,
        grad_nan_at: tuple[int, ...] = (),
        dropout: float = 0.0,
        lr: float = 1e-2,
        val_batches: int = 2,
        dim: int = 16,
        hidden: int = 32,
        record_losses: bool = True,
        capturable: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.batches = batches if batches is not None else make_batches(dim=dim)
        self.fused = fused
        self.nan_at = set(nan_at)
        self.nan_rank = nan_rank
        self.grad_nan_at = set(grad_nan_at)
        self.lr = lr
        self.val_batches = val_batches
        self.losses: list[float] = []
        self.capturable = capturable
        self.record_losses = record_losses  # float(loss) syncs on CUDA: off for no-sync tests
        self.val_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if batch_idx in self.nan_at and (self.nan_rank is None or self.global_rank == self.nan_rank):
            loss = loss * float("nan")
        if batch_idx in self.grad_nan_at:
            # Value stays finite (0 * sqrt(0)); the gradient is 0 * inf = NaN.
            w = self.net[0].weight
            loss = loss + 0.0 * torch.sqrt(w.sum() * 0.0)
        if self.record_losses:
            self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def on_validation_start(self) -> None:
        self.val_calls += 1

    def configure_optimizers(self) -> Any:
        extra = {"capturable": True} if self.capturable else {}
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused or None, **extra)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> Any:
        if isinstance(self.batches, list):
            return StatefulBatches(self.batches)
        return self.batches

    def val_dataloader(self) -> Any:
        return StatefulBatches(make_batches(self.val_batches, seed=1, dim=self.net[0].in_features))


class ManualModule(TinyModule):
    """The same model trained with manual optimization."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        sched = self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched.step()
        return loss


def make_trainer(tmp_path: Any, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        # Checkpoint subclasses (AsyncCheckpoint) need it on; then Lightning adds no ModelCheckpoint.
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


def snapshot(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Any]:
    """Params, optimizer state and scheduler state as plain clones."""
    opt = trainer.optimizers[0]
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
        "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "lr": opt.param_groups[0]["lr"],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        for k in a["opt"][i]:
            assert torch.equal(a["opt"][i][k], b["opt"][i][k]), (i, k)
    assert a["sched"] == b["sched"]
    assert a["lr"] == b["lr"]


@pytest.fixture
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches()


def optimizer_state(trainer: pl.Trainer) -> list[torch.Tensor]:
    """Every parameter and every optimizer state tensor (AdamW exp_avg, ...) of every optimizer, cloned."""
    out: list[torch.Tensor] = []
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out.extend(v.clone() for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return out


class WindowProbe(pl.Callback):
    """Parameters and optimizer state before batch ``first`` and after batch ``last`` (one window)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.first:
            self.optimizers = trainer.optimizers
            self.before = optimizer_state(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.last:
            self.after = optimizer_state(trainer)

    def assert_unchanged(self) -> None:
        n_params = sum(len(g["params"]) for o in self.optimizers for g in o.param_groups)
        assert len(self.before) > n_params, "the optimizers have no state yet: pick a later window"
        assert len(self.before) == len(self.after)
        for i, (a, b) in enumerate(zip(self.before, self.after)):
            assert torch.equal(a, b), f"tensor {i} changed over a skipped step"

    def assert_changed(self) -> None:
        assert self.before and len(self.before) == len(self.after)
        assert any(not torch.equal(a, b) for a, b in zip(self.before, self.after))


class SyncErrorWindow(pl.Callback):
    """``torch.cuda.set_sync_debug_mode("error")`` from batch start to batch end, for batches ``>= from_batch``
    (earlier steps may sync: an optimizer's state does not exist before its first step); reset on an error."""

    def __init__(self, from_batch: int = 0) -> None:
        self.from_batch = from_batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.from_batch:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        torch.cuda.set_sync_debug_mode("default")
