"""Clamp the training loss into a range before backward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_opt.callbacks._logging import log_every, log_metrics


@dataclass
class LossClampConfig:
    """Validated settings of :class:`LossClamp` (see its docstring)."""

    min: float = 0.0
    max: float = 20.0
    gradient: Literal["zero", "scale"] = "zero"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min) and math.isfinite(self.max)) or self.min >= self.max:
            raise ValueError(f"LossClamp: need finite min < max, got min={self.min}, max={self.max}.")
        if self.gradient not in ("zero", "scale"):
            raise ValueError(f"LossClamp: gradient={self.gradient!r}; use 'zero' or 'scale'.")
        if self.gradient == "scale" and self.max <= 0:
            raise ValueError("LossClamp: gradient='scale' rescales by max/loss and needs max > 0.")


class LossClamp(Callback):
    """Clamps the training loss into ``[min, max]`` right before backward.

    The loss tensor handed to backward is modified in place in ``on_before_backward``, so it works
    with any LightningModule, in automatic and manual optimization. The clamp count is kept on the
    device and read only when logged.

    What happens to the gradient of a clamped loss depends on ``gradient``:

    * ``"zero"`` (default): ``torch.clamp`` semantics. Outside ``[min, max]`` the gradient is
      zero, so the batch contributes nothing to the update (an Adam step still runs with its
      decayed moments; combine with :class:`~lightning_opt.callbacks.NaNSkip` for a true skip).
    * ``"scale"``: the loss is multiplied by ``bound / loss`` (a constant), so its value equals the
      bound and its gradient keeps its direction, scaled down by ``bound / loss``.

    A NaN loss stays NaN (clamping cannot repair it); NaNSkip handles that case.

    Args:
        min: lower bound of the training loss.
        max: upper bound of the training loss.
        gradient: ``"zero"`` or ``"scale"``, see above.

    Example::

        trainer = Trainer(callbacks=[LossClamp(max=20.0)])
    """

    def __init__(
        self, min: float = 0.0, max: float = 20.0, gradient: Literal["zero", "scale"] = "zero"
    ) -> None:
        self.config = LossClampConfig(min, max, gradient)
        self._count: torch.Tensor | None = None  # clamped backward calls this run, on device
        self._base = 0  # clamps from earlier runs (restored state)
        self.metrics: dict[str, float] = {}
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    @property
    def clamped_total(self) -> int:
        """Number of clamped losses so far (reads the device counter: one sync)."""
        return self._base + (0 if self._count is None else int(self._count.item()))

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        cfg = self.config
        with torch.no_grad():
            hit = (loss < cfg.min) | (loss > cfg.max)
            n = hit.sum().to(torch.int64)
            self._count = n if self._count is None or self._count.device != n.device else self._count + n
        if cfg.gradient == "zero":
            loss.clamp_(cfg.min, cfg.max)
        else:
            # Above max: multiply by the constant max/loss (value max, gradient scaled). Below min
            # there is nothing to scale from (a loss of 0 stays 0): clamp, gradient zero. No clamp
            # on the upper side, whose rounding could land a hair above max and zero the gradient.
            with torch.no_grad():
                value = loss.detach()
                factor = torch.where(value > cfg.max, cfg.max / value, torch.ones_like(value))
            loss.mul_(factor)
            loss.clamp_(min=cfg.min)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._count is None or trainer.global_step % log_every(trainer, None) != 0:
            return
        # The count lives on the device. Log the copy started at the previous log step if it has
        # landed (no wait), then start a new non-blocking copy: the metric lags one interval.
        if self._host is not None and (self._event is None or self._event.query()):
            self.metrics = {"loss_clamp/clamped": float(self._base + int(self._host))}
            log_metrics(trainer, self.metrics)
        cuda = self._count.device.type == "cuda"
        self._host = torch.empty((), dtype=torch.int64, pin_memory=cuda)
        self._host.copy_(self._count, non_blocking=True)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"clamped_total": self.clamped_total}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base = int(state_dict["clamped_total"])
        self._count = self._host = None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._count is not None:
            self._base = self.clamped_total
            self._count = self._host = None
