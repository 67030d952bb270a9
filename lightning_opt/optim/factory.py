"""The optimizer factory: fused AdamW, the speedrun's Muon + Adam split, bitsandbytes 8-bit AdamW."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_opt._optional import require
from lightning_opt.optim.lion import Lion
from lightning_opt.optim.muon import NS_COEFFICIENTS, Muon

OPTIMIZERS = ("adamw", "muon", "adamw8bit", "lion")


@dataclass
class OptimConfig:
    """Optimizer settings.

    Args:
        name: ``adamw`` (fused on CUDA), ``muon`` (Muon for hidden matrices, AdamW for the rest),
            ``adamw8bit`` (bitsandbytes; falls back to torch AdamW with a warning when it is missing) or
            ``lion`` (:class:`~lightning_opt.optim.lion.Lion` for every parameter; use a learning rate 3-10x
            smaller and a weight decay 3-10x larger than AdamW's).
        lr: AdamW (or Lion) learning rate (for ``muon``: the default for the Adam groups).
        betas, eps: AdamW moments; for ``lion``, ``betas`` are Lion's ``(beta1, beta2)`` (the paper uses
            ``(0.9, 0.99)``) and ``eps`` is unused.
        weight_decay: decoupled weight decay on matrices (never on vectors, norms or biases).
        muon_lr, muon_momentum, muon_weight_decay: Muon settings for the hidden matrices.
        muon_momentum_start, muon_momentum_warmup_steps: Muon's momentum rises linearly from
            ``muon_momentum_start`` to ``muon_momentum`` over this many steps (``None`` = no warmup).
        muon_split_fused: Muon orthogonalises the query, key and value blocks of a fused projection
            separately (parameters with ``muon_row_splits``), as if they were three matrices.
        muon_batched: orthogonalise same-shape matrices in one batched iteration (``False``: one at a time).
        muon_ns_coefficients: Newton-Schulz coefficients, ``"jordan"`` or ``"polar_express"`` (see ``Muon``).
        muon_normuon_beta2: ``None`` or the NorMuon-style per-neuron second-moment decay (see ``Muon``).
        embed_lr, head_lr, scalar_lr: per-group Adam learning rates for ``muon`` (``None`` = ``lr``).
        fused: use the fused AdamW kernel (``None`` = when every parameter is on CUDA).
    """

    name: str = "adamw"
    lr: float = 6e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    muon_lr: float = 0.05
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_momentum_start: float | None = None
    muon_momentum_warmup_steps: int = 0
    muon_split_fused: bool = True
    muon_batched: bool = True
    muon_ns_coefficients: str = "jordan"
    muon_normuon_beta2: float | None = None
    embed_lr: float | None = None
    head_lr: float | None = None
    scalar_lr: float | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is unknown; choose one of {OPTIMIZERS}")
        self.betas = tuple(self.betas)  # YAML gives lists
        for field in ("lr", "muon_lr", "embed_lr", "head_lr", "scalar_lr"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"optimizer {field}={value} must be positive")
        if self.muon_ns_coefficients not in NS_COEFFICIENTS:
            raise ValueError(f"muon_ns_coefficients={self.muon_ns_coefficients!r} is unknown; choose one of "
                             f"{NS_COEFFICIENTS}")
        if self.muon_normuon_beta2 is not None and not 0 <= self.muon_normuon_beta2 < 1:
            raise ValueError(f"muon_normuon_beta2={self.muon_normuon_beta2} must be in [0, 1) or null (plain Muon)")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas={self.betas} must be two numbers in [0, 1)")


def _unique(params) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _adamw(groups: list[dict], cfg: OptimConfig) -> Optimizer:
    params = [p for g in groups for p in g["params"]]
    fused = cfg.fused if cfg.fused is not None else bool(params) and all(p.is_cuda for p in params)
    if cfg.name == "adamw8bit":
        on_cuda = bool(params) and all(p.is_cuda for p in params)
        try:
            if not on_cuda:
                raise ImportError("bitsandbytes 8-bit AdamW needs CUDA parameters")
            bnb = require("bitsandbytes", purpose="8-bit AdamW", fallback="torch AdamW")
            return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        except ImportError as err:
            warnings.warn(f"{err} Falling back to torch AdamW.", stacklevel=3)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    hidden: list[nn.Parameter] | None = None,
    embeddings: list[nn.Parameter] | None = None,
    head: list[nn.Parameter] | None = None,
) -> list[Optimizer]:
    """Build the optimizers for ``model``.

    Matrices get weight decay, everything of fewer than two dimensions does not. With ``muon``, the
    ``hidden`` matrices (default: every 2-D parameter that is not an embedding or the head) go to
    :class:`Muon`; embeddings, head and vectors go to AdamW with their own learning rates.

    Every parameter group carries a ``name`` (``decay`` / ``no_decay``; with ``muon``: ``muon``, ``embeddings``,
    ``head``, ``scalars``), unique over the optimizers, which Lightning's ``LearningRateMonitor`` puts in its keys
    (``lr/muon``, ``lr/embeddings``, ...).

    Returns:
        One optimizer, or two (Muon first) for ``muon``.
    """
    params = _unique(model.parameters())
    if embeddings is None:
        embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    embeddings = _unique(embeddings)
    emb_ids = {id(p) for p in embeddings}
    head = [p for p in _unique(head or []) if id(p) not in emb_ids]
    head_ids = {id(p) for p in head}

    if cfg.name != "muon":
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
                  {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
        groups = [g for g in groups if g["params"]]
        if cfg.name == "lion":
            return [Lion(groups, lr=cfg.lr, betas=cfg.betas)]
        return [_adamw(groups, cfg)]

    if hidden is None:
        hidden = [p for p in params if p.ndim >= 2 and id(p) not in emb_ids and id(p) not in head_ids]
    hidden = _unique(hidden)
    hid_ids = {id(p) for p in hidden}
    scalars = [p for p in params if id(p) not in hid_ids | emb_ids | head_ids]
    adam_groups = [
        {"params": embeddings, "lr": cfg.embed_lr or cfg.lr, "weight_decay": 0.0, "name": "embeddings"},
        {"params": head, "lr": cfg.head_lr or cfg.lr, "weight_decay": cfg.weight_decay, "name": "head"},
        {"params": scalars, "lr": cfg.scalar_lr or cfg.lr, "weight_decay": 0.0, "name": "scalars"},
    ]
    optimizers: list[Optimizer] = []
    if hidden:
        optimizers.append(Muon([{"params": hidden, "name": "muon"}], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                               weight_decay=cfg.muon_weight_decay, momentum_start=cfg.muon_momentum_start,
                               momentum_warmup_steps=cfg.muon_momentum_warmup_steps,
                               split_fused=cfg.muon_split_fused, batched=cfg.muon_batched,
                               ns_coefficients=cfg.muon_ns_coefficients, normuon_beta2=cfg.muon_normuon_beta2))
    adam_groups = [g for g in adam_groups if g["params"]]
    if adam_groups:
        optimizers.append(_adamw(adam_groups, cfg))
    return optimizers
