"""GPT-2 architecture variants that the ablation tries but the library does not carry.

Multi-token prediction (extra heads, head ``j`` predicting token ``t+1+j``, their mean loss added with a weight)
and a mixture-of-experts MLP (top-k routing, experts evaluated densely, a Switch-Transformer load-balancing
loss) have no measured effect in this repository's runs and no recipe uses them, so they live here, built on
:class:`~lightning_opt.models.gpt2.GPT`'s public extension points: the blocks' ``mlp`` modules,
:meth:`GPT.hidden_states`, :meth:`GPT.hidden_loss`, :meth:`GPT.hidden_matrices` and
:meth:`GPT.flops_per_token`. ``gpt2_ablation.py`` rows ``mtp_k2`` and ``moe_2`` use them through
``gpt2_common.with_model(spec, mtp_heads=..., moe_experts=...)``.

    model = VariantGPT(GPTConfig(...), GPTExecution(), mtp_heads=1, moe_experts=2)

In training mode the loss includes the auxiliary terms; in eval mode it is the plain next-token loss, so
validation numbers compare with the plain model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_opt.models.gpt2 import GPT, MLP, GPTConfig, GPTExecution, KVCache, make_norm


@dataclass(frozen=True)
class Variants:
    """The variant settings (all off by default).

    Args:
        mtp_heads: extra multi-token-prediction heads (head j predicts token t+1+j).
        mtp_weight: weight of the auxiliary heads' mean loss.
        moe_experts: experts in a mixture-of-experts MLP (0 = the dense MLP).
        moe_top_k: experts used per token.
        moe_aux_weight: weight of the load-balancing loss.
    """

    mtp_heads: int = 0
    mtp_weight: float = 0.3
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_aux_weight: float = 0.01

    def __post_init__(self) -> None:
        if self.mtp_heads < 0:
            raise ValueError(f"mtp_heads={self.mtp_heads} must be >= 0")
        if self.moe_experts < 0 or self.moe_experts == 1:
            raise ValueError(f"moe_experts={self.moe_experts}: use 0 (dense MLP) or at least 2 experts")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k} must be in [1, moe_experts={self.moe_experts}]")


VARIANT_FIELDS = frozenset(Variants.__dataclass_fields__)


class MoE(nn.Module):
    """Mixture of expert MLPs with top-k routing.

    Experts are evaluated densely and combined with the (sparse) routing weights: with the few experts
    an ablation uses this avoids data-dependent shapes, so it compiles and needs no host sync.
    ``aux_loss`` holds the load-balancing loss of the last forward (Switch Transformer form).
    """

    def __init__(self, cfg: GPTConfig, ex: GPTExecution, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(cfg.n_embd, experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, ex) for _ in range(experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_p / top_p.sum(-1, keepdim=True))
        n_exp = probs.shape[-1]
        frac = F.one_hot(top_i[..., 0], n_exp).float().mean(dim=(0, 1))
        self.aux_loss = n_exp * (frac * probs.mean(dim=(0, 1))).sum()
        out = torch.stack([e(x) for e in self.experts], dim=-1)
        return (out * gates.unsqueeze(-2).to(out.dtype)).sum(-1)


class VariantGPT(GPT):
    """:class:`GPT` with multi-token-prediction heads and/or mixture-of-experts MLPs (see :class:`Variants`)."""

    def __init__(self, config: GPTConfig, execution: GPTExecution | None = None, **variants: object) -> None:
        super().__init__(config, execution)
        self.variants = v = Variants(**variants)
        cfg, ex = self.config, self.execution
        if ex.layer_drop and v.moe_experts:
            raise ValueError("layer_drop is not supported with moe_experts (a skipped block has no load-balancing loss)")
        fresh: list[nn.Module] = []
        if v.moe_experts:
            for block in self.blocks:
                block.mlp = MoE(cfg, ex, v.moe_experts, v.moe_top_k)
                fresh.append(block.mlp)
        self.mtp = nn.ModuleList(
            nn.Sequential(make_norm(cfg, cfg.n_embd), nn.Linear(cfg.n_embd, cfg.n_embd, bias=False))
            for _ in range(v.mtp_heads)
        )
        fresh.append(self.mtp)
        for module in fresh:  # GPT's initialisation, for the modules that replaced or joined its own
            module.apply(self._init_weights)
            for name, p in module.named_parameters():
                if name.endswith("c_proj.weight"):
                    if cfg.zero_init_proj:
                        nn.init.zeros_(p)
                    else:
                        nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        if targets is None or not self.training:  # logits, or the plain next-token loss in evaluation
            return super().forward(idx, targets, kv_cache)
        if kv_cache is not None:
            raise ValueError("kv_cache is for inference: call the model with targets and no kv_cache to get a loss")
        h = self.hidden_states(idx)
        loss = self.hidden_loss(h, targets)
        if self.mtp:
            aux = [self.hidden_loss(head(h)[:, :-j], targets[:, j:]) for j, head in enumerate(self.mtp, start=1)]
            loss = loss + self.variants.mtp_weight * torch.stack(aux).mean()
        if self.variants.moe_experts:
            aux_moe = torch.stack([blk.mlp.aux_loss for blk in self.blocks]).mean()
            loss = loss + self.variants.moe_aux_weight * aux_moe
        return loss

    def hidden_matrices(self) -> list[nn.Parameter]:
        return [p for n, p in self.blocks.named_parameters() if p.ndim >= 2 and "router" not in n] + [
            m[1].weight for m in self.mtp
        ]

    def flops_per_token(self, seq_len: int | None = None) -> float:
        flops = super().flops_per_token(seq_len)
        v = self.variants
        if v.moe_experts:  # only top_k experts are "used" per token in the FLOP convention
            per_expert = sum(p.numel() for p in self.blocks[0].mlp.experts[0].parameters())
            flops -= 6.0 * self.config.n_layer * per_expert * (v.moe_experts - v.moe_top_k)
        return flops


def build_gpt(config: GPTConfig, execution: GPTExecution | None = None, **variants: object) -> GPT:
    """A plain :class:`GPT` when every variant is off, else a :class:`VariantGPT`."""
    if any(v != Variants.__dataclass_fields__[k].default for k, v in variants.items()):
        return VariantGPT(config, execution, **variants)
    return GPT(config, execution)
