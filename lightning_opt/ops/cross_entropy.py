"""Cross-entropy of a linear head with an optional logit soft-cap, without materialising all the logits.

``linear_cross_entropy(h, W, y, softcap)`` equals
``F.cross_entropy(cap * tanh((h @ W.T) / cap), y)`` but walks the tokens in chunks: each chunk's logits
are formed in float32, turned into the loss and into the gradients of ``h`` and ``W`` right away, and
dropped. Peak memory is ``chunk_size x vocab`` floats instead of ``tokens x vocab`` (6.6 GB for 32k
tokens and GPT-2's vocabulary), the same idea as Liger-Kernel's fused linear cross-entropy. The backward
pass only scales the stored gradients.

With ``fp8=True`` the three head matmuls run in FP8 through ``torch._scaled_mm`` (H100-class GPUs): hidden
states and head in e4m3 with per-tensor scales from their absolute maxima (computed on the device, no
sync), the logit gradient in e5m2. Before the final ``1 / count`` the logit gradient is
``(softmax - onehot) * (1 - tanh^2)``, bounded by 1 in magnitude, so a fixed scale of ``2**14`` uses the
e5m2 range without measuring it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_opt._internals import scaled_mm


def softcap_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, softcap: float | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Reference: mean cross-entropy of ``cap * tanh(logits / cap)`` in float32."""
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)


E4M3_MAX = 448.0
GRAD_SCALE = 2.0**14  # |d loss / d z| <= 1 before the 1/count: 2**14 sits well inside e5m2's 57344


def _to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled e4m3 copy and its dequantisation scale (a float32 device scalar)."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    return (x.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, softcap, chunk_size, ignore_index, fp8):  # type: ignore[override]
        with torch.autocast(h.device.type, enabled=False):
            n = h.shape[0]
            if fp8:
                h8, h_inv = _to_e4m3(h)
                w8, w_inv = _to_e4m3(weight)
                w8_col = w8.t().contiguous().t()  # _scaled_mm wants its second operand column-major
                g_inv = torch.full((), 1.0 / GRAD_SCALE, dtype=torch.float32, device=h.device)
            valid_all = targets != ignore_index
            # a tensor, not .item(): no host sync; clamp so an all-ignored batch gives 0, not NaN
            count = valid_all.sum().clamp(min=1).to(torch.float32)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_size):
                hc = h[start : start + chunk_size]
                tc = targets[start : start + chunk_size]
                use_fp8 = fp8 and hc.shape[0] % 16 == 0  # _scaled_mm needs multiples of 16
                if use_fp8:
                    hc8 = h8[start : start + chunk_size]
                    z = scaled_mm(hc8, w8.t(), scale_a=h_inv, scale_b=w_inv, out_dtype=torch.float32)
                else:
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
                if use_fp8:
                    g8 = (g * GRAD_SCALE).to(torch.float8_e5m2)
                    grad_h[start : start + chunk_size] = scaled_mm(
                        g8, w8_col, scale_a=g_inv, scale_b=w_inv, out_dtype=h.dtype)
                    grad_w += scaled_mm(g8.t().contiguous(), hc8.t().contiguous().t(), scale_a=g_inv,
                                        scale_b=h_inv, out_dtype=torch.float32)
                    continue
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
        return (grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype), None, None, None, None,
                None)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
    fp8: bool = False,
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
        fp8: run the head matmuls in FP8 (``torch._scaled_mm``; the width and the vocabulary rows must be
            multiples of 16, e.g. ``vocab_multiple=128``).
    """
    if chunk_size <= 0:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size} must be positive")
    if h.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy: h has width {h.shape[-1]} but weight is {tuple(weight.shape)}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: h {tuple(h.shape)} and targets {tuple(targets.shape)} disagree")
    if fp8 and (h.shape[-1] % 16 or weight.shape[0] % 16):
        raise ValueError(
            f"linear_cross_entropy(fp8=True) needs width and vocabulary rows divisible by 16, got weight "
            f"{tuple(weight.shape)}; pad the vocabulary (GPTConfig.vocab_multiple=128)"
        )
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        h, weight = h.to(dtype), weight.to(dtype)
    elif weight.dtype != h.dtype:
        weight = weight.to(h.dtype)
    return _ChunkedLinearCrossEntropy.apply(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), softcap, int(chunk_size), int(ignore_index),
        bool(fp8)
    )
