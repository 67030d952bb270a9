"""Logging helper shared by the callbacks: host floats straight to the Trainer's loggers."""

from __future__ import annotations

from lightning.pytorch import Trainer


def log_every(trainer: Trainer, own: int | None) -> int:
    """The logging interval: the callback's own, else the Trainer's ``log_every_n_steps``."""
    return own or trainer.log_every_n_steps or 50


def log_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Writes ``metrics`` to every logger at the current global step.

    Goes to the loggers directly rather than through ``LightningModule.log``: that path turns
    each float into a device tensor every step, which a callback logging a handful of host-side
    numbers does not need. Loggers write on rank 0 only.
    """
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=trainer.global_step)
