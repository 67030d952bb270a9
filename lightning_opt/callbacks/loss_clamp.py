"""Clamp the training loss into a range before backward (optionally skipping the step)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics, log_step
from lightning_opt.callbacks.nan_skip import NaNSkip


@dataclass
class LossClampConfig:
    """Validated settings of :class:`LossClamp` (see its docstring)."""

    min: float = 0.0
    max: float = 20.0
    gradient: Literal["zero", "scale"] = "zero"
    skip_step_when_clamped: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min) and math.isfinite(self.max)) or self.min >= self.max:
            raise ValueError(f"LossClamp: need finite min < max, got min={self.min}, max={self.max}.")
        if self.gradient not in ("zero", "scale"):
            raise ValueError(f"LossClamp: gradient={self.gradient!r}; use 'zero' or 'scale'.")
        if self.gradient == "scale" and self.max <= 0:
            raise ValueError("LossClamp: gradient='scale' rescales by max/loss and needs max > 0.")
        if not isinstance(self.skip_step_when_clamped, bool):
            raise TypeError(
                f"LossClamp: skip_step_when_clamped={self.skip_step_when_clamped!r}; use True or False."
            )


class LossClamp(KeyedStateCallback):
    """Clamps the training loss into ``[min, max]`` right before backward.

    The loss tensor handed to backward is modified in place in ``on_before_backward``, so it works
    with any LightningModule, in automatic and manual optimization. The bounds are in the units of
    what ``training_step`` returned: Lightning divides the loss by ``accumulate_grad_batches``
    (automatic optimization) and a GradScaler multiplies it by its scale before backward; the bounds
    are converted the same way. The clamp count is kept on the device and read only when logged.

    What happens to the gradient of a clamped loss depends on ``gradient``:

    * ``"zero"`` (default): ``torch.clamp`` semantics. Outside ``[min, max]`` the gradient is
      zero, so the batch contributes nothing to the gradient, but the optimizer still steps (an
      Adam-type optimizer moves the parameters with its decayed moments). For no step at all,
      set ``skip_step_when_clamped=True``.
    * ``"scale"``: the loss is multiplied by ``bound / loss`` (a constant), so its value equals the
      bound and its gradient keeps its direction, scaled down by ``bound / loss``.

    A NaN loss stays NaN (clamping cannot repair it). With :class:`~lightning_opt.callbacks.NaNSkip`
    among the callbacks, in either order, a loss that was NaN or Inf before clamping skips the step.

    Args:
        min: lower bound of the training loss.
        max: upper bound of the training loss.
        gradient: ``"zero"`` or ``"scale"``, see above.
        skip_step_when_clamped: skip the optimizer step (of the whole accumulation window) when a
            loss was clamped: parameters, optimizer state and step-interval LR schedulers stay as
            if the window never happened. The skip is applied by
            :class:`~lightning_opt.callbacks.NaNSkip`, which must be among the Trainer's callbacks
            (in any order); such skips count towards its ``max_consecutive_skips``.

    Example::

        trainer = Trainer(callbacks=[LossClamp(max=20.0, skip_step_when_clamped=True), NaNSkip()])
    """

    def __init__(
        self,
        min: float = 0.0,
        max: float = 20.0,
        gradient: Literal["zero", "scale"] = "zero",
        skip_step_when_clamped: bool = False,
    ) -> None:
        self.config = LossClampConfig(min, max, gradient, skip_step_when_clamped)
        self._count: torch.Tensor | None = None  # clamped backward calls this run, on device
        self._base = 0  # clamps from earlier runs (restored state)
        self.metrics: dict[str, float] = {}
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._nan_skips: list[NaNSkip] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._nan_skips = [c for c in trainer.callbacks if isinstance(c, NaNSkip)]
        if stage == "fit" and self.config.skip_step_when_clamped and not self._nan_skips:
            raise ValueError(
                "LossClamp(skip_step_when_clamped=True) skips optimizer steps through NaNSkip, which is "
                "not among the Trainer's callbacks: add NaNSkip() to callbacks (in any order), or "
                "set skip_step_when_clamped=False."
            )

    @property
    def clamped_total(self) -> int:
        """Number of clamped losses so far (reads the device counter: one sync)."""
        return self._base + (0 if self._count is None else int(self._count.item()))

    @staticmethod
    def _units(trainer: Trainer | None, pl_module: LightningModule | None) -> float | torch.Tensor:
        """The factor between the loss handed to backward and what ``training_step`` returned."""
        if trainer is None or pl_module is None:
            return 1.0
        factor: float | torch.Tensor = 1.0
        if pl_module.automatic_optimization:  # Lightning's closure divides by the window length
            factor = 1.0 / trainer.accumulate_grad_batches
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            # The scale as a device tensor (``get_scale()`` would read it on the host: a sync).
            scale = getattr(scaler, "_scale", None)
            if scale is not None:
                factor = scale * factor
        return factor

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        cfg = self.config
        units = self._units(trainer, pl_module)
        lo, hi = cfg.min * units, cfg.max * units
        with torch.no_grad():
            value = loss.detach()
            hit = (value < lo) | (value > hi)
            if self._count is None or self._count.device != value.device:
                self._count = torch.zeros((), dtype=torch.int64, device=value.device)
            self._count.add_(hit if hit.dim() == 0 else hit.sum())
            if self._nan_skips:
                # The loss as training_step made it (a copy: the clamp below is in place), whichever callback
                # runs first; NaNSkip checks it with the gradients, in the same read.
                before = value.clone()
                clamped = (hit if hit.dim() == 0 else hit.any()) if cfg.skip_step_when_clamped else None
                for nan_skip in self._nan_skips:
                    nan_skip._note_loss(before, clamped)
        if cfg.gradient == "zero":
            loss.clamp_(lo, hi)
        else:
            # Above max: multiply by the constant max/loss (value max, gradient scaled). Below min
            # there is nothing to scale from (a loss of 0 stays 0): clamp, gradient zero. No clamp
            # on the upper side, whose rounding could land a hair above max and zero the gradient.
            with torch.no_grad():
                factor = torch.where(value > hi, hi / value, torch.ones_like(value))
            loss.mul_(factor)
            loss.clamp_(min=lo)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._count is None or not log_step(trainer, pl_module, batch_idx):
            return
        # The count lives on the device. Log the copy started at the previous log step if it has
        # landed (no wait), then start a new non-blocking copy: the metric lags one interval.
        if self._host is not None and (self._event is None or self._event.query()):
            self.metrics = {"loss_clamp/clamped": float(self._base + int(self._host))}
            log_metrics(pl_module, self.metrics)
        cuda = self._count.device.type == "cuda"
        self._host = torch.empty((), dtype=torch.int64, pin_memory=cuda)
        self._host.copy_(self._count, non_blocking=True)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @override
    def state_key_settings(self) -> dict[str, Any]:
        return asdict(self.config)

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
