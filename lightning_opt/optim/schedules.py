"""Learning-rate multipliers (``ScheduleConfig``) and ``ScheduleLR``, the ``LambdaLR`` that runs them and re-plans on resume."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

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


class ScheduleLR(LambdaLR):
    """``LambdaLR`` over a :class:`ScheduleConfig` that follows this run's length when it resumes.

    A plain ``LambdaLR`` saves a callable's ``__dict__`` and puts it back on load, so a ``ScheduleConfig`` as the
    lambda would get the checkpoint's ``total_steps``: a run resumed with a larger ``max_steps`` would keep the
    old, finished schedule. Here the checkpoint holds the planned ``total_steps`` instead; loading keeps this
    run's plan, and when the totals differ, the resumed steps follow it: step ``k`` gets the multiplier that a
    run planned for the new total has at step ``k`` (the current step's learning rate is set at once, so load
    the optimizer's state first, as Lightning does). :attr:`replanned` then says what changed.

    Example:
        >>> sched = ScheduleLR(optimizer, ScheduleConfig(name="wsd", total_steps=max_steps))
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: ScheduleConfig, last_epoch: int = -1) -> None:
        self.schedule = schedule
        # (checkpoint's total, this run's total, step) after loading a checkpoint planned for another length
        self.replanned: tuple[int, int, int] | None = None
        super().__init__(optimizer, schedule, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["schedule"], state["replanned"]
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)  # the plan is this run's, never the checkpoint's
        state["total_steps"] = self.schedule.total_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        state.pop("lr_lambdas", None)
        if "total_steps" not in state:
            raise ValueError("this learning-rate scheduler state has no total_steps: it was not written by ScheduleLR; "
                             "resume without the scheduler state (load the weights only) or with the scheduler that "
                             "wrote it")
        saved_total = state.pop("total_steps")
        for key in ("schedule", "replanned"):
            state.pop(key, None)
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        super().load_state_dict(state)
        self.replanned = None
        if saved_total is None or int(saved_total) == self.schedule.total_steps:
            return  # the same plan: the restored learning rates are this run's, bit for bit
        lrs = [base * fn(self.last_epoch) for fn, base in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                         for g in self.optimizer.param_groups]
        self.replanned = (int(saved_total), self.schedule.total_steps, self.last_epoch)

    def replan_message(self) -> str | None:
        """One line saying how the schedule changed on the last load, or ``None`` when it did not."""
        if self.replanned is None:
            return None
        old, new, step = self.replanned
        cfg = self.schedule
        return (f"learning-rate schedule re-planned on resume at step {step}: the checkpoint's run was planned for "
                f"{old} steps, this one for {new}; from step {step} on, the {cfg.name} schedule of a {new}-step run "
                f"(multiplier {cfg(step):.4g} at step {step}, {cfg(new):.4g} at step {new})")
