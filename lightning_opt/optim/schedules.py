"""Learning-rate multipliers for ``torch.optim.lr_scheduler.LambdaLR``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

SCHEDULES = ("cosine", "wsd", "constant", "one_cycle")
ANNEALS = ("cos", "linear")


def cosine_interp(start: float, end: float, progress: float) -> float:
    """Half a cosine from ``start`` (``progress=0``) to ``end`` (``progress>=1``): the one cosine curve that every
    schedule in lightning-opt uses."""
    progress = min(max(progress, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))


def linear_interp(start: float, end: float, progress: float) -> float:
    """A straight line from ``start`` (``progress=0``) to ``end`` (``progress>=1``)."""
    progress = min(max(progress, 0.0), 1.0)
    return start + (end - start) * progress


@dataclass
class ScheduleConfig:
    """Warmup then cosine decay, warmup-stable-decay (trapezoid), constant, or one-cycle.

    Args:
        name: ``cosine``, ``wsd``, ``constant`` (warmup only) or ``one_cycle`` (torch's ``OneCycleLR`` for
            the learning rate only: ``anneal`` from ``start_ratio`` up to the peak over ``warmup_steps``, then
            ``anneal`` down to ``min_ratio`` at step ``total_steps - 1``).
        warmup_steps: linear warmup from ``lr / warmup_steps`` (``one_cycle``: the rising phase; torch's
            ``pct_start * total_steps``).
        total_steps: steps over which the schedule runs (the Trainer's ``max_steps``).
        decay_fraction: for ``wsd``, the last fraction of steps that decays linearly to ``min_ratio``.
        min_ratio: final multiplier.
        start_ratio: for ``one_cycle``, the first step's multiplier (torch's ``1 / div_factor``; 0.04 = 1/25).
        anneal: for ``one_cycle``, the shape of both phases: ``cos`` or ``linear`` (torch's ``anneal_strategy``).
    """

    name: str = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000
    decay_fraction: float = 0.4
    min_ratio: float = 0.1
    start_ratio: float = 0.04
    anneal: str = "cos"

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule {self.name!r} is unknown; choose one of {SCHEDULES}")
        if self.total_steps <= 0:
            raise ValueError(f"schedule total_steps={self.total_steps} must be positive")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps}]")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be in [0, 1]")
        if not 0 <= self.min_ratio <= 1:
            raise ValueError(f"min_ratio={self.min_ratio} must be in [0, 1]")
        if not 0 <= self.start_ratio <= 1:
            raise ValueError(f"start_ratio={self.start_ratio} must be in [0, 1]")
        if self.anneal not in ANNEALS:
            raise ValueError(f"anneal={self.anneal!r} is unknown; choose one of {ANNEALS}")

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self)

    def stretched(self, total_steps: int) -> ScheduleConfig:
        """This schedule over ``total_steps`` steps (the warmup cut to fit), every other setting kept."""
        if total_steps == self.total_steps:
            return self
        return replace(self, warmup_steps=min(self.warmup_steps, total_steps), total_steps=total_steps)


def _one_cycle(step: int, cfg: ScheduleConfig) -> float:
    interp = cosine_interp if cfg.anneal == "cos" else linear_interp
    peak = max(cfg.warmup_steps - 1, 0)  # torch: the rising phase ends at pct_start * total_steps - 1
    if step < peak:
        return interp(cfg.start_ratio, 1.0, step / peak)
    return interp(1.0, cfg.min_ratio, (step - peak) / max(1, cfg.total_steps - 1 - peak))


def lr_multiplier(step: int, cfg: ScheduleConfig) -> float:
    if cfg.name == "one_cycle":
        return _one_cycle(step, cfg)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        return cosine_interp(1.0, cfg.min_ratio, (step - cfg.warmup_steps) / span)
    decay_start = cfg.total_steps - int(cfg.decay_fraction * cfg.total_steps)
    if step < decay_start:
        return 1.0
    return linear_interp(1.0, cfg.min_ratio, (step - decay_start) / max(1, cfg.total_steps - decay_start))
