"""What every lightning-opt LightningModule shares: optimizer, schedule and compile settings, token counting."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opt._serialization import register_safe_globals
from lightning_opt.callbacks.async_checkpoint import refuse_damaged_checkpoint
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from lightning_opt.optim.schedules import ScheduleConfig, ScheduleLR

__all__ = ["CompileConfig", "TrainingModule", "as_config", "register_safe_globals"]

COMPILE_MODES = ("none", "full", "regional")


@dataclass
class CompileConfig:
    """How a module runs its training computation through ``torch.compile``: one type for every module (a recipe's
    ``model.compile``). ``compile: true`` / ``false`` in a config mean ``mode: full`` / ``none``.

    Args:
        mode: ``none`` (eager), ``full`` (the module's compiled regions: the whole GPT; the CLT's encoder and loss
            terms; SPD's loss computation) or ``regional`` (SPD only: the target's repeated blocks, the masked
            layers and the KL loss compiled once each; see ``docs/spd.md``).
        backend: the ``torch.compile`` backend (``inductor``; ``eager`` traces with dynamo only, for finding
            graph breaks without code generation).
        options: inductor settings (``torch.compile(options=...)``), e.g. ``{"coordinate_descent_tuning": true}``;
            names inductor does not have are refused, and options with ``mode: none`` warn that they do nothing.
    """

    mode: str = "none"
    backend: str = "inductor"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.mode, bool):
            self.mode = "full" if self.mode else "none"
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"compile.mode={self.mode!r} is unknown; choose one of {COMPILE_MODES} (or true / false)")
        self.options = dict(self.options or {})
        if not self.options:
            return
        if self.mode == "none":
            warnings.warn(f"compile.options={self.options!r} take effect only with compile.mode full or regional; "
                          "this run compiles nothing", stacklevel=3)
        from torch._inductor import config as inductor_config  # loads inductor: only when options are given

        unknown = sorted(k for k in self.options if k not in inductor_config.get_config_copy())
        if unknown:
            raise ValueError(
                f"compile.options: {unknown} are not torch._inductor.config settings in torch {torch.__version__}; "
                "see torch._inductor.config (e.g. coordinate_descent_tuning, max_autotune)"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @classmethod
    def of(cls, value: Any) -> CompileConfig:
        """``value`` as a :class:`CompileConfig`: ``None`` gives eager, a bool ``full`` / ``none``, a string that mode,
        a dict its fields."""
        if isinstance(value, (bool, str)):
            return cls(mode=value)
        return as_config(cls, value)


register_safe_globals(OptimConfig, ScheduleConfig, CompileConfig)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if hasattr(value, "__dataclass_fields__"):
        value = {f: getattr(value, f) for f in value.__dataclass_fields__}
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def normalised(value: Any) -> Any:
    """``value`` with lists as tuples and dataclasses as dicts, recursively: a config as a checkpoint saved it
    (YAML and LightningCLI give lists where the dataclass holds tuples) compares equal to the same config."""
    if hasattr(value, "__dataclass_fields__"):
        value = {f: getattr(value, f) for f in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(normalised(v) for v in value)
    return value


def as_config(cls: type, value: Any) -> Any:
    """``value`` as a ``cls`` dataclass: ``None`` gives the defaults, a dict (or jsonargparse ``Namespace``) its
    fields, as a checkpoint's hyperparameters hold them when LightningCLI made it or a user edited it."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        from_dict = getattr(cls, "from_dict", None)
        return from_dict(value) if from_dict is not None else cls(**value)
    raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


def _differs(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and torch.equal(x, y))
    try:
        return bool(normalised(x) != normalised(y))
    except Exception:  # values that cannot be compared count as different
        return True


def check_checkpoint_matches(
    module: L.LightningModule,
    checkpoint: dict[str, Any],
    ours: dict[str, Any] | None = None,
    theirs: dict[str, Any] | None = None,
) -> None:
    """Raise a ``ValueError`` that names the config differences when a checkpoint's weights do not fit.

    Only a shape or key mismatch is an error (changing the learning rate on resume is fine); the message
    lists the hyperparameters that differ so the user sees *which setting* made another model.
    """
    saved, current = checkpoint.get("state_dict", {}), module.state_dict()
    shape_diff = [k for k in current if k in saved and tuple(saved[k].shape) != tuple(current[k].shape)]
    missing = [k for k in current if k not in saved]
    if not shape_diff and not missing:
        return
    a = _flat(ours if ours is not None else dict(module.hparams))
    b = _flat(theirs if theirs is not None else dict(checkpoint.get("hyper_parameters", {})))
    diffs = [f"{k}={b.get(k)!r} (checkpoint) vs {a[k]!r} (this run)" for k in a if k in b and _differs(a[k], b[k])]
    detail = "; ".join(diffs[:8]) or f"no saved config to compare; weights differ at {(shape_diff or missing)[:3]}"
    raise ValueError(
        f"checkpoint was made by another model or config ({type(module).__name__}): {detail}. "
        "Resume with the checkpoint's config, or start a new run without ckpt_path."
    )


def check_resume_length(module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
    """Refuse to resume a fit whose ``max_steps`` ends before the checkpoint's step (it would train nothing)."""
    trainer = module._trainer
    max_steps = int(trainer.max_steps) if trainer is not None and trainer.max_steps is not None else -1
    step = int(checkpoint.get("global_step", 0))
    if trainer is not None and trainer.state.fn == "fit" and 0 < max_steps < step:
        raise ValueError(
            f"the checkpoint is at step {step}, after this run's end (trainer.max_steps={max_steps}); pass a "
            f"max_steps above {step} (or a larger train_tokens) to train on, or load the checkpoint without resuming"
        )


def report_replanned_schedule(module: L.LightningModule) -> None:
    """Log (rank 0, one line) how the learning-rate schedule changed when a checkpoint of another length resumed."""
    schedulers = module.lr_schedulers() if module._trainer is not None else None
    for sched in schedulers if isinstance(schedulers, list) else [schedulers]:
        message = sched.replan_message() if isinstance(sched, ScheduleLR) else None
        if message:
            rank_zero_info(message)


class TrainingModule(L.LightningModule):
    """Base class: builds optimizers from :class:`OptimConfig` and a per-step schedule.

    ``compile`` (:class:`CompileConfig`) says how the subclass compiles its training computation.

    Subclasses set ``self.model`` and may override :meth:`optimizer_roles` to say which parameters are
    hidden matrices (Muon), embeddings and the head. Several optimizers are wrapped in one
    :class:`CombinedOptimizer`, so automatic optimization, gradient clipping and accumulation keep working.

    Learning rates are not logged here: attach Lightning's ``LearningRateMonitor`` (the recipes do), which
    logs ``lr/<group name>`` for the named parameter groups (``lr/muon``, ``lr/embeddings``, ``lr/decay``, ...).

    ``tokens_seen`` counts training tokens over all ranks and is saved in checkpoints.
    """

    model: nn.Module

    compile_modes: tuple[str, ...] = ("none", "full")

    def __init__(self, optim: OptimConfig | None = None, schedule: ScheduleConfig | None = None,
                 compile: CompileConfig | bool | None = None) -> None:
        super().__init__()
        self.optim_config = as_config(OptimConfig, optim)
        self.schedule_config = as_config(ScheduleConfig, schedule)
        self.compile_config = CompileConfig.of(compile)
        if self.compile_config.mode not in self.compile_modes:
            raise ValueError(f"compile.mode={self.compile_config.mode!r} is not one of {type(self).__name__}'s "
                             f"modes {self.compile_modes}")
        self.tokens_seen = 0

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, weights_only: bool | None = True,
                             **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``, reading the file with ``weights_only=True`` by default (torch
        before 2.6 defaults to unpickling anything): tensors, plain data and our registered configs only. A file
        that does not match its ``.sha256`` sidecar (written by ``AsyncCheckpoint``) is refused."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isfile(checkpoint_path):
            refuse_damaged_checkpoint(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, weights_only=weights_only, **kwargs)

    def optimizer_roles(self) -> dict[str, list[nn.Parameter] | None]:
        return {"hidden": None, "embeddings": None, "head": None}

    def schedule_total_steps(self) -> int:
        """Optimizer steps the schedules span: ``Trainer(max_steps)`` when set, else the schedule config's."""
        if self._trainer is not None and self.trainer.max_steps and self.trainer.max_steps > 0:
            return int(self.trainer.max_steps)
        return int(self.schedule_config.total_steps)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        # the schedule follows the run's length (max_steps) when it is set
        schedule = self.schedule_config.stretched(self.schedule_total_steps())
        optimizers = build_optimizer(self.model, self.optim_config, **self.optimizer_roles())
        optimizer = optimizers[0] if len(optimizers) == 1 else CombinedOptimizer(optimizers)
        # a resumed run of another length follows its own plan, not the checkpoint's (ScheduleLR)
        scheduler = ScheduleLR(optimizer, schedule)
        # "name": Lightning's LearningRateMonitor logs each group's rate as lr/<group name> (lr/muon, lr/head, ...)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    @override
    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Clip without the precision plugin when no loss scaler is in use.

        Lightning refuses to clip for optimizers that unscale internally (fused AdamW) under any
        mixed precision, but with bf16 there is no scaler and the gradients are already true gradients.
        ``clip_grad_norm_`` keeps the norm on the device: no host sync.
        """
        if not gradient_clip_val:
            return
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:  # fp16: Lightning's path
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, foreach=True)

    def count_tokens(self, batch_tokens: int) -> None:
        self.tokens_seen += batch_tokens * max(1, self.trainer.world_size if self._trainer else 1)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_matches(self, checkpoint)
        check_resume_length(self, checkpoint)
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))

    @override
    def on_train_start(self) -> None:
        report_replanned_schedule(self)

    @staticmethod
    def peak_memory_bytes(device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
