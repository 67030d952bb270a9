"""Attention dispatch: flash-attn when installed and on CUDA, else PyTorch SDPA, else plain math; and
FlexAttention for long sequences with document and sliding-window masks.

All backends take ``q [B, H, T, D]`` and ``k, v [B, H_kv, T, D]`` (grouped-query attention when
``H_kv < H``) and return ``[B, H, T, D]``. Masks that a backend cannot express (a document mask for
flash-attn) send the call to the next backend, so the result never depends on what is installed beyond
numerical tolerance.

``backend="cudnn"`` is PyTorch SDPA with cuDNN's fused attention kernel first in line (on Hopper GPUs it runs
causal attention faster than SDPA's default FlashAttention-2 kernel); whatever cuDNN does not take falls to
SDPA's other kernels in their usual order, so a CPU computes the same as with ``sdpa``.

``backend="flash4"`` is flash-attn-4 (``flash_attn.cute``, the ``flash-attn-4`` package: CuTe-DSL kernels for
Hopper and Blackwell GPUs, installed by the ``gpu`` extra). It is chosen explicitly, never by ``auto``; on a
GPU it does not run on (before Hopper) or a CPU, and for document masks or a window held in a device tensor,
the call goes to SDPA like ``flash``'s.

``backend="flex"`` (CUDA) builds a block-sparse mask at 128-token granularity from the document ids and the
window, so a 64k-token sequence of many documents costs only the blocks that attend anything; the window
may be a device tensor (a schedule changes it without recompiling). On a CPU, which has no FlexAttention
backward pass, the same mask goes to SDPA as a dense mask.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_opt._optional import is_available

BACKENDS = ("auto", "flash", "flash4", "sdpa", "cudnn", "math", "flex")
FLEX_BLOCK = 128
_DENSE_MASK_LIMIT = 1 << 28  # booleans (256 MiB): beyond this the SDPA/math paths refuse a dense mask


# backend="cudnn": PyTorch SDPA with cuDNN's fused attention first, then PyTorch's own kernels in their usual
# order, so a shape or device that cuDNN does not take (a CPU, a dense mask it refuses) still runs
_CUDNN_FIRST = [
    SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
]

_UNRESOLVED = object()
# flash_attn_func, None (not usable) or _UNRESOLVED. A module global rather than an lru_cache: under
# torch.compile a global is a guarded constant, while a cache wrapper would be traced into (import probes
# are graph breaks).
_FLASH_FN: object = _UNRESOLVED
_FLASH4_FN: object = _UNRESOLVED  # flash-attn-4's flash_attn_func, adapted (see _flash4_func)
_FLASH4_MIN_CAPABILITY = 9  # flash-attn-4 has SM90 (Hopper) and SM100 (Blackwell) kernels


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


def _flash4_func():
    """flash-attn-4's ``flash_attn_func`` behind flash-attn 2's call: a window side of -1 means no limit
    (flash-attn-4 takes None) and only the output is returned (flash-attn-4 also returns the log-sum-exp)."""
    global _FLASH4_FN
    if _FLASH4_FN is _UNRESOLVED:
        _FLASH4_FN = None
        if is_available("flash_attn.cute"):  # False too when flash_attn itself is missing
            try:
                from flash_attn.cute import flash_attn_func as fa4
            except Exception as err:  # a broken install must not break training: say why
                warnings.warn(f"flash-attn-4 is installed but failed to import ({err}).", stacklevel=2)
            else:
                def call(q, k, v, softmax_scale=None, causal=True, window_size=(-1, -1)):
                    left, right = window_size
                    out = fa4(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=(None if left < 0 else left, None if right < 0 else right))
                    return out[0] if isinstance(out, tuple) else out

                _FLASH4_FN = call
    return _FLASH4_FN


def flash4_takes(q: torch.Tensor, window: int | torch.Tensor | None, doc_ids: torch.Tensor | None) -> bool:
    """Whether ``backend="flash4"`` runs this call on flash-attn-4: a CUDA tensor on a Hopper or newer GPU, no
    document mask, a window given as a Python int (or none). Other calls go to SDPA."""
    return (q.is_cuda and doc_ids is None and not isinstance(window, torch.Tensor)
            and torch.cuda.get_device_capability(q.device)[0] >= _FLASH4_MIN_CAPABILITY)


def flash4_available() -> bool:
    """Whether flash-attn-4 (``pip install 'lightning-opt[gpu]'``) imports."""
    return _flash4_func() is not None


def resolve_backend(backend: str = "auto") -> str:
    """Probe optional kernels now (call before ``torch.compile``); returns what ``auto`` uses on CUDA."""
    if backend in ("auto", "flash"):
        return "flash" if flash_available() else "sdpa"
    if backend == "flash4":
        flash4_available()
    return backend


def build_mask(
    t: int,
    device: torch.device,
    window: int | torch.Tensor | None = None,
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


def _check_dense_mask(t: int, doc_ids: torch.Tensor | None, advice: str) -> None:
    if t * t * (1 if doc_ids is None else doc_ids.shape[0]) > _DENSE_MASK_LIMIT:
        raise ValueError(f"a dense {t} x {t} attention mask (a window or documents at sequence length {t}) would "
                         f"take over {_DENSE_MASK_LIMIT >> 20} MiB; {advice}")


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense block mask ``[B, Q, K]`` -> (count per query block, key block indices with the set ones first)."""
    num = mask.sum(dim=-1, dtype=torch.int32)
    idx = mask.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


def doc_window_block_mask(t: int, device: torch.device, window: int | torch.Tensor | None = None,
                          doc_ids: torch.Tensor | None = None):
    """FlexAttention ``BlockMask``: causal, inside a document, at most ``window`` positions back (itself included).

    Built at block level without evaluating the mask per token: a (query block, key block) pair is skipped
    when no position in it may attend, marked full when every position may (no per-token mask there), and
    partial otherwise. ``doc_ids`` ``[B, T]`` must be non-decreasing along T (a running count of separators).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if t % FLEX_BLOCK:
        raise ValueError(f"flex attention needs a sequence length divisible by {FLEX_BLOCK}, got {t}")
    bs = FLEX_BLOCK
    n = t // bs
    blk = torch.arange(n, device=device)
    dist = blk[:, None] - blk[None, :]  # query block - key block
    any_ = dist >= 0
    full = dist > 0
    if window is not None:
        any_ = any_ & ((dist - 1) * bs + 1 < window)  # the closest pair of positions is within the window
        full = full & ((dist + 1) * bs - 1 < window)  # the farthest pair is too
    any_, full = any_[None], full[None]
    if doc_ids is not None:
        lo, hi = doc_ids[:, ::bs], doc_ids[:, bs - 1 :: bs]  # first and last document of each block
        any_ = any_ & (hi[:, None, :] >= lo[:, :, None])  # key block ends in or after the query's first doc
        single = lo == hi
        full = full & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    num, idx = _ordered(any_ & ~full)
    fnum, fidx = _ordered(full)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        return keep

    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=bs, mask_mod=mask_mod)


_FLEX_COMPILED = None


def _flex_attention():
    """FlexAttention compiled once: called eagerly it would materialise the full score matrix."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def flex_doc_window_attention(q, k, v, window=None, doc_ids=None, scale=None):
    """Causal attention within documents and a window, via FlexAttention on CUDA (dense-mask SDPA elsewhere)."""
    gqa = q.shape[1] != k.shape[1]
    if q.shape[2] % FLEX_BLOCK:  # checked on every device, so CPU tests catch what CUDA would refuse
        raise ValueError(f"flex attention needs a sequence length divisible by {FLEX_BLOCK}, got {q.shape[2]}")
    if not q.is_cuda:
        _check_dense_mask(q.shape[2], doc_ids, "FlexAttention has no backward pass on a CPU, where the mask is "
                          "dense: train long sequences on a GPU, or shorten them")
        mask = build_mask(q.shape[2], q.device, window, doc_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    bm = doc_window_block_mask(q.shape[2], q.device, window, doc_ids)
    return _flex_attention()(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)


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
        window: attend to at most this many most recent positions (itself included); a device tensor
            with ``flex`` (or ``sdpa`` / ``math``), so a schedule can change it without recompiling.
        doc_ids: ``[B, T]`` integer document ids; positions attend only inside their document.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: ``auto`` (flash-attn > SDPA), ``flash``, ``flash4`` (flash-attn-4, explicit only), ``sdpa``, ``cudnn`` (SDPA with cuDNN's fused attention
            put first, PyTorch's kernels after it for what cuDNN does not take), ``math`` or ``flex`` (long
            sequences with document / window masks, see :func:`flex_doc_window_attention`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    t = q.shape[2]
    plain = window is None and doc_ids is None
    if backend == "flex":
        if not causal:
            raise ValueError("attention backend 'flex' here is causal only")
        return flex_doc_window_attention(q, k, v, window, doc_ids, scale)
    if backend == "flash4":
        fn = _FLASH4_FN if _FLASH4_FN is not _UNRESOLVED else _flash4_func()
        if fn is None:
            raise ImportError(
                "attention backend 'flash4' needs flash-attn-4: pip install 'lightning-opt[gpu]' "
                "(or use backend='sdpa')"
            )
        if flash4_takes(q, window, doc_ids):
            win = (-1, -1) if window is None else (window - 1, 0)
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     softmax_scale=scale, causal=causal, window_size=win)
            return out.transpose(1, 2)
        backend = "sdpa"  # what flash-attn-4 does not take: a CPU, an older GPU, document masks, a tensor window
    if isinstance(window, torch.Tensor) and backend in ("auto", "flash"):
        backend = "sdpa"  # flash-attn takes the window as a Python int

    use_flash = backend == "flash" or (
        backend == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and doc_ids is None
    )
    if use_flash:
        fn = _FLASH_FN if _FLASH_FN is not _UNRESOLVED else _flash_attn_func()
        if fn is None and backend == "flash":
            raise ImportError(
                "attention backend 'flash' needs flash-attn 2, a source build (pip install flash-attn "
                "--no-build-isolation); or use backend='flash4' after pip install 'lightning-opt[gpu]', or "
                "'auto' to fall back to PyTorch SDPA"
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
    mask = None
    if not plain:
        _check_dense_mask(t, doc_ids, "use attn_backend='flex' for long sequences with masks")
        mask = build_mask(t, q.device, window, doc_ids)
    if backend == "cudnn":
        with sdpa_kernel(_CUDNN_FIRST, set_priority=True):
            return _sdpa(q, k, v, mask, causal, scale, gqa)
    return _sdpa(q, k, v, mask, causal, scale, gqa)


def _sdpa(q, k, v, mask, causal, scale, gqa):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
