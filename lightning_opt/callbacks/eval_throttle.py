"""Run validation by steps, by time, or adaptively under a wall-time budget."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_opt._internals import val_check_time_interval
from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics, log_step

_NEVER = 10**15  # a val_check_batch that ``(i + 1) % n == 0`` never reaches


@dataclass
class EvalThrottleConfig:
    """Validated settings of :class:`EvalThrottle` (see its docstring)."""

    every_n_steps: int | None = None
    every_seconds: float | None = None
    max_fraction: float | None = None
    max_val_batches: int | None = None
    final_full_validation: bool = True
    decide_every_n_steps: int = 10

    def __post_init__(self) -> None:
        chosen = [
            n for n in ("every_n_steps", "every_seconds", "max_fraction") if getattr(self, n) is not None
        ]
        if len(chosen) > 1:
            raise ValueError(
                f"EvalThrottle: set at most one of every_n_steps, every_seconds, max_fraction (got {chosen}); "
                "none keeps the Trainer's val_check_interval."
            )
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError(f"EvalThrottle: every_n_steps={self.every_n_steps}; it must be >= 1.")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ValueError(f"EvalThrottle: every_seconds={self.every_seconds}; it must be > 0.")
        if self.max_fraction is not None and not 0 < self.max_fraction < 1:
            raise ValueError(
                f"EvalThrottle: max_fraction={self.max_fraction}; use a fraction in (0, 1), e.g. 0.05."
            )
        if self.max_val_batches is not None and self.max_val_batches < 1:
            raise ValueError(
                f"EvalThrottle: max_val_batches={self.max_val_batches}; it must be >= 1 or None."
            )
        if self.decide_every_n_steps < 1:
            raise ValueError(
                f"EvalThrottle: decide_every_n_steps={self.decide_every_n_steps}; it must be >= 1."
            )


class EvalThrottle(KeyedStateCallback):
    """Decides when validation runs during ``fit``: every N steps, every T seconds, or adaptively.

    Lightning runs validation when ``(batch + 1) % trainer.val_check_batch == 0``; this callback
    sets ``trainer.val_check_batch`` after each training batch so that the check fires exactly
    when its schedule says so. Time-based decisions are taken on rank 0 every
    ``decide_every_n_steps`` steps and broadcast, so all ranks validate at the same step.

    With none of ``every_n_steps``, ``every_seconds``, ``max_fraction`` the Trainer's own schedule
    (``val_check_interval``, ``check_val_every_n_epoch``) decides when validation runs; the callback
    then only applies ``max_val_batches``, the final full validation and its metrics.

    Args:
        every_n_steps: validate every N optimizer steps.
        every_seconds: validate when this many seconds of training passed since the last one.
        max_fraction: adaptive: validate as often as possible while validation takes at most this
            fraction of wall time (e.g. ``0.05``).
        max_val_batches: cap on validation batches per run during training (``None``: no cap).
        final_full_validation: run an uncapped validation after the last training batch.
        decide_every_n_steps: how often time-based modes decide (and broadcast under DDP).

    Example::

        trainer = Trainer(callbacks=[EvalThrottle(max_fraction=0.05, max_val_batches=20)])
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_seconds: float | None = None,
        max_fraction: float | None = None,
        max_val_batches: int | None = None,
        final_full_validation: bool = True,
        decide_every_n_steps: int = 10,
    ) -> None:
        self.config = EvalThrottleConfig(
            every_n_steps,
            every_seconds,
            max_fraction,
            max_val_batches,
            final_full_validation,
            decide_every_n_steps,
        )
        self.val_runs = 0
        self.val_seconds = 0.0
        self.metrics: dict[str, float] = {}
        self.last_val_step = 0
        self._fit_start = 0.0
        self._last_val_end = 0.0
        self._last_val_duration = 0.0
        self._val_start: float | None = None
        self._orig_limit: int | float | None = None
        self._full_next = False
        cfg = self.config
        self._follows_trainer = cfg.every_n_steps is None and cfg.every_seconds is None and cfg.max_fraction is None
        self._trainer_check: int | float | None = None  # the Trainer's val_check_batch, once Lightning set it

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if val_check_time_interval(trainer) is not None:
            raise ValueError(
                "EvalThrottle: the Trainer has a time-based val_check_interval; remove it and use "
                "EvalThrottle(every_seconds=...) instead."
            )
        now = time.monotonic()
        self._fit_start = self._last_val_end = now
        self._orig_limit = trainer.limit_val_batches
        cap = self.config.max_val_batches
        if cap is not None:
            limit = trainer.limit_val_batches
            trainer.limit_val_batches = min(limit, cap) if isinstance(limit, int) else cap
        self._remember_trainer_check(trainer)
        if trainer.val_check_batch is not None or not self._follows_trainer:
            trainer.val_check_batch = self._idle_check()

    def _remember_trainer_check(self, trainer: Trainer) -> None:
        # Lightning sets val_check_batch from val_check_interval when it sets up the training data (after
        # on_fit_start on a fresh fit, before it on a resume) and again each epoch; None means not set yet
        if trainer.val_check_batch is not None:
            self._trainer_check = trainer.val_check_batch

    def _idle_check(self) -> int | float:
        """``val_check_batch`` between validations this callback runs: never, or the Trainer's schedule."""
        if not self._follows_trainer or self._trainer_check is None:
            return _NEVER
        return self._trainer_check

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remember_trainer_check(trainer)
        trainer.val_check_batch = self._idle_check()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._trainer_check is None:  # a resume inside an epoch calls no on_train_epoch_start
            self._remember_trainer_check(trainer)
        final = self._is_final(trainer)
        run = final and self.config.final_full_validation
        if not run and not self._follows_trainer:
            run = self._due(trainer)
        self._full_next = final
        trainer.val_check_batch = 1 if run else self._idle_check()
        if run:
            self._set_cap(trainer, full=final)
        if self._fit_start and log_step(trainer, pl_module, batch_idx):
            self._log(pl_module, on_step=True)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.monotonic()

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The last validation hook where Lightning accepts pl_module.log (logged per validation run).
        if self._val_start is None:
            return
        now = time.monotonic()
        self._last_val_duration = now - self._val_start
        self.val_seconds += self._last_val_duration
        self._last_val_end = now
        self._val_start = None
        self.val_runs += 1
        self.last_val_step = trainer.global_step
        trainer.val_check_batch = self._idle_check()
        if self._fit_start:
            self._log(pl_module, on_step=False)

    def _log(self, pl_module: LightningModule, on_step: bool) -> None:
        elapsed = time.monotonic() - self._fit_start
        self.metrics = {
            "eval_throttle/val_time_fraction": self.val_seconds / elapsed if elapsed > 0 else 0.0,
            "eval_throttle/val_runs": float(self.val_runs),
        }
        log_metrics(pl_module, self.metrics, on_step=on_step)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._orig_limit is not None:
            trainer.limit_val_batches = self._orig_limit
            self._orig_limit = None

    @override
    def state_key_settings(self) -> dict[str, Any]:
        return asdict(self.config)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "val_runs": self.val_runs,
            "val_seconds": self.val_seconds,
            "last_val_step": self.last_val_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.val_runs = int(state_dict["val_runs"])
        self.val_seconds = float(state_dict["val_seconds"])
        self.last_val_step = int(state_dict["last_val_step"])

    # -- decisions ------------------------------------------------------------------------------
    @staticmethod
    def _is_final(trainer: Trainer) -> bool:
        if (
            trainer.max_steps is not None
            and trainer.max_steps != -1
            and trainer.global_step >= trainer.max_steps
        ):
            return True
        max_epochs = trainer.max_epochs
        return bool(
            trainer.is_last_batch
            and max_epochs is not None
            and max_epochs != -1
            and trainer.current_epoch >= max_epochs - 1
        )

    def _due(self, trainer: Trainer) -> bool:
        cfg = self.config
        step = trainer.global_step
        if cfg.every_n_steps is not None:
            # Steps are the same on every rank: no communication needed.
            return step > 0 and step % cfg.every_n_steps == 0 and step != self.last_val_step
        if step % cfg.decide_every_n_steps != 0:
            return False
        since = time.monotonic() - self._last_val_end
        if cfg.every_seconds is not None:
            due = since >= cfg.every_seconds
        else:
            assert cfg.max_fraction is not None
            # Train at least d * (1 - f) / f seconds after a validation that took d seconds.
            f = cfg.max_fraction
            due = self.val_runs == 0 or since >= self._last_val_duration * (1 - f) / f
        # Wall clocks differ between ranks: rank 0 decides for everyone.
        return bool(trainer.strategy.broadcast(due, src=0))

    def _set_cap(self, trainer: Trainer, full: bool) -> None:
        cap = self.config.max_val_batches
        if cap is None:
            return
        orig = self._orig_limit if self._orig_limit is not None else 1.0
        # Lightning counts validation batches from limit_val_batches at the first run ...
        trainer.limit_val_batches = orig if full else (min(orig, cap) if isinstance(orig, int) else cap)
        counts = trainer.num_val_batches  # ... and later reads this live list at each run
        if not counts:
            return
        loaders = trainer.val_dataloaders
        flat = (
            list(loaders.values())
            if isinstance(loaders, dict)
            else (list(loaders) if isinstance(loaders, (list, tuple)) else [loaders])
        )
        for i, dl in enumerate(flat[: len(counts)]):
            try:
                length: int | float = len(dl)
            except TypeError:
                length = math.inf
            if full:
                limit = self._orig_limit if self._orig_limit is not None else 1.0
                counts[i] = (
                    min(length, limit)
                    if isinstance(limit, int)
                    else (length if math.isinf(length) else int(length * limit))
                )
            else:
                counts[i] = min(length, self.config.max_val_batches)
