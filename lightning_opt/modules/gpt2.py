"""The GPT-2 speedrun as a LightningModule."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_opt.callbacks._logging import trainer_logs_next_step
from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution
from lightning_opt.modules.base import CompileConfig, TrainingModule, normalised, register_safe_globals
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

register_safe_globals(GPTConfig, GPTExecution)

# a checkpoint's model_config that predates a field is read with the field's default
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}


def saved_model_config(saved: Any) -> dict[str, Any]:
    """A checkpoint's ``model_config`` (a ``GPTConfig``, or the dict LightningCLI saved) as a normalised dict
    of every architecture field: fields it lacks at their defaults, lists as tuples. A model config that
    ``GPTConfig`` refuses is compared as saved, less any execution settings (they may differ on resume)."""
    if not isinstance(saved, GPTConfig):
        try:
            saved = GPTConfig.from_dict(saved)
        except (TypeError, ValueError):  # keys GPTConfig refuses: compare the values as saved
            values = saved.as_dict() if hasattr(saved, "as_dict") else dict(saved)
            saved = {**_FIELD_DEFAULTS, **{k: v for k, v in values.items() if k not in GPTExecution.__dataclass_fields__}}
    return normalised(saved.to_dict() if isinstance(saved, GPTConfig) else saved)


class GPT2SpeedrunModule(TrainingModule):
    """Train a :class:`~lightning_opt.models.gpt2.GPT` on ``(x, y)`` token batches.

    Subclass to customise: override :meth:`compute_loss` for another loss, or
    :meth:`configure_optimizers` for another optimizer (see ``docs/gpt2.md``).

    Args:
        model_config: the architecture (what the weights mean): a checkpoint resumes only into the same one.
        optim: optimizer settings (``muon`` gives the speedrun's Muon + Adam split).
        schedule: learning-rate schedule; its length follows ``Trainer(max_steps=...)``.
        execution: how the model is computed and regularised in training (attention kernel, FP8 matmuls, loss
            kernel, activation checkpointing, dropout, LayerDrop; :class:`~lightning_opt.models.gpt2.GPTExecution`):
            saved in the hyperparameters, free to change when a checkpoint resumes or loads.
        compile: wrap the model in ``torch.compile`` (``dynamic=False``): ``True`` or a
            :class:`~lightning_opt.modules.base.CompileConfig` (``mode: full``, its ``backend`` and inductor
            ``options``, e.g. ``{"coordinate_descent_tuning": True}``: longer compile, faster kernels).
        init_from: start from Hugging Face GPT-2 weights (fine-tuning): a local directory with ``config.json``
            and ``model.safetensors`` (or ``pytorch_model.bin``) or a hub id such as ``gpt2`` (needs the ``hf``
            extra); see :meth:`~lightning_opt.models.gpt2.GPT.from_pretrained`. ``model_config`` must be the
            classic architecture of that shape (``vocab_multiple: 1``; ``dropout`` and ``block_size`` up to the
            files' ``n_positions`` are free, as is ``execution``). The weights are read when a Trainer first sets the module up; a
            checkpoint (``ckpt_path``, ``load_from_checkpoint``) replaces them and needs no HF files.

    ``trainer.test`` logs ``test/loss`` and ``test/ppl`` over ``(x, y)`` batches; ``trainer.predict`` returns the
    next-token logits ``[B, T, vocab_size]`` (float32) of ``x`` or ``(x, y)`` batches.

    Logged keys: ``train/loss``, ``val/loss``, ``val/ppl``, ``tokens_seen`` (on the steps the logger writes,
    ``Trainer(log_every_n_steps=...)``: logging a Python number syncs the GPU). Learning rates come from
    Lightning's ``LearningRateMonitor`` (the recipe attaches it): ``lr/<group name>``, e.g. ``lr/muon``.
    Exposes ``flops_per_batch`` (Lightning's convention) once the first batch is seen.
    """

    def __init__(
        self,
        model_config: GPTConfig | None = None,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        execution: GPTExecution | None = None,
        compile: CompileConfig | bool | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__(optim, schedule, compile)
        # a dict (a checkpoint's hyperparameters as LightningCLI saved them) is normalised: lists become tuples
        self.model_config = GPTConfig.from_dict(model_config if model_config is not None else {})
        self.execution = GPTExecution.from_dict(execution) if execution is not None else GPTExecution()
        execution = self.execution  # the hyperparameters show what this run computes with, defaults included
        self.save_hyperparameters()
        self.model = GPT(self.model_config, self.execution)
        self.init_from = init_from
        self._init_loaded = init_from is None  # HF weights are read at the first setup, unless a checkpoint came
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.flops_per_batch: float | None = None

    @override
    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        seq_len = getattr(data, "seq_len", None)
        if seq_len is not None and seq_len > self.model_config.block_size:
            raise ValueError(
                f"data.seq_len={seq_len} exceeds the model's context model_config.block_size="
                f"{self.model_config.block_size}; lower data.seq_len or raise block_size"
            )
        if not self._init_loaded:  # before Lightning restores a ckpt_path, which then wins
            self.load_init_weights()

    def load_init_weights(self) -> None:
        """Copy the Hugging Face GPT-2 weights named by ``init_from`` into the model."""
        pretrained = GPT.from_pretrained(self.init_from, self.model_config, self.execution)
        self.model.load_state_dict(pretrained.state_dict())
        self._init_loaded = True

    @override
    def configure_model(self) -> None:
        cc = self.compile_config
        if cc.enabled and not getattr(self, "_compiled", False):
            self.model.compile(dynamic=False, backend=cc.backend, options=cc.options or None)
            self._compiled = True

    @override
    def optimizer_roles(self) -> dict[str, list[nn.Parameter] | None]:
        m = self.model
        head = [] if self.model_config.tie_embeddings else [m.lm_head.weight]
        return {"hidden": m.hidden_matrices(), "embeddings": None, "head": head}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        theirs = checkpoint.get("hyper_parameters", {}).get("model_config")
        if theirs is None and "model.wte.weight" not in checkpoint.get("state_dict", {}):
            keys = list(checkpoint.get("state_dict", {}))[:3]
            raise ValueError(
                f"checkpoint comes from another model (no GPT2SpeedrunModule model_config in it; its weights are "
                f"{keys}...); pass a GPT2SpeedrunModule checkpoint or train from scratch"
            )
        diffs = {}
        if theirs is not None:
            # what the weights mean (the architecture) may not change between runs; how the same model is
            # computed (GPTExecution, saved beside it) may. A field the checkpoint predates counts as its default
            # (what that code computed); lists and tuples compare equal (LightningCLI saves the parsed YAML)
            a, b = normalised(self.model_config.to_dict()), saved_model_config(theirs)
            diffs = {k: (b.get(k), a[k]) for k in a if a[k] != b.get(k)}
        if diffs:
            raise ValueError(
                "checkpoint comes from another model: (checkpoint, this run) differ in "
                + ", ".join(f"{k}={v[0]!r} vs {v[1]!r}" for k, v in diffs.items())
                + ". Use the checkpoint's model_config (see its hyper_parameters) or train from scratch."
            )
        self._init_loaded = True  # the checkpoint's weights, not init_from's
        super().on_load_checkpoint(checkpoint)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.model_config.window_schedule is not None:  # the attention window follows training progress,
            # over the steps the learning-rate schedule spans (max_steps, else the schedule's total_steps)
            self.model.set_train_progress(self.trainer.global_step / max(1, self.schedule_total_steps()))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.flops_per_batch is None:
            self.flops_per_batch = self.model.flops_per_token(x.shape[1]) * x.numel()
        loss = self.compute_loss(x, y)
        self.count_tokens(x.numel())
        # prog_bar=False: Lightning turns progress-bar metrics into Python numbers after every batch (a
        # host-device sync per micro-batch); lightning_opt.callbacks.LazyProgressBar shows it instead
        self.log("train/loss", loss, on_step=True, prog_bar=False)
        if self._logs_this_step():
            # host numbers go in as CPU tensors: self.log would copy a Python number to the GPU with a
            # blocking copy; and only on the steps the logger writes
            self.log("tokens_seen", torch.tensor(float(self.tokens_seen)), on_step=True, on_epoch=False)
        return loss

    def _logs_this_step(self) -> bool:
        return self._trainer is None or trainer_logs_next_step(self._trainer)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(self.compute_loss(x, y), weight=x.numel())

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self._epoch_loss(self.val_loss)
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss.clamp(max=20)))

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_loss.update(self.compute_loss(x, y), weight=x.numel())

    @override
    def on_test_epoch_end(self) -> None:
        loss = self._epoch_loss(self.test_loss)
        self.log("test/loss", loss, sync_dist=False)
        self.log("test/ppl", torch.exp(loss.clamp(max=20)))

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab]`` (float32) for ``x`` or ``(x, y)`` batches."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).float()

    @staticmethod
    def _epoch_loss(metric: MeanMetric) -> torch.Tensor:
        """The token-weighted mean loss over the epoch (all ranks), and the metric reset for the next one."""
        loss = metric.compute()
        # validate() / test() run under inference mode; states re-created there could not be updated in training
        with torch.inference_mode(False):
            metric.reset()
        return loss

    @staticmethod
    def val_ppl(loss: float) -> float:
        return math.exp(min(loss, 20.0))
