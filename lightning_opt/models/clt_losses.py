"""The CLT's losses that need only tensors: FVU, Anthropic's tanh sparsity penalty (dense and sparse) and its
pre-activation loss. AuxK decodes through the model and lives with it (:func:`lightning_opt.models.clt.auxk_loss`);
every loss imports from ``lightning_opt.models.clt`` too."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fvu", "fvu_per_layer", "preactivation_loss", "tanh_sparsity_penalty", "tanh_sparsity_penalty_sparse"]


def fvu_per_layer(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of the pooled FVU per layer.

    FVU (pooled over dimensions) for layer t = ``sum_{n,i} (y - yhat)^2 / sum_{n,i} (y - mean_n y)^2``:
    squared error summed over tokens and dimensions, over the squared deviation of the target from its
    per-dimension mean over the batch, summed the same way.

    Args:
        pred, target: ``[N, L, d]``.

    Returns:
        ``(sse [L], sst [L])`` in float32.
    """
    pred, target = pred.float(), target.float()
    sse = (target - pred).pow(2).sum(dim=(0, 2))
    sst = (target - target.mean(dim=0, keepdim=True)).pow(2).sum(dim=(0, 2))
    return sse, sst


def fvu(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Pooled FVU over all layers: ``sum_t sse_t / sum_t sst_t`` (see :func:`fvu_per_layer`)."""
    sse, sst = fvu_per_layer(pred, target)
    return sse.sum() / sst.sum().clamp_min(1e-12)


def tanh_sparsity_penalty(acts: torch.Tensor, decoder_norms: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """Anthropic's penalty ``sum_{l,f} tanh(c * a_lf * ||W_dec,lf||)`` averaged over tokens.

    Args:
        acts: ``[L, N, F]`` activations (dense).
        decoder_norms: ``[L, F]`` norms of the concatenated decoder vectors (:meth:`CLT.decoder_norms`).
    """
    # in the activations' dtype (no float32 copy of [L, N, F]); the sum accumulates in float32
    scaled = acts * (c * decoder_norms[:, None, :]).to(acts.dtype)
    return torch.tanh(scaled).sum(dtype=torch.float32) / acts.shape[1]


def tanh_sparsity_penalty_sparse(
    indices: torch.Tensor, values: torch.Tensor, decoder_norms: torch.Tensor, n_tokens: int
) -> torch.Tensor:
    """:func:`tanh_sparsity_penalty` from sparse activations (zeros contribute tanh(0) = 0)."""
    L, nf = decoder_norms.shape
    layer = torch.div(indices, n_tokens * nf, rounding_mode="floor")
    feat = indices % nf
    return torch.tanh(values.float() * decoder_norms[layer, feat]).sum() / n_tokens


def preactivation_loss(pre: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Anthropic's pre-activation loss ``sum_{l,f} relu(threshold - pre)`` averaged over tokens.

    Pushes dead features' pre-activations up towards firing; ``threshold`` is ``[L, F]`` (JumpReLU) or 0.
    """
    if threshold is None:
        return _PreactLoss.apply(pre)
    # relu(th - pre) = -min(pre - th, 0): one temporary in pre's dtype, fp32 accumulation
    shifted = pre - threshold[:, None, :].to(pre.dtype)
    return -shifted.clamp(max=0).sum(dtype=torch.float32) / pre.shape[1]


class _PreactLoss(torch.autograd.Function):
    """``-sum(min(pre, 0)) / N`` (float32) with a one-pass backward ``where(pre <= 0, -g / N, 0)`` in pre's dtype.

    Autograd of ``clamp(...).sum(dtype=float32)`` would first materialise the broadcast float32 gradient in
    pre's dtype (a full ``[L, N, F]`` copy), then a mask, then the masked gradient."""

    @staticmethod
    def forward(ctx: Any, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre)
        return -pre.clamp(max=0).sum(dtype=torch.float32) / pre.shape[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (pre,) = ctx.saved_tensors
        step = (-grad / pre.shape[1]).to(pre.dtype)  # clamp's gradient includes pre == 0, as here
        return torch.where(pre <= 0, step, torch.zeros((), dtype=pre.dtype, device=pre.device))
