"""Attention dispatch: flash-attn when installed and on CUDA, else PyTorch SDPA, else plain math.

All backends take ``q [B, H, T, D]`` and ``k, v [B, H_kv, T, D]`` (grouped-query attention when
``H_kv < H``) and return ``[B, H, T, D]``. Masks that a backend cannot express (a document mask for
flash-attn) send the call to the next backend, so the result never depends on what is installed beyond
numerical tolerance.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from lightning_opt._optional import is_available

BACKENDS = ("auto", "flash", "sdpa", "math")


_UNRESOLVED = object()
# flash_attn_func, None (not usable) or _UNRESOLVED. A module global rather than an lru_cache: under
# torch.compile a global is a guarded constant, while a cache wrapper would be traced into (import probes
# are graph breaks).
_FLASH_FN: object = _UNRESOLVED


def _flash_attn_func():
    global _FLASH_FN
    if _FLASH_FN is _UNRESOLVED:
        _FLASH_FN = None
        if is_available("flash_attn"):
            try:
                from flash_attn import flash_attn_func

                _FLASH_FN = flash_attn_func
            except Exception as err:  # a broken build must not break training: fall back and say why
                warnings.warn(
                    f"flash_attn is installed but failed to import ({err}); using PyTorch SDPA.", stacklevel=2
                )
    return _FLASH_FN


def flash_available() -> bool:
    return _flash_attn_func() is not None


def resolve_backend(backend: str = "auto") -> str:
    """Probe optional kernels now (call before ``torch.compile``); returns what ``auto`` uses on CUDA."""
    if backend in ("auto", "flash"):
        return "flash" if flash_available() else "sdpa"
    return backend


def build_mask(
    t: int,
    device: torch.device,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask (True = attend), ``[T, T]`` or ``[B, 1, T, T]`` with document ids ``[B, T]``."""
    pos = torch.arange(t, device=device)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < window)
    if doc_ids is not None:
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = mask[None] & same_doc
        mask = mask[:, None]
    return mask


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Reference attention in the inputs' dtype, with the softmax in float32."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    att = (q @ k.transpose(-2, -1)).float() * scale
    att = att.masked_fill(~mask, float("-inf"))
    return (att.softmax(-1).to(v.dtype)) @ v


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal self-attention with optional sliding window and document masking.

    Args:
        q: ``[B, H, T, D]``.
        k: ``[B, H_kv, T, D]``; ``H`` must be a multiple of ``H_kv``.
        v: like ``k``.
        causal: only causal attention is supported by the models here; ``False`` means full attention.
        window: attend to at most this many most recent positions (itself included).
        doc_ids: ``[B, T]`` integer document ids; positions attend only inside their document.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: ``auto`` (flash-attn > SDPA), ``flash``, ``sdpa`` or ``math``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    t = q.shape[2]
    plain = window is None and doc_ids is None

    use_flash = backend == "flash" or (
        backend == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and doc_ids is None
    )
    if use_flash:
        fn = _FLASH_FN if _FLASH_FN is not _UNRESOLVED else _flash_attn_func()
        if fn is None and backend == "flash":
            raise ImportError(
                "attention backend 'flash' needs flash-attn: pip install 'lightning-opt[gpu]' "
                "(or use backend='auto' to fall back to PyTorch SDPA)"
            )
        if fn is not None and doc_ids is None and q.is_cuda:
            win = (-1, -1) if window is None else (window - 1, 0)
            out = fn(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                softmax_scale=scale, causal=causal, window_size=win,
            )
            return out.transpose(1, 2)

    if backend == "math":
        mask = build_mask(t, q.device, window, doc_ids) if causal else torch.ones(t, t, dtype=torch.bool, device=q.device)
        return math_attention(q, k, v, mask, scale)

    gqa = q.shape[1] != k.shape[1]
    if plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    mask = build_mask(t, q.device, window, doc_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
