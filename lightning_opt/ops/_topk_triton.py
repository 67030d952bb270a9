"""Triton kernel behind the BatchTopK candidate step: ``x >= lo`` plus compaction in one pass over ``x``.

Each program compares ``BLOCK`` entries with their row's bound, numbers its hits with a block-local prefix
sum, reserves room for them with one ``atomic_add`` on a global counter and writes ``(flat index, value)``
pairs into preallocated buffers. Blocks reserve in arbitrary order, so the caller sorts the (few) hits by
index afterwards; the result is then identical to ``nonzero(x >= lo)`` and does not depend on scheduling.

Import is lazy and optional: :func:`available` says whether the kernel can run for a tensor (CUDA, or any
device under ``TRITON_INTERPRET=1``); callers fall back to torch otherwise.
"""

from __future__ import annotations

import os

import torch

try:  # optional dependency (the "triton" extra / the CUDA wheels of torch)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["available", "compact_ge"]

BLOCK = 4096
NUM_WARPS = 8  # module-level so benchmarks/clt_step.py can sweep BLOCK and NUM_WARPS


def available(x: torch.Tensor) -> bool:
    """Whether :func:`compact_ge` can run on ``x``'s device."""
    if triton is None:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _compact_ge_kernel(x_ptr, lo_ptr, idx_ptr, val_ptr, counter_ptr, n, row_len, cap, BLOCK: tl.constexpr,
                           BLOCK_IN_ONE_ROW: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK  # int64: x may exceed 2**31 entries
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        x = tl.load(x_ptr + offs, mask=inb, other=0.0)
        if BLOCK_IN_ONE_ROW:
            lo = tl.load(lo_ptr + start // row_len)  # one scalar load: no 64-bit division per entry
        else:
            lo = tl.load(lo_ptr + offs // row_len, mask=inb, other=0.0)
        # compare in float32 (exact for bf16/fp16 inputs); NaN compares False: never a candidate
        keep = (x.to(tl.float32) >= lo.to(tl.float32)) & inb
        hit = keep.to(tl.int32)
        pos = tl.cumsum(hit, axis=0) - hit  # exclusive prefix sum inside the block
        base = tl.atomic_add(counter_ptr, tl.sum(hit, axis=0).to(tl.int64))  # one atomic per block
        dst = base + pos
        ok = keep & (dst < cap)  # the counter still counts overflowing hits; the caller retries
        tl.store(idx_ptr + dst, offs, mask=ok)
        tl.store(val_ptr + dst, x, mask=ok)


def compact_ge(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat indices and values of the entries of ``flat`` with ``flat[i] >= lo_rows[i // row_len]``.

    Args:
        flat: contiguous 1-D scores.
        lo_rows: per-row bounds in ``flat``'s dtype (one per ``row_len`` entries).
        row_len: entries per row.
        capacity: expected upper bound on the hit count (buffers are sized by it; too small costs a rerun).

    Returns:
        ``(indices int64, values)``, like ``nonzero(flat >= lo)`` and ``flat[indices]``. One host sync (the
        hit count sizes the result).
    """
    if triton is None:
        raise ImportError("compact_ge needs triton (pip install triton, or use the torch path)")
    flat = flat.contiguous()
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    n = flat.numel()
    capacity = max(1, min(int(capacity), n))
    counter = torch.zeros(1, dtype=torch.int64, device=flat.device)
    idx = torch.empty(capacity, dtype=torch.int64, device=flat.device)
    val = torch.empty(capacity, dtype=flat.dtype, device=flat.device)
    if n > 0:
        one_row = lo_rows.numel() == 1 or row_len % BLOCK == 0
        _compact_ge_kernel[(triton.cdiv(n, BLOCK),)](flat, lo_rows, idx, val, counter, n, row_len, capacity,
                                                     BLOCK=BLOCK, BLOCK_IN_ONE_ROW=one_row, num_warps=NUM_WARPS)
    count = int(counter.item())  # host sync: the hit count sizes every buffer after this
    if count > capacity:
        return compact_ge(flat, lo_rows, row_len, count)
    keys = idx[:count]
    if n <= torch.iinfo(torch.int32).max:
        keys = keys.to(torch.int32)  # half the radix-sort passes of int64 keys
    keys, order = torch.sort(keys)  # blocks reserved in arbitrary order; restore flat order
    return keys.long(), val[:count][order]
