"""Learning-rate multipliers for ``torch.optim.lr_scheduler.LambdaLR``."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("cosine", "wsd", "constant")


@dataclass
class ScheduleConfig:
    """Warmup then cosine decay, or warmup-stable-decay (trapezoid).

    Args:
        name: ``cosine``, ``wsd`` or ``constant`` (warmup only).
        warmup_steps: linear warmup from ``lr / warmup_steps``.
        total_steps: steps over which the schedule runs (the Trainer's ``max_steps``).
        decay_fraction: for ``wsd``, the last fraction of steps that decays linearly to ``min_ratio``.
        min_ratio: final multiplier.
    """

    name: str = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1000
    decay_fraction: float = 0.4
    min_ratio: float = 0.1

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

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self)


def lr_multiplier(step: int, cfg: ScheduleConfig) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_ratio + (1 - cfg.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = cfg.total_steps - int(cfg.decay_fraction * cfg.total_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, cfg.total_steps - decay_start))
    return 1.0 - (1.0 - cfg.min_ratio) * progress
