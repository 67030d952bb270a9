"""Cross-entropy of a linear head with an optional logit soft-cap, without materialising all the logits.

``linear_cross_entropy(h, W, y, softcap)`` equals
``F.cross_entropy(cap * tanh((h @ W.T) / cap), y)`` but walks the tokens in chunks: each chunk's logits
are formed in float32, turned into the loss and into the gradients of ``h`` and ``W`` right away, and
dropped. Peak memory is ``chunk_size x vocab`` floats instead of ``tokens x vocab`` (6.6 GB for 32k
tokens and GPT-2's vocabulary), the same idea as Liger-Kernel's fused linear cross-entropy. The backward
pass only scales the stored gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softcap_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, softcap: float | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Reference: mean cross-entropy of ``cap * tanh(logits / cap)`` in float32."""
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, softcap, chunk_size, ignore_index):  # type: ignore[override]
        with torch.autocast(h.device.type, enabled=False):
            n = h.shape[0]
            valid_all = targets != ignore_index
            # a tensor, not .item(): no host sync; clamp so an all-ignored batch gives 0, not NaN
            count = valid_all.sum().clamp(min=1).to(torch.float32)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_size):
                hc = h[start : start + chunk_size]
                tc = targets[start : start + chunk_size]
                z = (hc @ weight.t()).float()
                if softcap is not None:
                    t = torch.tanh(z / softcap)
                    z = softcap * t
                lse = torch.logsumexp(z, dim=-1)
                vc = tc != ignore_index
                tgt = torch.where(vc, tc, torch.zeros_like(tc)).unsqueeze(1)
                loss_sum = loss_sum + ((lse - z.gather(1, tgt).squeeze(1)) * vc).sum()
                # d loss / d z = softmax(z) - onehot(target), zero on ignored rows
                g = torch.exp(z - lse.unsqueeze(1))
                g = g.scatter_add(1, tgt, -torch.ones_like(tgt, dtype=g.dtype))
                g = g * vc.unsqueeze(1)
                if softcap is not None:
                    g = g * (1.0 - t * t)
                g = g.to(h.dtype)
                grad_h[start : start + chunk_size] = g @ weight
                grad_w += (g.t() @ hc).float()
            ctx.save_for_backward(grad_h, grad_w, count)
            ctx.weight_dtype = weight.dtype
            return loss_sum / count

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_out / count
        return (grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype), None, None, None, None)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of ``softcap(h @ weight.T)`` against ``targets``, computed in token chunks.

    Under autocast, ``h`` and ``weight`` are cast to the autocast dtype first (as ``nn.Linear`` would),
    the logits and the softmax are float32.

    Args:
        h: hidden states ``[..., C]``.
        weight: the head ``[V, C]`` (rows beyond the real vocabulary are allowed: they act as padding).
        targets: ``[...]`` token ids; ``ignore_index`` entries do not count.
        softcap: ``cap`` in ``cap * tanh(z / cap)``, or ``None``.
        chunk_size: tokens per chunk (peak extra memory about ``3 x chunk_size x V x 4`` bytes).
        ignore_index: target value to skip.
    """
    if chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be positive")
    if h.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: h has width {h.shape[-1]} but weight is {tuple(weight.shape)}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: h {tuple(h.shape)} and targets {tuple(targets.shape)} disagree")
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        h, weight = h.to(dtype), weight.to(dtype)
    elif weight.dtype != h.dtype:
        weight = weight.to(h.dtype)
    return _ChunkedLinearCrossEntropy.apply(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), softcap, int(chunk_size), int(ignore_index)
    )
