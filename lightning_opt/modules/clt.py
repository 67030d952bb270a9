"""LightningModule that trains a cross-layer transcoder on activations from :class:`~lightning_opt.data.activations.CLTDataModule`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function
from torchmetrics import Metric
from typing_extensions import override

from lightning_opt.callbacks._logging import trainer_logs_next_step
from lightning_opt.data.activations import find_mlps
from lightning_opt.models.clt import CLT, CLTConfig, CLTExecution, CLTOutput, auxk_loss
from lightning_opt.models.clt_losses import (
    fvu_per_layer,
    preactivation_loss,
    tanh_sparsity_penalty,
    tanh_sparsity_penalty_sparse,
)
from lightning_opt.models.clt_parallel import clip_grad_norm_, sum_backward, sum_forward
from lightning_opt.modules.base import CompileConfig, TrainingModule, as_config, register_safe_globals
from lightning_opt.ops.global_topk import all_gather
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

__all__ = ["CLTModule", "FVUMetric", "L0Metric", "ScalarMean", "replacement_kl"]

# a module made in Python saves its configs in the checkpoint's hyperparameters
register_safe_globals(CLTConfig, CLTExecution)

_DECODES = ("auto", "dense", "sparse")
# decode="auto" on CUDA: sparse from this many features per layer; below it the dense decode with the gather-dot
# activation gradient (the model's default) is the faster one (docs/clt.md, "Performance").
SPARSE_DECODE_MIN_FEATURES = 24576
# resample_dead_features: how a token's chance of being drawn follows its loss
RESAMPLE_WEIGHTINGS = ("loss", "loss_squared", "uniform")


class FVUMetric(Metric):
    """Pooled FVU per layer over the whole evaluation set (see :func:`lightning_opt.models.clt_losses.fvu_per_layer`).

    ``compute()`` returns ``(fvu_per_layer [L], fvu_total)``; the denominator is the squared deviation from the
    per-dimension mean over *all* evaluated tokens, accumulated exactly from sums.
    """

    full_state_update = False

    def __init__(self, n_layers: int, d_model: int) -> None:
        super().__init__()
        self.add_state("sse", torch.zeros(n_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_y", torch.zeros(n_layers, d_model, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_y2", torch.zeros(n_layers, d_model, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        # out-of-place updates: see ScalarMean
        t = target.double()
        self.sse = self.sse + (t - pred.double()).pow(2).sum(dim=(0, 2))
        self.sum_y = self.sum_y + t.sum(0)
        self.sum_y2 = self.sum_y2 + t.pow(2).sum(0)
        self.n = self.n + t.shape[0]

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        sst = (self.sum_y2 - self.sum_y.pow(2) / self.n.clamp_min(1)).sum(-1)
        return (self.sse / sst.clamp_min(1e-12)).float(), (self.sse.sum() / sst.sum().clamp_min(1e-12)).float()


class L0Metric(Metric):
    """Mean active features per token, per layer ``[L]`` (``compute()``)."""

    full_state_update = False

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.add_state("active", torch.zeros(n_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, active_per_layer: torch.Tensor, tokens: int) -> None:
        self.active = self.active + active_per_layer.double()
        self.tokens = self.tokens + tokens

    def compute(self) -> torch.Tensor:
        return (self.active / self.tokens.clamp_min(1)).float()


class ScalarMean(Metric):
    """Mean of scalar updates. Updates are out of place, so states created under ``inference_mode`` (a
    ``validate`` before ``fit``) stay usable afterwards. torchmetrics' ``MeanMetric`` updates in place
    (``mean_value += ...``) and raises "Inplace update to inference tensor outside InferenceMode" there."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor) -> None:
        self.total = self.total + value.double()
        self.count = self.count + 1

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp_min(1)).float()


class CLTModule(TrainingModule):
    """Train a :class:`~lightning_opt.models.clt.CLT`.

    Loss = MSE of the normalised reconstruction (mean over tokens, layers, dims)
    ``+ lambda(step) * tanh sparsity penalty + preact_coef * pre-activation loss + aux_coef * AuxK``, with
    ``lambda`` ramping linearly from 0 to ``sparsity_coef`` over the first ``sparsity_ramp_fraction`` of the
    run. A feature is dead when it has not fired for ``dead_tokens`` training tokens.

    Per-step cost: the training metrics (FVU, L0, dead fraction, ...) are computed and logged only on the
    steps the Trainer writes logs (``log_every_n_steps``) and on the last batch of an epoch; ``train/loss``
    is logged every step (a device tensor: no host sync unless a logger or progress bar reads it). AuxK is skipped
    without a host sync while no feature is dead (the previous step's answer is copied to pinned host memory
    asynchronously; reading it waits on the event recorded after the previous step's loss, while that step's
    backward and this step's forward are queued on the GPU, so the GPU never idles for it) and otherwise
    considers at most ``aux_max_dead`` dead features per layer, the ones silent longest (see
    :func:`~lightning_opt.models.clt.auxk_loss`).

    Host syncs: none in a training step outside the logging steps on CUDA with Triton and bf16 pre-activations
    (``precision="bf16-mixed"``) for the top-k activations with the dense decode: the one-pass BatchTopK selection
    (``ops._topk_triton.select_16bit_1pass``) has fixed shapes and an exact device-side fallback, and the dense
    decode's gradient at the kept entries needs no layer bounds on the host (docs/clt.md lists
    the syncs per path). One sync per step remains where sizes come from the data: fp32
    pre-activations (the candidate step's count), ``decode="sparse"`` (the layer bounds), a GPU without Triton,
    a BatchTopK over ranks (``topk_group``) or a sharded CLT. The first steps of a process run one-time
    self-checks of the Triton kernels (they sync once).

    Logged keys (values of the logging step): ``train/loss``, ``train/mse``, ``train/fvu``, ``train/l0``, ``train/sparsity_lambda``,
    ``train/sparsity``, ``train/preact``, ``train/auxk``, ``train/dead_fraction``; ``val/fvu``,
    ``val/fvu_layer{l}``, ``val/explained_variance``, ``val/l0``, ``val/l0_layer{l}``, ``val/dead_fraction``,
    ``val/kl`` and ``val/next_token_agreement`` (replacement model vs original, when the datamodule has a
    target model), ``val/loss`` (= ``val/fvu``). ``trainer.test`` logs the same keys under ``test/``;
    ``forward(x)`` and ``trainer.predict`` give the reconstructed MLP outputs ``[N, L, d]`` (raw space) of
    ``x`` or ``(x, y, ...)`` batches.

    Args:
        clt: the transcoder's config; ``n_layers`` and ``d_model`` must match the target model.
        optim, schedule: optimizer and LR schedule (AdamW without weight decay by default).
        sparsity_coef, sparsity_c, sparsity_ramp_fraction: tanh penalty weight, its ``c``, and the ramp.
        preact_coef: weight of the pre-activation loss (0 = off).
        aux_coef, aux_k: AuxK weight (0 = off) and dead features used per token and layer.
        aux_max_dead: dead features per layer AuxK chooses from (the ones silent longest); ``None`` = all.
        dead_tokens: window (tokens) after which a feature that never fired counts as dead.
        decode: ``dense``, ``sparse`` (top-k activations only) or ``auto`` (sparse on CPU; on GPU sparse from
            ``SPARSE_DECODE_MIN_FEATURES`` features per layer, dense below).
        eval_replacement: compute the replacement model's KL / agreement at validation.
        execution: how the CLT is computed (:class:`~lightning_opt.models.clt.CLTExecution`: the sparse decode's
            backend, the dense decode's sparse activation gradient); its ``compile_encode`` follows ``compile``.
        compile: ``True`` or a :class:`~lightning_opt.modules.base.CompileConfig` with ``mode: full``:
            ``torch.compile`` (``fullgraph``, ``dynamic=False``) the two regions of the training step that
            have static shapes: the encoder (input normalisation + batched encoder matmul, in training mode) and
            the loss terms (target normalisation, MSE, tanh sparsity penalty, pre-activation loss). The top-k
            selection and the decode between them stay eager (Triton kernels; on the paths with a host sync, sizes
            that come from the data).
            Not with a sharded CLT (``DecoderShardingStrategy``) nor a BatchTopK over ranks (``topk_group``).
        resample_dead_every: every this many optimizer steps, re-initialise the features dead over the
            ``dead_tokens`` window (see :meth:`resample_dead_features`); ``None`` = never. One process, or ranks
            that agree on the dead features (``GlobalBatchTopKStrategy``, ``DecoderShardingStrategy``: every rank
            draws the same tokens of the whole batch); ``decoder_tying`` ``untied`` or ``per_source``, no
            gradient accumulation.
        resample_encoder_scale: a resampled feature's encoder column norm, as a fraction of the mean encoder
            column norm of the layer's live features. ``None``: 0.2 for ``relu``/``jumprelu`` (Anthropic's
            value), 1.0 for the top-k activations (a resampled feature has to win one of the k slots; at 0.2 the
            forced-dead features of the BatchTopK test stayed dead).
        resample_seed: seed of the resampling's token draws (its generator state is saved in checkpoints).
        resample_weighting: a token's chance of being drawn for a dead feature, proportional to its loss
            (``"loss"``), its squared loss (``"loss_squared"``, Anthropic's) or uniform (``"uniform"``); each
            layer's dead features get distinct tokens while the batch has enough (see :meth:`resample_dead_features`).
    """

    def __init__(
        self,
        clt: CLTConfig | None = None,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        sparsity_coef: float = 0.0,
        sparsity_c: float = 1.0,
        sparsity_ramp_fraction: float = 1.0,
        preact_coef: float = 0.0,
        aux_coef: float = 0.0,
        aux_k: int = 64,
        aux_max_dead: int | None = 512,
        dead_tokens: int = 1_000_000,
        decode: str = "auto",
        eval_replacement: bool = True,
        execution: CLTExecution | None = None,
        compile: CompileConfig | bool | None = None,
        resample_dead_every: int | None = None,
        resample_encoder_scale: float | None = None,
        resample_seed: int = 0,
        resample_weighting: Literal["loss", "loss_squared", "uniform"] = "loss",
    ) -> None:
        super().__init__(optim or OptimConfig(lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0),
                         schedule or ScheduleConfig(name="constant"), compile)
        if clt is None:
            raise ValueError("CLTModule needs a CLTConfig (clt=...); set n_layers and d_model to the target's")
        if decode not in _DECODES:
            raise ValueError(f"decode={decode!r} is unknown; choose one of {_DECODES}")
        for name, v in (("sparsity_coef", sparsity_coef), ("preact_coef", preact_coef), ("aux_coef", aux_coef)):
            if v < 0:
                raise ValueError(f"{name}={v} must be >= 0")
        if not 0 < sparsity_ramp_fraction <= 1:
            raise ValueError(f"sparsity_ramp_fraction={sparsity_ramp_fraction} must be in (0, 1]")
        if dead_tokens <= 0 or aux_k <= 0:
            raise ValueError("dead_tokens and aux_k must be positive")
        if aux_max_dead is not None and aux_max_dead < aux_k:
            raise ValueError(f"aux_max_dead={aux_max_dead} must be >= aux_k={aux_k} (or None for all features)")
        if resample_dead_every is not None and (isinstance(resample_dead_every, bool)
                                                or not isinstance(resample_dead_every, int) or resample_dead_every <= 0):
            raise ValueError(f"resample_dead_every={resample_dead_every!r} must be a positive int (steps) or None")
        if resample_encoder_scale is not None and not resample_encoder_scale > 0:
            raise ValueError(f"resample_encoder_scale={resample_encoder_scale} must be > 0 (or None)")
        if resample_weighting not in RESAMPLE_WEIGHTINGS:
            raise ValueError(f"resample_weighting={resample_weighting!r} is unknown; choose one of {RESAMPLE_WEIGHTINGS}")
        self.save_hyperparameters()
        clt = as_config(CLTConfig, clt)  # load_from_checkpoint hands a checkpoint's saved dict back as it is
        if resample_dead_every is not None and clt.decoder_tying == "per_target":
            raise ValueError(
                "resample_dead_every needs decoder_tying 'untied' or 'per_source': a per_target decoder vector is "
                "shared by the features of every source layer, so one feature's decoder cannot be re-initialised"
            )
        self.clt_config = clt
        if self.compile_config.backend != "inductor" or self.compile_config.options:
            raise ValueError("CLTModule compiles with inductor's defaults: leave compile.backend and compile.options "
                             "unset (compile: true)")
        execution = as_config(CLTExecution, execution)
        self.model = CLT(clt, dataclasses.replace(execution, compile_encode=self.compile_config.enabled))
        if resample_encoder_scale is None:
            resample_encoder_scale = 0.2 if clt.activation in ("relu", "jumprelu") else 1.0
        self.resample_every, self.resample_encoder_scale = resample_dead_every, resample_encoder_scale
        self.resample_weighting = resample_weighting
        # the resampling's token draws: a CPU generator's state (portable, saved in checkpoints), a running count
        self._resample_rng_state = torch.Generator().manual_seed(resample_seed).get_state()
        self.resampled_total = 0
        self._resample_batch: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, residual) of a resampling step
        self._resampled_now: int | None = None  # features the resampling of this step re-initialised (logged)
        self.last_resampled: torch.Tensor | None = None  # [L, F] bool: the features the last resampling re-initialised
        self.sparsity_coef, self.sparsity_c, self.ramp = sparsity_coef, sparsity_c, sparsity_ramp_fraction
        self.preact_coef, self.aux_coef, self.aux_k = preact_coef, aux_coef, aux_k
        self.aux_max_dead = aux_max_dead
        # "any feature dead?" after the last step, read one step later without a sync (see training_step)
        self._any_dead: tuple[torch.Tensor, Any] | None = None
        self.dead_tokens, self.decode_mode, self.eval_replacement = dead_tokens, decode, eval_replacement
        L, nf, d = clt.n_layers, clt.n_features, clt.d_model
        self.register_buffer("tokens_since_fired", torch.zeros(L, nf, dtype=torch.long))
        self.val_fvu = FVUMetric(L, d)
        self.val_l0 = L0Metric(L)
        self.val_kl = ScalarMean()
        self.val_agree = ScalarMean()

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_any_dead"] = None  # a CUDA event cannot be copied or pickled; the next step recomputes it
        state["_resample_batch"] = None  # one step's activations, consumed at the end of that step
        return state

    @override
    def on_fit_start(self) -> None:
        # after the strategy's setup: a sharding strategy has set the model's shard spec by now
        clt = self.model
        sharded = clt.shard is not None
        if self.compile_config.enabled and sharded:
            raise ValueError(
                "compile=True does not support a sharded CLT (DecoderShardingStrategy: the forward issues "
                "collectives between the compiled regions and decodes a slice of the outputs); use compile=False"
            )
        if self.compile_config.enabled and clt.topk_group is not None:
            raise ValueError(
                "compile=True does not support a BatchTopK over ranks (topk_group set, e.g. GlobalBatchTopK): "
                "each rank keeps a different number of entries per step, so the static-shape loss region would "
                "recompile every step; use compile=False"
            )
        if self.resample_every is None:
            return
        from torch.distributed.tensor import DTensor

        if isinstance(clt.W_enc, DTensor):
            raise ValueError(
                "resample_dead_every does not support parameters sharded as DTensors (FSDPGlobalBatchTopKStrategy); "
                "use GlobalBatchTopKStrategy or DecoderShardingStrategy, or resample_dead_every=None (AuxK, "
                "aux_coef > 0, also revives dead features)"
            )
        if sharded and not clt.shard.collective:
            raise ValueError(
                "resample_dead_every needs a single-process, unsharded CLT or one sharded by "
                "DecoderShardingStrategy; this CLT holds a local slice of the decoder (shard_decoder_) whose other "
                "output columns no rank holds, so a resampled decoder row cannot be normalised"
            )
        if self._data_replicas() > 1 and clt.topk_group is None:
            raise ValueError(
                f"resample_dead_every with {self._data_replicas()} data-parallel ranks needs a BatchTopK over them "
                "(GlobalBatchTopKStrategy, or DecoderShardingStrategy with global_topk=True): the ranks must agree "
                "on which features are dead; use one of those, or resample_dead_every=None (AuxK, aux_coef > 0, "
                "also revives dead features)"
            )
        if self.trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"resample_dead_every does not support accumulate_grad_batches="
                f"{self.trainer.accumulate_grad_batches}; use 1 (or a larger batch)"
            )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["clt_resampling"] = {"rng_state": self._resample_rng_state.clone(),
                                        "resampled_total": self.resampled_total}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("clt_resampling")
        if saved is not None:  # absent in checkpoints of runs before resampling existed: keep the seed's state
            self._resample_rng_state = saved["rng_state"].clone()
            self.resampled_total = int(saved["resampled_total"])

    # ------------------------------------------------------------- setup
    @override
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or not hasattr(dm, "n_layers"):
            return
        cfg = self.clt_config
        if dm.n_layers != cfg.n_layers:
            raise ValueError(
                f"the target model has {dm.n_layers} layers but the CLT is configured for n_layers="
                f"{cfg.n_layers}; set clt.n_layers: {dm.n_layers}"
            )
        if dm.d_model != cfg.d_model:
            raise ValueError(
                f"the target model's width is {dm.d_model} but the CLT has d_model={cfg.d_model}; "
                f"set clt.d_model: {dm.d_model}"
            )
        if stage == "fit" and dm.stats is not None:
            # a resumed run then overwrites these buffers with the checkpoint's (restore follows setup)
            self.model.set_normalization(dm.stats)

    # ------------------------------------------------------------- helpers
    def sparsity_lambda(self) -> float:
        if self.sparsity_coef == 0:
            return 0.0
        total = self.trainer.max_steps if self._trainer is not None and self.trainer.max_steps > 0 else None
        if not total:
            return self.sparsity_coef
        return self.sparsity_coef * min(1.0, self.global_step / max(1.0, self.ramp * total))

    def _use_sparse(self, out_has_indices: bool) -> bool:
        if not out_has_indices:
            return False
        if self.decode_mode == "auto":
            # on CPU decoding k of F features beats the dense matmul; on GPU only for wide layers
            return self.device.type == "cpu" or self.clt_config.n_features >= SPARSE_DECODE_MIN_FEATURES
        return self.decode_mode == "sparse"

    @torch.no_grad()
    def _fired(self, out: Any, n_tokens: int) -> torch.Tensor:
        """``[L, F]`` bool: features that fired in this batch (no host sync)."""
        L, nf = self.clt_config.n_layers, self.clt_config.n_features
        if out.indices is not None:
            layer = torch.div(out.indices, n_tokens * nf, rounding_mode="floor")
            flat = layer * nf + out.indices % nf
            hits = torch.zeros(L * nf, device=flat.device).index_add_(0, flat, (out.values > 0).float())
            fired = (hits > 0).view(L, nf)
        else:
            fired = (out.acts > 0).any(dim=1)
        group = self.model.topk_group
        if group is not None:
            # global BatchTopK: a feature fired if it fired on any rank (int32: NCCL cannot reduce bool)
            as_int = fired.to(torch.int32)
            dist.all_reduce(as_int, op=dist.ReduceOp.MAX, group=group)
            fired = as_int.bool()
        return fired

    def _active_per_layer(self, out: Any, n_tokens: int) -> torch.Tensor:
        L, nf = self.clt_config.n_layers, self.clt_config.n_features
        if out.indices is not None:
            layer = torch.div(out.indices, n_tokens * nf, rounding_mode="floor")
            return torch.zeros(L, device=layer.device).index_add_(0, layer, (out.values > 0).float())
        return (out.acts > 0).sum(dim=(1, 2)).float()

    def _penalty_view(self, out: CLTOutput) -> CLTOutput:
        """``out`` for the penalty terms. A decoder group with a replicated encoder: every rank computes the same
        penalties from the same activations and the strategy averages the ranks' losses, so the activations'
        gradient is summed over the group (the encoder's whole gradient), as the decode does for the MSE's."""
        spec = self.model.shard
        if spec is None or not spec.collective or spec.features is not None:
            return out
        def wrap(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else sum_backward(t, spec.model_group)

        return out._replace(pre=wrap(out.pre), acts=wrap(out.acts), values=wrap(out.values))

    def _group_mean(self, value: torch.Tensor) -> torch.Tensor:
        """A detached per-rank loss averaged over the decoder group (the loss the strategy trains on); as is
        without one. One scalar all-reduce, no host sync."""
        spec = self.model.shard
        if spec is None or not spec.collective:
            return value
        value = value.clone()
        dist.all_reduce(value, group=spec.model_group)
        return value / spec.model_size

    def _feature_shard_sum(self, term: torch.Tensor) -> torch.Tensor:
        """A sum over features of this rank's features (feature-sharded encoder) -> over all features; backward
        scaled by the group size (the strategy averages the ranks' losses)."""
        spec = self.model.shard
        if spec is None or not spec.collective or spec.features is None:
            return term
        return sum_forward(term, spec.model_group, grad_scale=float(spec.model_size))

    @override
    def count_tokens(self, batch_tokens: int) -> None:
        # the ranks of a decoder group (DecoderShardingStrategy) read the same tokens: count each data rank once
        self.tokens_seen += batch_tokens * self._data_replicas()

    def _data_replicas(self) -> int:
        """Ranks that see different tokens each step (the strategy's data-parallel size; 1 in one process)."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self._trainer else None
        return int(kwargs.get("num_replicas", 1)) if kwargs else 1

    def _rank_sum(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Differentiable sum of a loss term over all ranks, for ratio losses (AuxK) of the whole batch.

        Every strategy here averages the per-rank losses' gradients over all ranks (DDP over the world; decoder
        sharding over the decoder group, then the data group), so the backward is scaled by the world size."""
        if self._trainer is None or self.trainer.world_size == 1:
            return None
        world = self.trainer.world_size
        return lambda t: sum_forward(t, dist.group.WORLD, grad_scale=float(world))

    def _should_log(self) -> bool:
        """Whether the Trainer writes logs after this training step (``log_every_n_steps``)."""
        if self._trainer is None:
            return True
        return trainer_logs_next_step(self.trainer) or self.trainer.is_last_batch

    def _maybe_dead(self) -> bool:
        """False only when the last step's update left no dead feature (a host flag; no device sync)."""
        if self._any_dead is None:
            return True
        flag, event = self._any_dead
        if event is not None:
            # Recorded after the previous step's loss: waiting for it leaves that step's backward and this step's
            # forward queued on the GPU, so the GPU does not idle (a deterministic answer, not a racy query()).
            event.synchronize()
        return bool(flag)

    def _publish_dead(self, dead_next: torch.Tensor) -> None:
        # AuxK issues collectives over the ranks (decoder group, whole-batch ratio), so ranks must never disagree
        # about running it: they agree when their dead masks are equal, which holds in a decoder group (the same
        # selections) and over data-parallel ranks whose firing is merged (topk_group); else it always runs.
        if self._data_replicas() > 1 and self.model.topk_group is None:
            self._any_dead = None
            return
        anyd = dead_next.any()
        if anyd.device.type == "cuda":
            if self._any_dead is None or self._any_dead[1] is None:
                self._any_dead = (torch.empty((), dtype=torch.bool, pin_memory=True), torch.cuda.Event())
            flag, event = self._any_dead
            flag.copy_(anyd, non_blocking=True)
            event.record()
        else:
            self._any_dead = (anyd, None)  # CPU: reading it is free

    # ------------------------------------------------------------- dead-feature resampling
    def _resample_due(self) -> bool:
        """Whether the optimizer step of this training step ends a resampling period (host ints, no sync)."""
        if self.resample_every is None or self._trainer is None:
            return False
        return (self.trainer.global_step + 1) % self.resample_every == 0

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._resample_batch is not None:
            # right after the update, before any callback's on_train_batch_end (a checkpoint saved at this step
            # then holds the resampled features, their reset optimizer state and the advanced generator)
            x, residual = self._resample_batch
            self._resample_batch = None
            self._resampled_now = self.resample_dead_features(x, residual, self.trainer.optimizers)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._resampled_now is not None:
            self.log("train/resampled", torch.tensor(float(self._resampled_now)), on_step=True, on_epoch=False)
            self._resampled_now = None

    @torch.no_grad()
    def resample_dead_features(self, x: torch.Tensor, residual: torch.Tensor,
                               optimizers: list[torch.optim.Optimizer] | tuple = ()) -> int:
        """Re-initialise every feature dead over the ``dead_tokens`` window (after Anthropic, "Towards
        Monosemanticity", 2023): returns how many.

        Draws, per source layer ``l`` with ``D_l`` dead features: ``min(D_l, P)`` *distinct* tokens of this batch,
        without replacement, among the ``P`` tokens with a positive finite loss at the feature's targets
        ``l..L-1`` (squared error summed over those layers and dimensions), with probability proportional to
        ``resample_weighting``: that loss (``"loss"``), its square (``"loss_squared"``, Anthropic's choice; on
        heavy-tailed errors it puts most draws on a few tokens) or uniform (``"uniform"``). With more dead
        features than candidate tokens, the drawn tokens are spread evenly (each used ``D_l // P`` or one more
        times); otherwise no two features of a layer get the same token. A dead feature ``f`` of layer ``l`` drawn
        token ``n`` gets: encoder column = the normalised input ``x_l[n]`` as a unit vector times
        ``resample_encoder_scale`` x the mean encoder column norm of layer ``l``'s live features; encoder bias 0
        (JumpReLU: its initial threshold); decoder row = the residual ``(target - recon)[n]`` of its targets
        ``l..L-1`` (``per_source``: their sum) as a unit vector times the mean decoder row norm of layer ``l``'s
        live features.

        Every optimizer state tensor shaped like a parameter (Adam's ``exp_avg`` and ``exp_avg_sq``) is zeroed at
        those rows, other rows untouched: no moment of the dead feature's old direction steers its new one (Adam's
        step count is shared by the whole tensor, so a zeroed row's first updates are larger than a live row's,
        about ``(1 - b1) / sqrt(1 - b2)`` x the learning rate at first). The features' dead counters restart. With
        ``resample_dead_every`` set, :meth:`optimizer_step` calls it right after the update of every
        ``resample_dead_every``-th step, on that step's batch (logged as ``train/resampled``).

        Over several ranks (data-parallel with a merged BatchTopK, decoder shards) every rank draws the same tokens
        of the whole batch (every data rank's tokens in rank order, the losses over every shard's columns), each
        rank writes the rows it holds, and the norms span every shard: the same features as one process with
        the whole batch.

        Host syncs: a few (the dead set's size and layout, the token draws on the CPU generator), on the
        resampling steps only.

        Args:
            x: the step's raw inputs ``[N, L, d_model]``.
            residual: ``normalised targets - recon`` ``[N, L, d_model]`` of that step (detached).
            optimizers: optimizers whose state for the CLT's parameters is reset at the resampled rows.
        """
        clt = self.model
        dead = self.tokens_since_fired >= self.dead_tokens
        where = dead.nonzero()  # [D, 2] (layer, feature), grouped by layer: host sync
        count = where.shape[0]
        self.last_resampled = dead
        if count == 0:
            return 0
        ranks = _ResampleRanks.of(self)
        per_layer = dead.sum(1).tolist()
        res = residual.float()
        # loss of each token at the targets of a feature of layer l: squared error over layers l..L-1, over the
        # whole batch (every data rank's tokens in rank order, every decoder shard's columns)
        sq = ranks.gather_tokens(ranks.sum_columns(res.pow(2).sum(-1)))
        tail = sq.flip(1).cumsum(1).flip(1).double().cpu()  # [N_total, L]
        gen = torch.Generator().manual_seed(0)
        gen.set_state(self._resample_rng_state)
        draws = [_draw_distinct(tail[:, source], c, self.resample_weighting, gen)
                 for source, c in enumerate(per_layer) if c > 0]
        self._resample_rng_state = gen.get_state()
        tok = torch.cat(draws).to(x.device)  # [D] tokens of the whole batch, in the order of `where`
        layer, feat = where[:, 0], where[:, 1]
        alive = ~dead

        def mean_live(norms: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
            """Mean of ``norms`` over the live entries of each row (all entries for a row with none live)."""
            live_mean = (norms * live).sum(-1) / live.sum(-1).clamp_min(1)
            return torch.where(live.any(-1), live_mean, norms.mean(-1))

        # encoder: unit normalised inputs of the drawn tokens, scaled to the layer's live norm
        W_enc = clt.W_enc  # [L, d, F] (this rank's features [f0, f0 + width) with a feature-sharded encoder)
        enc_norms = ranks.gather_features(torch.linalg.vector_norm(W_enc, dim=1, dtype=torch.float32))  # [L, F]
        enc_scale = mean_live(enc_norms, alive) * self.resample_encoder_scale
        u = ranks.rows(clt.normalize_inputs(x.to(W_enc.dtype)).float(), tok, layer)  # [D, d]
        u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp_min(1e-12)
        own = (feat >= ranks.f0) & (feat < ranks.f0 + W_enc.shape[2])  # the features whose encoder is here
        e_layer, e_feat = layer[own], feat[own] - ranks.f0
        W_enc[e_layer, :, e_feat] = (u[own] * enc_scale[e_layer, None]).to(W_enc.dtype)
        clt.b_enc[e_layer, e_feat] = 0
        reset: list[tuple[torch.Tensor, tuple[Any, ...]]] = [(W_enc, (e_layer, slice(None), e_feat)),
                                                               (clt.b_enc, (e_layer, e_feat))]
        if clt.log_threshold is not None:
            clt.log_threshold[layer, feat] = math.log(self.clt_config.jumprelu_threshold)
            reset.append((clt.log_threshold, (layer, feat)))
        # decoder: unit residuals of the drawn tokens over the feature's targets, scaled to the layer's live norm
        # (norms over all output columns: a decoder shard holds some of them)
        start = 0
        for source, c in enumerate(per_layer):
            if c == 0:
                continue
            rows, toks = feat[start : start + c], tok[start : start + c]
            start += c
            w = clt.W_dec[source]  # [F, L - source (1: per_source), d_out]
            r = ranks.rows(res[:, source:], toks)  # [c, L - source, d_out]
            if w.shape[1] == 1:
                r = r.sum(1, keepdim=True)
            dec_scale = mean_live(ranks.column_norm(w), alive[source])
            r = r / ranks.column_norm(r)[:, None, None].clamp_min(1e-12)
            w[rows] = (r * dec_scale).to(w.dtype)
            reset.append((w, (rows,)))
        for opt in optimizers:
            for p, index in reset:
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        v[index] = 0
        self.tokens_since_fired.masked_fill_(dead, 0)
        self.resampled_total += count
        return count

    # ------------------------------------------------------------- training
    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # record_function regions ("clt/...") let a profiler attribute device time to the parts of the step
        # (docs/clt.md); without a profiler they cost next to nothing.
        x, y = batch[0], batch[1]
        n = x.shape[0]
        clt = self.model
        has_indices = clt.config.activation in ("topk", "batchtopk", "batchtopk_global") and clt.topk_group is None
        with record_function("clt/forward"):
            out = clt(x, dense=not self._use_sparse(has_indices))
        with record_function("clt/loss"):
            lam = self.sparsity_lambda()
            log = self._should_log()
            terms = _compiled_loss_terms() if self.compile_config.enabled else _loss_terms
            # the penalty whenever it has a weight, also while the ramp holds it at 0: the same terms every
            # step (one compiled graph)
            yn, mse, sp, pa = terms(clt, self._penalty_view(out), y, n, self.sparsity_c, self.sparsity_coef > 0,
                                    self.preact_coef > 0)
            if pa is not None:
                pa = self._feature_shard_sum(pa)
            loss = mse
            # host numbers as CPU tensors: self.log would copy a Python number to the GPU with a blocking copy
            logs: dict[str, Any] = {"train/mse": mse.detach(), "train/sparsity_lambda": torch.tensor(float(lam))}
            if sp is not None:
                loss = loss + lam * sp
                logs["train/sparsity"] = sp.detach()
            if pa is not None:
                loss = loss + self.preact_coef * pa
                logs["train/preact"] = pa.detach()
            if self._resample_due():
                # the inputs and reconstruction errors the resampling at the end of this step draws from
                self._resample_batch = (x.detach(), (yn - out.recon).detach())
        with record_function("clt/dead_tracking"):
            fired = self._fired(out, n)
            dead = self.tokens_since_fired >= self.dead_tokens
        # No feature can be dead before dead_tokens tokens have passed (tokens_seen counts all ranks, so it is
        # at least this rank's count), nor when the last step left none dead: skip AuxK then, without a sync.
        if self.aux_coef > 0 and self.tokens_seen >= self.dead_tokens:
            if self._maybe_dead():
                with record_function("clt/auxk"):
                    # x: the candidates' pre-activations from their encoder columns; sparse_decoder_grad: the
                    # main decode gives the decoder a dense gradient in this backward, AuxK adds its rows to it
                    aux = auxk_loss(clt, out.pre, (yn - out.recon).detach(), dead, self.aux_k,
                                    max_dead=self.aux_max_dead, staleness=self.tokens_since_fired, x=x,
                                    sparse_decoder_grad=True, reduce=self._rank_sum())
                    loss = loss + self.aux_coef * aux
                logs["train/auxk"] = aux.detach()
            else:
                logs["train/auxk"] = torch.tensor(1.0)  # AuxK's value when no feature is dead
        with torch.no_grad(), record_function("clt/dead_tracking"):
            # the window counts the step's tokens over all data-parallel ranks (fired is merged over them)
            self.tokens_since_fired.add_(n * self._data_replicas()).masked_fill_(fired, 0)
            if self.aux_coef > 0:
                self._publish_dead(self.tokens_since_fired >= self.dead_tokens)
        if log:
            # metrics only on the steps the Trainer writes logs: they cost extra passes over the outputs
            with torch.no_grad(), record_function("clt/metrics"):
                logs["train/mse"] = self._group_mean(logs["train/mse"])
                logs["train/dead_fraction"] = dead.float().mean()
                logs["train/l0"] = self._active_per_layer(out, n).sum() / n
                if clt.d_out_slice is None:
                    sse, sst = fvu_per_layer(clt.denormalize(out.recon.detach()), y)
                    logs["train/fvu"] = sse.sum() / sst.sum().clamp_min(1e-12)
            self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False)
        # every step (a monitored key must always exist); a device tensor, so no sync unless a logger reads it.
        # prog_bar=False: Lightning turns progress-bar metrics into Python numbers after every batch (a sync
        # per step); the recipes' lightning_opt.callbacks.LazyProgressBar shows train/loss at redraws instead
        self.log("train/loss", self._group_mean(loss.detach()), on_step=True, on_epoch=False)
        self.count_tokens(n)
        return loss

    @override
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Norm clipping of a sharded CLT (decoder sharding) uses the norm of the whole model
        (:func:`~lightning_opt.models.clt_parallel.clip_grad_norm_`); otherwise the base module's clipping."""
        if gradient_clip_val and gradient_clip_algorithm != "value" and self.model.shard is not None:
            clip_grad_norm_(self, (p for g in optimizer.param_groups for p in g["params"]), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------- evaluation
    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CLT's reconstruction of every layer's MLP output, ``[N, L, d]`` in raw (denormalised) space, from
        the MLP inputs ``x`` ``[N, L, d_model]``."""
        return self.model.denormalize(self.model(x).recon)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self._eval_update(batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._eval_log("val")

    @override
    def test_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self._eval_update(batch)

    @override
    def on_test_epoch_end(self) -> None:
        self._eval_log("test")

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The reconstructed MLP outputs ``[N, L, d]`` (float32, raw space) of ``x`` or ``(x, y, ...)``."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).float()

    def _eval_update(self, batch: tuple[torch.Tensor, ...]) -> None:
        x, y = batch[0], batch[1]
        out = self.model(x)
        recon = self.model.denormalize(out.recon)
        self.val_fvu.update(recon.float(), y.float())
        self.val_l0.update(self._active_per_layer(out, x.shape[0]), x.shape[0])
        target = getattr(getattr(self.trainer, "datamodule", None), "target_model", None)
        if self.eval_replacement and target is not None and len(batch) > 2:
            kl, agree = replacement_kl(target, batch[2], recon)
            self.val_kl.update(kl)
            self.val_agree.update(agree)

    def _eval_log(self, prefix: str) -> None:
        per_layer, total = self.val_fvu.compute()
        l0 = self.val_l0.compute()
        logs = {"fvu": total, "loss": total, "explained_variance": 1 - total, "l0": l0.sum()}
        for i in range(per_layer.numel()):
            logs[f"fvu_layer{i}"] = per_layer[i]
            logs[f"l0_layer{i}"] = l0[i]
        logs["dead_fraction"] = (self.tokens_since_fired >= self.dead_tokens).float().mean()
        if self.val_kl.update_count > 0:
            logs["kl"] = self.val_kl.compute()
            logs["next_token_agreement"] = self.val_agree.compute()
        self.log_dict({f"{prefix}/{k}": v for k, v in logs.items()}, prog_bar=False)
        if prefix == "val":
            self.log("val/fvu_pb", total, prog_bar=True, logger=False)
        for m in (self.val_fvu, self.val_l0, self.val_kl, self.val_agree):
            m.reset()


class _ResampleRanks:
    """The ranks a resampling spans: the decoder group (same tokens, each rank some output columns and, with a
    feature-sharded encoder, some features) and the data-parallel ranks (other tokens, merged BatchTopK). Every
    rank draws the same tokens of the whole batch; these collectives give each rank what the draws need."""

    def __init__(self, model_group: Any, model_size: int, feature_sharded: bool, f0: int, data_group: Any,
                 data_size: int, data_rank: int) -> None:
        self.model_group, self.model_size, self.f0 = model_group, model_size, f0
        self.feature_sharded = feature_sharded
        self.data_group, self.data_size, self.data_rank = data_group, data_size, data_rank

    @classmethod
    def of(cls, module: CLTModule) -> _ResampleRanks:
        spec = module.model.shard
        grouped = spec is not None and spec.collective
        f0 = spec.features[0] if spec is not None and spec.features is not None else 0
        data_size = module._data_replicas()
        if data_size == 1:
            data_group, data_rank = None, 0
        elif grouped:
            data_group, data_rank = spec.data_group, spec.data_rank
        else:
            data_group = module.model.topk_group
            data_rank = dist.get_rank(data_group)
        return cls(spec.model_group if grouped else None, spec.model_size if grouped else 1,
                   grouped and spec.features is not None, f0, data_group, data_size, data_rank)

    def sum_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the decoder group (a sum over output columns each shard computed for its own)."""
        if self.model_group is not None:
            t = t.contiguous()
            dist.all_reduce(t, group=self.model_group)
        return t

    def column_norm(self, t: torch.Tensor) -> torch.Tensor:
        """float32 norm of each row of ``t`` ``[R, ..., d_out]`` over all its other axes and every shard's columns."""
        if self.model_group is None:
            return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())), dtype=torch.float32)
        return self.sum_columns(t.float().pow(2).sum(tuple(range(1, t.dim())))).sqrt()

    def gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Every data rank's rows of ``t`` ``[N, ...]`` in rank order: ``[data_size * N, ...]``."""
        if self.data_size == 1:
            return t
        return all_gather(t.contiguous(), self.data_group, self.data_size).flatten(0, 1)

    def gather_features(self, t: torch.Tensor) -> torch.Tensor:
        """``[L, F]`` from this rank's features ``[L, F / M]`` of a feature-sharded encoder (else ``t``)."""
        if not self.feature_sharded:
            return t
        parts = all_gather(t.contiguous(), self.model_group, self.model_size)  # [M, L, F / M], rank order
        return torch.cat(parts.unbind(0), dim=-1)

    def rows(self, t: torch.Tensor, tok: torch.Tensor, layer: torch.Tensor | None = None) -> torch.Tensor:
        """``t[tok]`` (or ``t[tok, layer]``) for tokens ``tok`` of the whole batch, from the rank that holds each."""
        n = t.shape[0]
        if self.data_size == 1:
            return t[tok] if layer is None else t[tok, layer]
        mine = (tok // n) == self.data_rank
        local = (tok % n).clamp(0, n - 1)
        picked = t[local] if layer is None else t[local, layer]
        out = torch.where(mine.view(-1, *([1] * (picked.dim() - 1))), picked, torch.zeros_like(picked))
        dist.all_reduce(out, group=self.data_group)  # one owner per row: the sum is that row
        return out


def _draw_distinct(loss: torch.Tensor, count: int, weighting: str, gen: torch.Generator) -> torch.Tensor:
    """``count`` token indices for the dead features of one layer (CPU, ``gen``): distinct while the tokens with a
    positive finite ``loss`` suffice, drawn without replacement with probability following ``weighting``; else
    every such token, in a drawn order, repeated in turn (each used ``count // P`` or one more times)."""
    valid = torch.isfinite(loss) & (loss > 0)
    if not bool(valid.any()):  # an exact fit (or a non-finite loss everywhere): every token, uniform
        valid, weighting = torch.ones_like(valid), "uniform"
    if weighting == "uniform":
        w = valid.double()
    else:
        w = torch.where(valid, loss, 0.0).double()
        w = w / w.max()  # scaled to at most 1: squares overflow nothing
        w = w.pow(2) if weighting == "loss_squared" else w
        w = torch.where(valid, w.clamp_min(torch.finfo(torch.float64).tiny), 0.0)  # an underflow stays a candidate
    take = min(count, int(valid.sum()))
    order = torch.multinomial(w, take, replacement=False, generator=gen)
    return order.repeat(-(-count // take))[:count]


def _loss_terms(clt: CLT, out: CLTOutput, y: torch.Tensor, n_tokens: int, sparsity_c: float, sparsity: bool,
                preact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The training step's loss terms from the forward's output ``out`` and the raw targets ``y``: ``(yn, mse,
    tanh sparsity penalty or None, pre-activation loss or None)``, ``yn`` the normalised targets (this rank's
    output columns). Shapes are static for a fixed batch, so ``CLTModule(compile=True)`` compiles it whole."""
    yn = clt.normalize_targets(y.float())
    cols = clt.d_out_slice
    if cols is not None:
        yn = yn[..., cols[0] : cols[1]]
    mse = (out.recon - yn).pow(2).mean()
    sp = pa = None
    if sparsity:
        norms = clt.decoder_norms()
        if out.indices is not None:  # the kept entries only, even when decoding densely
            sp = tanh_sparsity_penalty_sparse(out.indices, out.values, norms * sparsity_c, n_tokens)
        else:
            sp = tanh_sparsity_penalty(out.acts, norms, sparsity_c)
    if preact:
        pa = preactivation_loss(out.pre, clt.threshold)
    return yn, mse, sp, pa


@functools.cache
def _compiled_loss_terms() -> Callable[..., Any]:
    """:func:`_loss_terms` through ``torch.compile`` (one wrapper per process; graphs keyed on shapes, dtypes,
    the flags and the ambient autocast state)."""
    return torch.compile(_loss_terms, fullgraph=True, dynamic=False)


@contextmanager
def _spliced(model: nn.Module, outputs: list[torch.Tensor]):
    """Replace every MLP's output by ``outputs[l]`` (``[B, T, d]``) during a forward."""
    handles = []
    for layer, mlp in enumerate(find_mlps(model)):
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor, layer: int = layer) -> torch.Tensor:
            return outputs[layer].to(output.dtype)

        handles.append(mlp.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


@torch.no_grad()
def replacement_kl(model: nn.Module, tokens: torch.Tensor, recon: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(original || replacement) per token and next-token agreement, with the CLT spliced in.

    The CLT's outputs ``recon`` (``[B*T, L, d]``, raw space) were computed from the *original* model's MLP
    inputs on ``tokens`` (open-loop splice); the replacement model runs with every MLP output replaced.

    Returns:
        ``(mean KL in nats, fraction of positions whose argmax agrees)``.
    """
    B, T = tokens.shape
    base = _logits(model, tokens)
    outs = [recon[:, layer].reshape(B, T, -1) for layer in range(recon.shape[1])]
    with _spliced(model, outs):
        rep = _logits(model, tokens)
    logp, logq = F.log_softmax(base, -1), F.log_softmax(rep, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    agree = (base.argmax(-1) == rep.argmax(-1)).float().mean()
    return kl, agree
