"""A TQDM progress bar that reads training metrics from the GPU only when it redraws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class LazyProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` that shows logged metrics without a host-device sync per batch.

    Lightning converts every metric logged with ``prog_bar=True`` into a Python number after *every*
    batch (micro-batches included), whether or not the bar redraws: one ``.item()``, i.e. one host-device
    synchronisation per batch (docs/callbacks/lazy_progress_bar.md). Log such
    metrics with ``prog_bar=False`` and name them here: the bar reads them from
    ``trainer.callback_metrics`` (where Lightning keeps the tensors as they are) only when it redraws,
    every ``refresh_rate`` batches; that read is the one sync, documented and rare.

    Args:
        refresh_rate: redraw every this many batches (the reads happen only then).
        keys: metric names to show; each is shown under its last path component (``train/loss`` as
            ``loss``) unless that clashes with another entry.
        process_position: as in ``TQDMProgressBar``.
        leave: as in ``TQDMProgressBar``.

    Example::

        # in training_step: self.log("train/loss", loss)   (prog_bar=False: no per-batch read)
        trainer = Trainer(callbacks=[LazyProgressBar(refresh_rate=10, keys=["train/loss"])])
    """

    def __init__(
        self,
        refresh_rate: int = 10,
        keys: Sequence[str] = ("train/loss",),
        process_position: int = 0,
        leave: bool = False,
    ) -> None:
        if isinstance(keys, str):
            raise ValueError(f"LazyProgressBar: keys must be a list of metric names, got the string {keys!r}")
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.keys = list(keys)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        for key in self.keys:
            value = trainer.callback_metrics.get(key)
            if value is None:
                continue
            short = key.rsplit("/", 1)[-1]
            name = short if short not in items else key
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 else value.tolist()  # the one read, at redraw time
            items[name] = f"{value:.4g}" if isinstance(value, float) else value
        return items
