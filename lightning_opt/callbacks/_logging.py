"""What the callbacks share: one logging gate, one way into Lightning's logging, and per-setting state keys.

Metrics go through ``LightningModule.log``, so they land in ``trainer.callback_metrics`` (where
``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` read them) and reach the loggers when the Trainer writes
its step metrics (``Trainer(log_every_n_steps=...)``). Values are logged as CPU tensors: a Python number would
be copied to the accelerator with a blocking copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_opt._internals import check_lightning

check_lightning()


def log_every(trainer: Trainer, own: int | None) -> int:
    """The logging interval in optimizer steps: the callback's own, else the Trainer's ``log_every_n_steps``."""
    return own or trainer.log_every_n_steps or 50


def optimizer_stepped(trainer: Trainer, pl_module: LightningModule, batch_idx: int) -> bool:
    """Whether the training batch that just ended stepped the optimizer: the last micro-batch of a gradient
    accumulation window or of the epoch (automatic optimization), every batch under manual optimization."""
    if not pl_module.automatic_optimization:
        return True
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or bool(trainer.is_last_batch)


def log_step(trainer: Trainer, pl_module: LightningModule, batch_idx: int, own: int | None = None) -> bool:
    """The gate for ``on_train_batch_end``: once per optimizer step, on steps that are multiples of the
    interval (:func:`log_every`)."""
    return optimizer_stepped(trainer, pl_module, batch_idx) and trainer.global_step % log_every(trainer, own) == 0


def trainer_logs_next_step(trainer: Trainer) -> bool:
    """Inside ``training_step``: whether the Trainer writes step metrics to its loggers after the optimizer
    step this batch is part of (every ``log_every_n_steps`` steps, and when training is about to stop)."""
    every = trainer.log_every_n_steps
    if not every:
        return False
    return (trainer.global_step + 1) % every == 0 or bool(trainer.should_stop)


def log_metrics(pl_module: LightningModule, metrics: dict[str, float], on_step: bool = True) -> None:
    """Logs host numbers through ``pl_module.log``: per step from training hooks (``on_step=True``), per epoch
    from ``on_validation_epoch_end`` and the like (``on_step=False``)."""
    to_loggers = bool(pl_module.trainer.loggers)
    for name, value in metrics.items():
        pl_module.log(name, torch.tensor(float(value)), on_step=on_step, on_epoch=not on_step, prog_bar=False,
                      logger=to_loggers, batch_size=1)


class KeyedStateCallback(Callback):
    """A callback whose checkpoint state is keyed by its settings (``Callback.state_key``), so two instances
    with different settings keep separate state. Subclasses define :meth:`state_key_settings`.

    When the Trainer has a single instance of the class and the checkpoint a single state for it under another
    key (a checkpoint keyed by the class name, or written with other settings), that state is loaded."""

    def state_key_settings(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def state_key(self) -> str:
        return self._generate_state_key(**self.state_key_settings())

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states or sum(type(cb) is type(self) for cb in trainer.callbacks) != 1:
            return
        name = type(self).__qualname__
        ours = [k for k in states if isinstance(k, str) and (k == name or k.startswith(name + "{"))]
        if len(ours) == 1:
            self.load_state_dict(copy.deepcopy(states[ours[0]]))
