"""SPDModule: stochastic parameter decomposition of a frozen target, as a LightningModule.

The losses, causal-importance functions and component layers live in
:mod:`lightning_opt.models.spd`; this module picks the terms from :class:`SPDLossConfig`, runs the
faithfulness warmup, the optimizer and schedule, bf16 autocast and ``torch.compile``, and the
metrics (CI-L0, MMCS/ML2R, identity-CI error, LM CE/KL under masks). See ``docs/spd.md``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import fnmatch
import functools
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_opt._optional import require
from lightning_opt.data.activations import train_demo_target
from lightning_opt.data.corpus import corpus_windows
from lightning_opt.models import spd as S
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.models.targets import load_checkpoint_file, load_gpt_checkpoint, train_language_model
from lightning_opt.models.toy import (
    ResidMLP,
    ResidMLPConfig,
    SparseFeatureDataset,
    TMSConfig,
    TMSModel,
    train_resid_mlp,
    train_tms,
)
from lightning_opt.modules.base import (
    CompileConfig,
    TrainingModule,
    as_config,
    check_checkpoint_matches,
    check_resume_length,
    register_safe_globals,
)
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

_TARGETS = ("tms", "resid_mlp", "gpt", "hf_gpt2")
DEMO = "demo"  # SPDTargetConfig.checkpoint: the cached demo GPT of lightning_opt.data.activations.train_demo_target
_PGD_INIT = ("random", "ones", "zeroes")
_PGD_SCOPE = ("shared", "unique")


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


@dataclass
class SPDTargetConfig:
    """The model to decompose; toy targets are trained here, before SPD starts.

    Args:
        kind: ``tms``, ``resid_mlp`` (trained by :mod:`lightning_opt.models.toy`), ``gpt`` (our
            :class:`~lightning_opt.models.gpt2.GPT`: trained here on the offline demo corpus, or from
            ``checkpoint`` / ``pretrained``) or ``hf_gpt2`` (a ``transformers`` GPT-2 from ``checkpoint``, a
            hub name or directory; needs the ``hf`` extra).
        model: keyword arguments of the model config (``TMSConfig``, ``ResidMLPConfig``, ``GPTConfig``; with
            ``pretrained``, a ``GPTConfig`` of the files' shape, e.g. a shorter ``block_size``; with
            ``checkpoint: demo``, ``n_layer`` and ``n_embd``).
        train_steps / train_batch_size / train_lr: how the target is trained (toy and ``gpt``; for
            ``checkpoint: demo`` the steps and batch size of :func:`~lightning_opt.data.activations.train_demo_target`).
        feature_probability: toy data sparsity (target training and SPD).
        seq_len: LM sequence length for the ``gpt`` demo training and the SPD data the target brings.
        checkpoint: ``tms``/``resid_mlp``: a ``torch.save``'d state dict. ``gpt``: a recipe checkpoint (a
            ``GPT2SpeedrunModule`` Lightning checkpoint or a ``{"config", "model"}`` file), a plain state dict
            of the ``model`` shape, or ``demo`` (the byte-level GPT of
            :func:`~lightning_opt.data.activations.train_demo_target`, trained once and cached). ``hf_gpt2``:
            a hub name or directory.
        pretrained: ``gpt`` only: Hugging Face GPT-2 weights (a local ``save_pretrained`` directory or a hub id
            such as ``gpt2``) loaded into our GPT by :meth:`~lightning_opt.models.gpt2.GPT.from_pretrained`, so
            module names are ours (``blocks.6.mlp.c_fc``).
        seed: seed of the target's training (the paper's toy models use 0).
        train_device: where toy targets are trained: ``cpu`` (default), ``cuda`` or ``auto`` (CUDA when
            available). The data stream is drawn on the CPU either way, so the seed picks the same batches;
            the trained target is returned on the CPU.
    """

    kind: str = "tms"
    model: dict[str, Any] = field(default_factory=dict)
    train_steps: int = 10_000
    train_batch_size: int = 1024
    train_lr: float = 5e-3
    feature_probability: float = 0.05
    seq_len: int = 64
    checkpoint: str | None = None
    seed: int = 0
    train_device: str = "cpu"
    pretrained: str | None = None

    def __post_init__(self) -> None:
        if self.pretrained is not None and self.kind != "gpt":
            raise ValueError(f"SPDTargetConfig.pretrained is for kind='gpt' (got kind={self.kind!r}); "
                             "an hf_gpt2 target takes its hub name or directory in checkpoint")
        if self.pretrained is not None and self.checkpoint is not None:
            raise ValueError("SPDTargetConfig: give checkpoint or pretrained, not both")
        if self.checkpoint == DEMO and self.kind != "gpt":
            raise ValueError(f"SPDTargetConfig.checkpoint='demo' is the demo GPT: set kind='gpt' (got {self.kind!r})")
        if self.checkpoint == DEMO and set(self.model) - {"n_layer", "n_embd"}:
            raise ValueError(f"SPDTargetConfig: the demo GPT takes only n_layer and n_embd in model, got {sorted(self.model)}")
        if self.train_device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"SPDTargetConfig.train_device={self.train_device!r}; choose 'cpu', 'cuda' or 'auto'")
        if self.kind not in _TARGETS:
            raise ValueError(f"SPDTargetConfig.kind={self.kind!r} is unknown; choose one of {_TARGETS}")
        if self.train_steps < 0 or self.train_batch_size <= 0:
            raise ValueError("SPDTargetConfig.train_steps must be >= 0 and train_batch_size > 0")

    @property
    def is_toy(self) -> bool:
        return self.kind in ("tms", "resid_mlp")

    @property
    def value_range(self) -> tuple[float, float]:
        return (0.0, 1.0) if self.kind == "tms" else (-1.0, 1.0)

    def _device(self) -> str:
        if self.train_device == "cuda" and not torch.cuda.is_available():
            raise ValueError("SPDTargetConfig.train_device='cuda' but CUDA is not available; use 'cpu' or 'auto'")
        if self.train_device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.train_device

    def build(self, train: bool = True) -> nn.Module:
        """Build (and for toy / demo targets, train) the frozen target.

        ``train=False`` builds the same architecture untrained (``SPDModule.load_from_checkpoint`` does: the
        trained weights come from the checkpoint).
        """
        if not train and self.kind == "tms" and not self.checkpoint:
            return TMSModel(TMSConfig(**self.model)).untie_().requires_grad_(False).eval()  # train_tms' result
        if not train and self.kind == "resid_mlp" and not self.checkpoint:
            return ResidMLP(ResidMLPConfig(**self.model), seed=self.seed).requires_grad_(False).eval()
        if not train and self.kind == "gpt" and self.train_steps and self.checkpoint is None and self.pretrained is None:
            return _build_gpt(dataclasses.replace(self, train_steps=0))
        if self.kind == "tms":
            cfg = TMSConfig(**self.model)
            if self.checkpoint:
                m = TMSModel(cfg).untie_()
                m.load_state_dict(torch.load(self.checkpoint, map_location="cpu", weights_only=True))
                return m.requires_grad_(False).eval()
            m = train_tms(cfg, self.train_steps, self.train_batch_size, self.train_lr, self.feature_probability, self.seed,
                          device=self._device())
            return m.cpu()
        if self.kind == "resid_mlp":
            cfg = ResidMLPConfig(**self.model)
            if self.checkpoint:
                m = ResidMLP(cfg, seed=self.seed)
                m.load_state_dict(torch.load(self.checkpoint, map_location="cpu", weights_only=True))
                return m.requires_grad_(False).eval()
            m = train_resid_mlp(
                cfg, self.train_steps, self.train_batch_size, self.train_lr, self.feature_probability, seed=self.seed,
                device=self._device(),
            )
            return m.cpu()
        if self.kind == "gpt":
            return _build_gpt(self)
        return _build_hf_gpt2(self)


@dataclass
class PGDConfig:
    """Adversarial masks: ``n_steps`` signed-gradient ascent steps of ``step_size`` on the sources.

    Args:
        n_steps: ascent steps per PGD term (before the first ``n_steps_schedule`` entry, if any).
        n_steps_schedule: a cheaper schedule, ``[[from_step, n_steps], ...]`` over optimizer steps (increasing
            ``from_step``): from ``from_step`` on, that many ascent steps; e.g. ``n_steps: 1`` and
            ``[[2000, 4]]`` runs 1 step for the first 2000 optimizer steps, then 4. Under ``compile`` each
            distinct value compiles once.
    """

    n_steps: int = 1
    step_size: float = 1.0
    init: str = "random"
    scope: str = "shared"
    n_steps_schedule: list[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.init not in _PGD_INIT:
            raise ValueError(f"PGDConfig.init={self.init!r}; choose one of {_PGD_INIT}")
        if self.scope not in _PGD_SCOPE:
            raise ValueError(f"PGDConfig.scope={self.scope!r}; choose 'shared' (one mask for the batch) or 'unique'")
        if self.n_steps < 0 or self.step_size < 0:
            raise ValueError("PGDConfig.n_steps and step_size must be >= 0")
        if self.n_steps_schedule is not None:
            sched = [tuple(int(v) for v in e) for e in self.n_steps_schedule]
            if any(len(e) != 2 for e in sched):
                raise ValueError(f"PGDConfig.n_steps_schedule={self.n_steps_schedule}: entries are [from_step, n_steps]")
            starts = [e[0] for e in sched]
            if any(a < 0 or n < 0 for a, n in sched) or starts != sorted(set(starts)):
                raise ValueError(f"PGDConfig.n_steps_schedule={self.n_steps_schedule}: from_step must increase "
                                 "strictly from >= 0, and n_steps be >= 0")
            self.n_steps_schedule = sched  # type: ignore[assignment]

    def steps_at(self, step: int) -> int:
        """Ascent steps at optimizer step ``step``."""
        n = self.n_steps
        for start, k in self.n_steps_schedule or ():
            if step >= start:
                n = k
        return n


@dataclass
class SPDLossConfig:
    """Coefficients (0 switches a term off) and their options.

    Args:
        faithfulness: ``||W - V U||^2`` mean (the delta component usually makes it unnecessary).
        importance_minimality: coefficient of ``sum_c mean (g_c + eps)^p``; ``p`` anneals linearly
            to ``p_final`` between ``p_anneal_start`` and ``p_anneal_end`` (fractions of training);
            ``beta`` weights the optional ``mean * log2(1 + sum)`` term.
        stochastic_recon: all layers on stochastic masks.
        stochastic_recon_layerwise: one layer at a time on stochastic masks.
        stochastic_recon_subset: a random subset of layers per position (uniform k).
        ci_masked_recon: all layers masked by the importances themselves.
        pgd_recon / pgd_recon_subset: adversarial masks (all layers / routed subset), see ``pgd``.
        n_mask_samples: stochastic masks drawn per term.
        output: ``mse`` (toy models) or ``kl`` (language models, KL(target || decomposed)).
    """

    faithfulness: float = 0.0
    importance_minimality: float = 3e-3
    p: float = 1.0
    p_final: float | None = None
    p_anneal_start: float = 1.0
    p_anneal_end: float = 1.0
    beta: float = 0.0
    eps: float = 1e-12
    stochastic_recon: float = 1.0
    stochastic_recon_layerwise: float = 1.0
    stochastic_recon_subset: float = 0.0
    ci_masked_recon: float = 0.0
    pgd_recon: float = 0.0
    pgd_recon_subset: float = 0.0
    pgd: PGDConfig = field(default_factory=PGDConfig)
    n_mask_samples: int = 1
    output: str = "mse"

    def __post_init__(self) -> None:
        if isinstance(self.pgd, dict):
            self.pgd = PGDConfig(**self.pgd)
        if self.output not in ("mse", "kl"):
            raise ValueError(f"SPDLossConfig.output={self.output!r}; choose 'mse' (toy) or 'kl' (language models)")
        if self.p <= 0 or (self.p_final is not None and self.p_final <= 0):
            raise ValueError("importance-minimality p must be > 0")
        if self.n_mask_samples < 1:
            raise ValueError("n_mask_samples must be >= 1")
        coeffs = {k: v for k, v in asdict(self).items() if isinstance(v, float) and k in _COEFFS}
        if any(v < 0 for v in coeffs.values()):
            raise ValueError(f"loss coefficients must be >= 0, got {coeffs}")
        if not any(coeffs[k] > 0 for k in _RECON_TERMS + ("faithfulness",)):
            raise ValueError("every reconstruction coefficient is 0: switch on at least one (e.g. stochastic_recon=1)")


_RECON_TERMS = (
    "stochastic_recon",
    "stochastic_recon_layerwise",
    "stochastic_recon_subset",
    "ci_masked_recon",
    "pgd_recon",
    "pgd_recon_subset",
)
_COEFFS = ("faithfulness", "importance_minimality", *_RECON_TERMS)


# SPDTrainConfig keys whose settings live in the module's shared configs (the same for every module)
_SHARED_KEYS = {
    "lr": "model.optim.lr", "weight_decay": "model.optim.weight_decay", "schedule": "model.schedule.name",
    "warmup_frac": "model.schedule.warmup_steps (steps)", "final_lr_frac": "model.schedule.min_ratio",
    "compile": "model.compile.mode", "compile_backend": "model.compile.backend", "compile_options": "model.compile.options",
}


@dataclass
class SPDTrainConfig:
    """SPD's own training settings: the faithfulness warmup, precision, data and metrics. The optimizer, the
    learning-rate schedule and compilation are the module's ``optim``, ``schedule`` and ``compile``, as for every
    lightning-opt module.

    Args:
        faithfulness_warmup_steps / _lr / _weight_decay: AdamW on ``||W - V U||^2`` alone before training,
            so the components start out summing to the target.
        autocast_bf16: run the loss computation under bf16 autocast (the weight deltas ``W - V U`` stay in
            float32).
        ci_threshold: importance above which a subcomponent counts as active for CI-L0.
        identity_patterns: layers whose single-feature importances should be an identity (toy
            models), for ``identity_ci_error``.
        eval_batches: batches averaged for the final metrics.
        batch_size: batch size of the data a toy or demo target brings.
        metrics_path: also write the final metrics (``final_metrics``) to this JSON file.
        seed: seed of the components' initialisation and of the data a toy or demo target brings.
    """

    faithfulness_warmup_steps: int = 200
    faithfulness_warmup_lr: float = 0.01
    faithfulness_warmup_weight_decay: float = 0.1
    autocast_bf16: bool = False
    ci_threshold: float = 0.1
    identity_patterns: list[str] = field(default_factory=list)
    eval_batches: int = 4
    batch_size: int = 4096
    metrics_path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"SPDTrainConfig.batch_size={self.batch_size} must be positive")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SPDTrainConfig:
        """The config from a dict; a key of the shared configs is refused naming where it goes."""
        shared = {k: _SHARED_KEYS[k] for k in values if k in _SHARED_KEYS}
        if shared:
            raise ValueError("model.train holds " + ", ".join(f"{k} (set {v})" for k, v in shared.items())
                             + ": the optimizer, schedule and compile settings are the module's optim, schedule "
                             "and compile sections, as in every lightning-opt recipe")
        return cls(**values)


# a module made in Python saves these configs in its checkpoint's hyperparameters
register_safe_globals(SPDTargetConfig, PGDConfig, SPDLossConfig, SPDTrainConfig, S.SPDConfig, S.ComponentPattern)

# set while SPDModule.load_from_checkpoint builds a module: the target's trained weights come from the checkpoint
_LOADING_CHECKPOINT: contextvars.ContextVar[bool] = contextvars.ContextVar("spd_loading_checkpoint", default=False)


class _SkipFirst(IterableDataset):
    """``dataset`` without its first ``skip`` items: a resumed run continues the seeded stream where it stopped."""

    def __init__(self, dataset: Any, skip: int) -> None:
        self.dataset, self.skip = dataset, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.dataset), self.skip, None)


# --------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------


class SPDModule(TrainingModule):
    """Decompose a frozen target with SPD.

    Args:
        target: an ``nn.Module`` to decompose, or an :class:`SPDTargetConfig` (built in ``__init__``).
        spd: patterns, C, CI functions, sigmoids (:class:`~lightning_opt.models.spd.SPDConfig`).
        loss: loss coefficients (:class:`SPDLossConfig`).
        train: faithfulness warmup, precision, data and metrics (:class:`SPDTrainConfig`).
        optim: the optimizer over the components and the CI functions (default AdamW, lr 1e-3, betas
            (0.9, 0.999), no weight decay; matrices only decay).
        schedule: the learning-rate schedule over ``Trainer(max_steps)`` (default cosine to 0, no warmup).
        compile: ``mode`` ``full`` (``torch.compile`` of the loss computation, forward and every term, in three
            compiled parts: before PGD, PGD, the total; backward compiled by AOTAutograd with them) or ``regional``
            (:meth:`~lightning_opt.models.spd.SPDModel.compile_regions`: the target's repeated blocks, the masked
            linear layers and the KL loss compiled once each and reused: a fraction of the compile time of
            ``full``), with ``backend`` and inductor ``options``
            (:class:`~lightning_opt.modules.base.CompileConfig`).

    Example:
        >>> module = SPDModule(SPDTargetConfig("tms", {"n_features": 5, "n_hidden": 2}),
        ...                    S.SPDConfig(components=[{"pattern": "linear*", "C": 20}]))
        >>> L.Trainer(max_steps=10_000).fit(module)  # toy targets bring their own data
    """

    compile_modes = ("none", "full", "regional")

    def __init__(
        self,
        target: SPDTargetConfig | nn.Module | None = None,
        spd: S.SPDConfig | None = None,
        loss: SPDLossConfig | None = None,
        train: SPDTrainConfig | None = None,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        compile: CompileConfig | bool | None = None,
    ) -> None:
        super().__init__(optim or OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0),
                         schedule or ScheduleConfig(name="cosine", min_ratio=0.0), compile)
        # a target given as an nn.Module is not a hyperparameter: load_from_checkpoint(path, target=model) then
        self.save_hyperparameters(ignore=["target"] if isinstance(target, nn.Module) else None)
        self.target_cfg = target if isinstance(target, nn.Module) else as_config(SPDTargetConfig, target)
        if spd is None:
            raise ValueError("SPDModule needs spd=SPDConfig(components=[...]) saying which modules to decompose")
        self.spd_cfg = as_config(S.SPDConfig, spd)
        self.loss_cfg = as_config(SPDLossConfig, loss)
        self.train_cfg = as_config(SPDTrainConfig, train)
        torch.manual_seed(self.train_cfg.seed)
        model = target if isinstance(target, nn.Module) else self.target_cfg.build(train=not _LOADING_CHECKPOINT.get())
        torch.manual_seed(self.train_cfg.seed)
        self.spd = S.SPDModel(model, self.spd_cfg)
        self.register_buffer("_frac", torch.zeros(()), persistent=False)
        self._loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]] = self.compute_losses
        self.final_metrics: dict[str, float] = {}
        self._restored = False  # weights come from a checkpoint (resume): no faithfulness warmup
        # PGD ascent steps of this step under loss.pgd.n_steps_schedule (None: loss.pgd.n_steps); set by
        # training_step outside the compiled region, so a compiled loss sees a new value only when it changes
        self.pgd_steps_now: int | None = None

    @property
    def model(self) -> S.SPDModel:
        """The decomposition (components, CI functions and the frozen target): what the optimizer trains."""
        return self.spd

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, weights_only: bool | None = True,
                             **kwargs: Any) -> SPDModule:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``; a target from an :class:`SPDTargetConfig` is built untrained (its
        trained weights are in the checkpoint). A module made with an ``nn.Module`` target needs it again:
        ``SPDModule.load_from_checkpoint(path, target=model)``. The file is read with ``weights_only=True`` by
        default (torch before 2.6 defaults to unpickling anything)."""
        token = _LOADING_CHECKPOINT.set(True)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, weights_only=weights_only, **kwargs)
        finally:
            _LOADING_CHECKPOINT.reset(token)

    # -- data for toy targets -------------------------------------------------------------------
    def _own_stream(self, seed: int, split: str = "train") -> Any:
        """The endless stream of batches this target brings (toy features, or demo-corpus windows)."""
        cfg = self.target_cfg
        if isinstance(cfg, SPDTargetConfig) and cfg.is_toy:
            n = self.spd.target.config.n_features
            return SparseFeatureDataset(n, cfg.feature_probability, self.train_cfg.batch_size, cfg.value_range, seed=seed)
        if (isinstance(cfg, SPDTargetConfig) and cfg.kind == "gpt" and cfg.checkpoint in (None, DEMO)
                and cfg.pretrained is None):
            # the byte-level GPTs trained on the offline corpus read its windows
            return corpus_windows(split, cfg.seq_len, self.train_cfg.batch_size, seed)
        raise ValueError(
            "this target brings no data of its own: pass a datamodule or dataloaders to the Trainer (e.g. "
            "lightning_opt.data.TokenShardDataModule yielding (x, y) token batches; in the recipe a `data:` "
            "section with class_path lightning_opt.data.TokenShardDataModule)"
        )

    @override
    def train_dataloader(self) -> DataLoader:
        stream = self._own_stream(self.train_cfg.seed + 1)
        # a resumed run (global_step restored before the loaders are made) continues the stream where it stopped
        skip = self.global_step if self._trainer is not None else 0
        return DataLoader(_SkipFirst(stream, skip) if skip else stream, batch_size=None)

    def _held_out_batches(self) -> list[Any]:
        """``eval_batches`` batches the training stream never gives (another seed; the demo corpus' val split)."""
        it = iter(self._own_stream(self.train_cfg.seed + 2, split="val"))
        return [next(it) for _ in range(self.train_cfg.eval_batches)]

    @override
    def test_dataloader(self) -> DataLoader:
        """Toy and demo targets: ``train.eval_batches`` held-out batches."""
        return DataLoader(self._held_out_batches(), batch_size=None)

    @override
    def predict_dataloader(self) -> DataLoader:
        """Toy and demo targets: ``train.eval_batches`` held-out batches."""
        return DataLoader(self._held_out_batches(), batch_size=None)

    # -- the step ---------------------------------------------------------------------------------
    @staticmethod
    def batch_inputs(batch: Any) -> Tensor:
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def _reduce_sums(self, sums: dict[str, Tensor], n: int) -> tuple[dict[str, Tensor], Tensor | int]:
        """All-reduce the importance sums (differentiably) so the loss is the global one under DDP."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return sums, n
        keys = list(sums)
        flat = all_reduce(torch.cat([sums[k] for k in keys]))
        count = torch.tensor(float(n), device=flat.device)
        dist.all_reduce(count)  # tensor collective, no host sync
        out, i = {}, 0
        for k in keys:
            out[k] = flat[i : i + sums[k].numel()]
            i += sums[k].numel()
        return out, count

    def compute_losses(self, batch: Any, frac: Tensor | float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
        """Total loss and the raw terms for one batch (the whole forward; compiled when asked)."""
        return self._compose_losses(batch, frac, self._main_terms, self._pgd_terms, self._final_terms)

    def _compose_losses(self, batch: Any, frac: Tensor | float, main: Callable[..., Any], pgd: Callable[..., Any],
                        final: Callable[..., Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`compute_losses` from its three parts: ``main`` (target pass, causal importances, every term but
        PGD's), ``pgd`` (the PGD terms) and ``final`` (the weighted total and CI-L0). Under ``compile="full"``
        each part is compiled on its own (:meth:`apply_compile`): PGD's ``torch.autograd.grad`` breaks the graph
        anyway, and a break inside one traced function makes dynamo trace that function again from its start
        up to the break, the whole forward before PGD a second time."""
        x = self.batch_inputs(batch)
        lc, spd = self.loss_cfg, self.spd
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.train_cfg.autocast_bf16):
            terms, tgt, ci_lower, lead_shape = main(x, frac)
            if lc.pgd_recon > 0 or lc.pgd_recon_subset > 0:
                terms = pgd(x, tgt, ci_lower, lead_shape, terms)
        spd.state.delta_weights = {}
        spd.forget_prefix()
        return final(terms, ci_lower)

    def _main_terms(self, x: Tensor, frac: Tensor | float) -> tuple[dict[str, Tensor], S.ReconTarget, dict[str, Tensor],
                                                                   torch.Size]:
        """Target pass, causal importances and every loss term but PGD's (under the caller's autocast)."""
        lc, spd = self.loss_cfg, self.spd
        deltas = spd.weight_deltas()
        spd.refresh_delta_weights(deltas)
        # the masked passes below reuse the outputs of the blocks before the first decomposed layer
        target_out, inputs = spd.target_forward(x, keep_prefix=True)
        tgt = S.recon_target(target_out, lc.output)
        ci = spd.causal_importances(inputs)
        terms: dict[str, Tensor] = {}
        if lc.faithfulness > 0:
            terms["faithfulness"] = S.faithfulness_loss(deltas)
        if lc.importance_minimality > 0:
            p = S.annealed_p(lc.p, frac, lc.p_anneal_start, lc.p_final, lc.p_anneal_end)
            terms["importance_minimality"] = S.importance_minimality_loss(ci.upper, p, lc.beta, lc.eps, self._reduce_sums)
        use_delta = self.spd_cfg.use_delta

        def run(masks: dict[str, Tensor], delta: bool = use_delta, routes: dict[str, Tensor] | None = None) -> Tensor:
            dm = self._uniform_delta_masks(spd.delta_masks({k: ci.lower[k] for k in masks})) if delta else None
            return spd.recon_loss(spd.masked_forward(x, masks=masks, delta_masks=dm, routes=routes), tgt)

        if lc.stochastic_recon > 0:
            terms["stochastic_recon"] = sum(run(spd.stochastic_masks(ci.lower)) for _ in range(lc.n_mask_samples)) / lc.n_mask_samples
        if lc.stochastic_recon_layerwise > 0:
            acc = []
            for _ in range(lc.n_mask_samples):
                masks = spd.stochastic_masks(ci.lower)
                acc.extend(run({n: masks[n]}) for n in spd.layer_names)
            terms["stochastic_recon_layerwise"] = sum(acc) / len(acc)
        lead_shape = next(iter(ci.lower.values())).shape[:-1]
        if lc.stochastic_recon_subset > 0:
            acc = []
            for _ in range(lc.n_mask_samples):
                routes = S.uniform_k_subset_routes(spd.layer_names, lead_shape, x.device)
                acc.append(run(spd.stochastic_masks(ci.lower), routes=routes))
            terms["stochastic_recon_subset"] = sum(acc) / len(acc)
        if lc.ci_masked_recon > 0:
            terms["ci_masked_recon"] = run(dict(ci.lower), delta=False)
        return terms, tgt, ci.lower, lead_shape

    def _pgd_terms(self, x: Tensor, tgt: S.ReconTarget, ci_lower: dict[str, Tensor], lead_shape: torch.Size,
                   terms: dict[str, Tensor]) -> dict[str, Tensor]:
        """``terms`` with the PGD reconstruction terms added (under the caller's autocast)."""
        lc = self.loss_cfg
        terms = dict(terms)
        if lc.pgd_recon > 0:
            terms["pgd_recon"] = self.pgd_recon(x, tgt, ci_lower, lead_shape, routes=None)
        if lc.pgd_recon_subset > 0:
            routes = S.uniform_k_subset_routes(self.spd.layer_names, lead_shape, x.device)
            terms["pgd_recon_subset"] = self.pgd_recon(x, tgt, ci_lower, lead_shape, routes=routes)
        return terms

    def _final_terms(self, terms: dict[str, Tensor], ci_lower: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted total of ``terms`` and the CI-L0 terms beside them."""
        lc = self.loss_cfg
        total = sum(getattr(lc, k) * v for k, v in terms.items())
        terms = dict(terms)
        terms["ci_l0"] = sum(S.ci_l0(g, self.train_cfg.ci_threshold) for g in ci_lower.values())
        for n, g in ci_lower.items():
            terms[f"ci_l0/{n}"] = S.ci_l0(g.detach(), self.train_cfg.ci_threshold)
        return total, terms

    def _uniform_delta_masks(self, dms: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """Under regional compilation (in grad mode), delta masks as dense tensors that take a gradient: the
        stochastic terms' random masks and the final PGD pass' fixed ones become leaves with ``requires_grad``
        (their gradient, a vector over positions, is never read), the adversarial ones of the ascent stay as
        they are. Every masked pass then hands the compiled layer tensors of one kind, and each layer shape
        compiles two variants fewer. Elsewhere the masks pass through unchanged."""
        if dms is None or self.compile_config.mode != "regional" or not torch.is_grad_enabled():
            return dms
        return {k: v.contiguous() if v.requires_grad else v.detach().contiguous().requires_grad_(True)
                for k, v in dms.items()}

    def pgd_recon(
        self, x: Tensor, target_out: Tensor | S.ReconTarget, ci: dict[str, Tensor], lead_shape: torch.Size,
        routes: dict[str, Tensor] | None,
    ) -> Tensor:
        """Reconstruction under masks ``g + (1 - g) s`` with the sources ``s`` chosen adversarially."""
        pc, spd, use_delta = self.loss_cfg.pgd, self.spd, self.spd_cfg.use_delta
        tgt = target_out if isinstance(target_out, S.ReconTarget) else S.recon_target(target_out, self.loss_cfg.output)
        shared = pc.scope == "shared"
        src_shape = (1,) * len(lead_shape) if shared else tuple(lead_shape)
        dist_on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        srcs: dict[str, Tensor] = {}
        for n in spd.layer_names:
            shape = (*src_shape, spd.module_to_c[n] + int(use_delta))
            if pc.init == "random":
                s = torch.rand(shape, device=x.device)
            else:
                s = torch.full(shape, 1.0 if pc.init == "ones" else 0.0, device=x.device)
            if shared and dist_on:
                dist.broadcast(s, 0)  # one adversary for the global batch
            srcs[n] = s.requires_grad_(True)

        # the ascent's passes take the components detached: the gradient wanted there is the sources' alone, and a
        # compiled backward (``full``) computes one for every input that requires one. Not under ``regional``:
        # there the masked layers would compile one more variant per layer shape
        frozen = self.compile_config.mode != "regional"

        def loss_with(g: dict[str, Tensor], ascent: bool = False) -> Tensor:
            masks, dms = {}, {} if use_delta else None
            for n in spd.layer_names:
                C = spd.module_to_c[n]
                src = srcs[n].expand(*lead_shape, -1)
                masks[n] = g[n] + (1 - g[n]) * src[..., :C]
                if use_delta:
                    dms[n] = src[..., C]
            dms = self._uniform_delta_masks(dms)
            out = spd.masked_forward(x, masks=masks, delta_masks=dms, routes=routes, frozen_components=ascent and frozen)
            return spd.recon_loss(out, tgt)

        ci_detached = {k: v.detach() for k, v in ci.items()}  # the adversary needs no grad through g
        n_steps = pc.n_steps if self.pgd_steps_now is None else self.pgd_steps_now
        self.pgd_ascent(lambda: loss_with(ci_detached, ascent=True), srcs, n_steps, all_reduce=shared and dist_on)
        return loss_with(ci)

    def pgd_ascent(self, loss: Callable[[], Tensor], srcs: dict[str, Tensor], n_steps: int, all_reduce: bool = False) -> None:
        """The PGD inner loop: ``n_steps`` signed-gradient ascent steps of ``loss()`` on the sources (in place,
        clamped to [0, 1]); ``all_reduce`` sums the gradients over ranks (one shared adversary). Leaves the
        sources without grad. A method of its own so that its share of a step can be timed."""
        step_size = self.loss_cfg.pgd.step_size
        for _ in range(n_steps):
            with torch.enable_grad():
                grads = torch.autograd.grad(loss(), list(srcs.values()))
            with torch.no_grad():
                for s, gr in zip(srcs.values(), grads):
                    if all_reduce:
                        dist.all_reduce(gr)
                    s.add_(step_size * gr.sign()).clamp_(0.0, 1.0)
        for s in srcs.values():
            s.requires_grad_(False)

    # -- Lightning hooks ------------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.apply_compile()

    def apply_compile(self) -> list[str]:
        """Compile as ``compile`` says (once; later calls change nothing): ``full`` compiles the three
        parts of :meth:`compute_losses` (see :meth:`_compose_losses`) each with ``torch.compile``, ``regional`` compiles the repeated pieces in place
        (:meth:`~lightning_opt.models.spd.SPDModel.compile_regions`). Returns what was compiled."""
        cc = self.compile_config
        if cc.mode == "full" and self._loss_fn == self.compute_losses:
            opts = {"options": dict(cc.options)} if cc.options else {}
            main, pgd, final = (torch.compile(f, backend=cc.backend, **opts)
                                for f in (self._main_terms, self._pgd_terms, self._final_terms))
            self._loss_fn = functools.partial(self._compose_losses, main=main, pgd=pgd, final=final)
        elif cc.mode == "regional":
            return self.spd.compile_regions(cc.backend, options=cc.options)
        return ["compute_losses"] if cc.mode == "full" else []

    def losses(self, batch: Any, frac: Tensor | float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`compute_losses` as the training step runs it (compiled after :meth:`apply_compile`)."""
        return self._loss_fn(batch, frac)

    @override
    def on_fit_start(self) -> None:
        if not self._restored:  # a resumed run continues from the checkpoint's components
            self.faithfulness_warmup()

    def faithfulness_warmup(self) -> float:
        """AdamW on the faithfulness loss alone, so that V U starts close to W. Returns the final loss."""
        tc = self.train_cfg
        if tc.faithfulness_warmup_steps <= 0:
            return float("nan")
        params = self.spd.component_parameters()
        opt = torch.optim.AdamW(params, lr=tc.faithfulness_warmup_lr, weight_decay=tc.faithfulness_warmup_weight_decay)
        loss = torch.zeros(())
        for _ in range(tc.faithfulness_warmup_steps):
            loss = S.faithfulness_loss(self.spd.weight_deltas())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return float(loss.detach())

    def _config_record(self) -> dict[str, Any]:
        return {"spd": dataclasses.asdict(self.spd_cfg)}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # tokens_seen
        record = self._config_record()
        record["target_is_module"] = isinstance(self.target_cfg, nn.Module)
        checkpoint["lightning_opt_config"] = record  # plain types: weights_only-safe

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        theirs = checkpoint.get("lightning_opt_config") or {}
        if theirs.get("target_is_module") and not isinstance(self.target_cfg, nn.Module):
            raise ValueError(
                "this checkpoint decomposes a target that was passed as an nn.Module (not an SPDTargetConfig); "
                "pass that model again: SPDModule.load_from_checkpoint(path, target=model)"
            )
        theirs = {k: v for k, v in theirs.items() if k != "target_is_module"}
        check_checkpoint_matches(self, checkpoint, ours=self._config_record(), theirs=theirs or None)
        check_resume_length(self, checkpoint)
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        self._restored = True

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        max_steps = max(int(self.trainer.max_steps), 1) if self._trainer is not None else 1
        self._frac.fill_(self.global_step / max_steps)
        pgd = self.loss_cfg.pgd
        self.pgd_steps_now = pgd.steps_at(self.global_step) if pgd.n_steps_schedule else None
        total, terms = self.losses(batch, self._frac)
        x = self.batch_inputs(batch)
        # tokens of a language model's batch, samples of a toy model's
        self.count_tokens(x.shape[:-1].numel() if x.is_floating_point() else x.numel())
        self.log("train/loss", total)  # no prog_bar: a per-batch sync in Lightning (see LazyProgressBar)
        for k, v in terms.items():
            self.log(f"train/{k}", v)
        return total

    @override
    def on_fit_end(self) -> None:
        self.final_metrics = self.evaluate()
        if self.trainer.is_global_zero and self.train_cfg.metrics_path:
            path = self.train_cfg.metrics_path
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.final_metrics, f, indent=2, sort_keys=True)

    # -- inference, test, predict -------------------------------------------------------------------
    @override
    def forward(self, x: Tensor) -> Tensor:
        """The decomposed model's output on ``x`` with every component masked by its causal importance."""
        spd = self.spd
        spd.refresh_delta_weights()
        try:
            _, inputs = spd.target_forward(x)
            return spd.masked_forward(x, masks=dict(spd.causal_importances(inputs).lower))
        finally:
            spd.state.delta_weights = {}

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """With a datamodule's validation data (language models): ``val/<metric>`` as :meth:`test_step` logs."""
        n = self.batch_inputs(batch).shape[0]
        metrics = {f"val/{k}": v for k, v in self._eval_batch(batch).items()}
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=n)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Logs ``test/<metric>`` (CI-L0, reconstruction under CI / stochastic / unmasked / zero masks; CE and KL
        for language models), averaged over the test batches."""
        n = self.batch_inputs(batch).shape[0]
        metrics = {f"test/{k}": v for k, v in self._eval_batch(batch).items()}
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=n)

    @override
    def on_test_epoch_end(self) -> None:
        """Toy targets: ``test/mmcs``, ``test/ml2r`` (TMS), ``test/identity_ci_error/<layer>``."""
        toy = self.toy_metrics()
        if toy:
            self.log_dict({f"test/{k}": v for k, v in toy.items()})

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """For a batch ``x`` (or ``(x, y)``): the target's output ``target``, the output with components masked
        by their causal importances ``output``, and the importances ``ci`` (``{layer: [..., C]}``)."""
        x = self.batch_inputs(batch)
        spd = self.spd
        spd.refresh_delta_weights()
        try:
            target_out, inputs = spd.target_forward(x)
            ci = spd.causal_importances(inputs).lower
            out = spd.masked_forward(x, masks=dict(ci))
        finally:
            spd.state.delta_weights = {}
        return {"target": target_out, "output": out, "ci": dict(ci)}

    # -- evaluation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[Any] | None = None) -> dict[str, float]:
        """Final metrics: CI-L0 per layer and recon losses; toy: identity-CI error, TMS: MMCS / ML2R;
        language models: CE and KL under CI, stochastic, unmasked and zero masks."""
        was_training = self.training
        self.eval()
        out: dict[str, float] = {}
        try:
            if batches is None:
                batches = self._eval_batches()
            device = next(self.spd.parameters()).device
            acc: dict[str, float] = {}
            for b in batches:
                b = b.to(device) if isinstance(b, Tensor) else [t.to(device) for t in b]
                for k, v in self._eval_batch(b).items():
                    acc[k] = acc.get(k, 0.0) + v / len(batches)
            out.update(acc)
            out.update(self.toy_metrics())
        finally:
            self.train(was_training)
        return out

    def _eval_batches(self) -> list[Any]:
        """``eval_batches`` batches: a datamodule's validation batches when it has them (held out), else the
        training stream's."""
        trainer, loader = self._trainer, None
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if datamodule is not None:
            val = datamodule.val_dataloader()
            loader = val if not isinstance(val, list) or val else None  # [] means no validation data
        if loader is None:
            loader = trainer.train_dataloader if trainer is not None else None
        it = iter(loader if loader is not None else self.train_dataloader())
        return list(itertools.islice(it, self.train_cfg.eval_batches))

    def _eval_batch(self, batch: Any) -> dict[str, float]:
        x = self.batch_inputs(batch)
        spd = self.spd
        spd.refresh_delta_weights()
        target_out, inputs = spd.target_forward(x, keep_prefix=True)
        tgt = S.recon_target(target_out, self.loss_cfg.output)
        ci = spd.causal_importances(inputs)
        res: dict[str, float] = {}
        for n, g in ci.lower.items():
            res[f"ci_l0/{n}"] = float(S.ci_l0(g, self.train_cfg.ci_threshold))
        res["ci_l0"] = sum(res[f"ci_l0/{n}"] for n in ci.lower)
        kind = self.loss_cfg.output
        dm = spd.delta_masks(ci.lower)
        variants = {
            "ci": (dict(ci.lower), None),
            "stochastic": (spd.stochastic_masks(ci.lower), dm),
            "unmasked": ({n: torch.ones_like(g) for n, g in ci.lower.items()}, None),
            "zero": ({n: torch.zeros_like(g) for n, g in ci.lower.items()}, None),
        }
        outs = {k: spd.masked_forward(x, masks=m, delta_masks=d) for k, (m, d) in variants.items()}
        spd.forget_prefix()
        for k, o in outs.items():
            res[f"recon/{k}"] = float(spd.recon_loss(o, tgt))
        if kind == "kl" and isinstance(batch, (tuple, list)) and len(batch) > 1:
            y = batch[1]
            res["ce/target"] = float(F.cross_entropy(target_out.flatten(0, -2).float(), y.flatten()))
            for k, o in outs.items():
                res[f"ce/{k}"] = float(F.cross_entropy(o.flatten(0, -2).float(), y.flatten()))
                res[f"kl/{k}"] = res[f"recon/{k}"]
        spd.state.delta_weights = {}
        return res

    def toy_metrics(self) -> dict[str, float]:
        """Identity-CI error on single-feature inputs; MMCS / ML2R of ``linear1`` for TMS."""
        target, spd, res = self.spd.target, self.spd, {}
        cfg = getattr(target, "config", None)
        if not isinstance(cfg, (TMSConfig, ResidMLPConfig)):
            return res
        device = next(self.spd.parameters()).device
        eye = torch.eye(cfg.n_features, device=device) * 0.75
        _, inputs = spd.target_forward(eye)
        ci = spd.causal_importances(inputs).lower
        for n, g in ci.items():
            if any(fnmatch.fnmatchcase(n, p) for p in self.train_cfg.identity_patterns):
                parts = S.identity_ci_breakdown(g)
                res[f"identity_ci_error/{n}"] = float(parts["off_diagonal"] + parts["diagonal_misses"])
                for k, v in parts.items():
                    res[f"identity_ci/{k}/{n}"] = float(v)
        if isinstance(cfg, TMSConfig) and "linear1" in spd.layers:
            layer = spd.layers["linear1"]
            # layer.weight is W^T [n_features, n_hidden]: row j is the direction feature j is written to
            mmcs, ml2r = S.mmcs_ml2r(layer.weight, layer.V, layer.U)
            res["mmcs"], res["ml2r"] = float(mmcs), float(ml2r)
        return res


# --------------------------------------------------------------------------------------------------
# Language-model targets
# --------------------------------------------------------------------------------------------------


def _build_gpt(cfg: SPDTargetConfig) -> nn.Module:
    if cfg.pretrained is not None:
        config = GPTConfig(**cfg.model) if cfg.model else None
        return GPT.from_pretrained(cfg.pretrained, config).requires_grad_(False).eval()
    if cfg.checkpoint == DEMO:
        model = train_demo_target(steps=cfg.train_steps, seq_len=cfg.seq_len, batch_size=cfg.train_batch_size,
                                  **cfg.model)
        return model.requires_grad_(False).eval()
    if cfg.checkpoint:
        state = load_checkpoint_file(cfg.checkpoint, "SPD target checkpoint")  # weights only: runs no code
        if isinstance(state, dict) and ({"config", "model"} <= state.keys() or "state_dict" in state):
            # a recipe checkpoint: the GPT's config travels with its weights
            return load_gpt_checkpoint(cfg.checkpoint).requires_grad_(False).eval()
    kw = {"vocab_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": cfg.seq_len, **cfg.model}
    model = GPT(GPTConfig(**kw))
    if cfg.checkpoint:
        model.load_state_dict(state)
    elif cfg.train_steps > 0:
        torch.manual_seed(cfg.seed)
        batches = iter(corpus_windows("train", cfg.seq_len, cfg.train_batch_size, cfg.seed))
        train_language_model(model, batches, cfg.train_steps, cfg.train_lr)
    return model.requires_grad_(False).eval()


def _build_hf_gpt2(cfg: SPDTargetConfig) -> nn.Module:
    transformers = require("transformers", purpose="SPD on a Hugging Face GPT-2")
    if cfg.checkpoint:
        model = transformers.GPT2LMHeadModel.from_pretrained(cfg.checkpoint)
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg.model))
    return model.requires_grad_(False).eval()
