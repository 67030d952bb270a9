"""Triton kernel behind the BatchTopK candidate step: ``x >= lo`` plus compaction in one pass over ``x``.

Each program compares ``BLOCK`` entries with their row's bound, numbers its hits with a block-local prefix
sum, reserves room for them with one ``atomic_add`` on a global counter and writes ``(flat index, value)``
pairs into preallocated buffers. Blocks reserve in arbitrary order, so the caller sorts the (few) hits by
index afterwards; the result is then identical to ``nonzero(x >= lo)`` and does not depend on scheduling.

:func:`select_16bit` is the whole BatchTopK selection for bf16/fp16 scores in three passes over ``x`` and no
sort: a per-row histogram of the 16-bit order keys of the entries at or above a lower bound (global atomics, only
for those few entries), then the exact cut-off per row from it (torch, on 2**16 bins), then per block the counts
of entries above and equal to the cut-off, and last one pass that writes every kept index to its final slot
(block prefix sums give each entry its rank). The output is ascending, ``n_keep`` per row, like the torch path.

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

__all__ = ["available", "compact_ge", "select_16bit"]

# module-level so benchmarks/clt_step.py can sweep them (H200 sweep of compact_ge: 2048 x 4 was fastest)
BLOCK = 2048
NUM_WARPS = 4
SELECT_BLOCK = 2048
SELECT_WARPS = 4
_BINS = 1 << 16


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


if triton is not None:

    @triton.jit
    def _block(x_ptr, n, row_len, BLOCK: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        # this program's offsets (int64), in-bounds mask, row (one scalar if the block lies in one row, else
        # per entry) and entries
        start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: x may exceed 2**31 entries
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        if BLOCK_IN_ONE_ROW:  # no 64-bit division per entry
            row = start // row_len
        else:
            row = offs // row_len
        return offs, inb, row, tl.load(x_ptr + offs, mask=inb, other=0.0)

    @triton.jit
    def _per_row(ptr, row, inb, BLOCK_IN_ONE_ROW: tl.constexpr):
        # a per-row value: one scalar load for a block inside one row, else a gather per entry
        # one return at the end: Triton's compiler rejects an early return (its interpreter does not)
        if BLOCK_IN_ONE_ROW:
            v = tl.load(ptr + row)
        else:
            v = tl.load(ptr + row, mask=inb, other=0)
        return v

    @triton.jit
    def _key16(x):
        # order key of a 16-bit float: positives above negatives, negatives reflected, -0 -> +0's key
        b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        key = tl.where(b >= 0x8000, 0xFFFF - b, b + 0x8000)
        return tl.where(b == 0x8000, 0x8000, key)

    @triton.jit
    def _hist_ge_kernel(x_ptr, lo_ptr, hist_ptr, n, row_len, BLOCK: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb  # NaN: never
        ones = tl.full([BLOCK], 1, tl.int32)
        tl.atomic_add(hist_ptr + row * 65536 + _key16(x), ones, mask=hit, sem="relaxed")

    @triton.jit
    def _count_cut_kernel(x_ptr, cut_ptr, gt_ptr, eq_ptr, n, row_len, BLOCK: tl.constexpr,
                          BLOCK_IN_ONE_ROW: tl.constexpr):
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        x = x.to(tl.float32)
        cut = _per_row(cut_ptr, row, inb, BLOCK_IN_ONE_ROW).to(tl.float32)
        pid = tl.program_id(0)
        tl.store(gt_ptr + pid, tl.sum(((x > cut) & inb).to(tl.int32), axis=0))
        tl.store(eq_ptr + pid, tl.sum(((x == cut) & inb).to(tl.int32), axis=0))

    @triton.jit
    def _write_kept_kernel(x_ptr, cut_ptr, gt_pre_ptr, eq_pre_ptr, gt_row0_ptr, eq_row0_ptr, quota_ptr, out_ptr,
                           n, row_len, n_keep, BLOCK: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        x = x.to(tl.float32)
        cut = _per_row(cut_ptr, row, inb, BLOCK_IN_ONE_ROW).to(tl.float32)
        pid = tl.program_id(0)
        gt = (x > cut) & inb
        eq = (x == cut) & inb
        gt32 = gt.to(tl.int32)
        eq32 = eq.to(tl.int32)
        # entries of the same row before this one that are above / equal to the cut-off (int32 block-local
        # exclusive scans, int64 block and row offsets)
        gt_before = ((tl.cumsum(gt32, axis=0) - gt32).to(tl.int64) + tl.load(gt_pre_ptr + pid)
                     - _per_row(gt_row0_ptr, row, inb, BLOCK_IN_ONE_ROW))
        eq_rank = ((tl.cumsum(eq32, axis=0) - eq32).to(tl.int64) + tl.load(eq_pre_ptr + pid)
                   - _per_row(eq_row0_ptr, row, inb, BLOCK_IN_ONE_ROW))
        quota = _per_row(quota_ptr, row, inb, BLOCK_IN_ONE_ROW)
        keep = gt | (eq & (eq_rank < quota))
        # kept entries of the row before this one: all above, and the first `quota` ties (flat-index order)
        dst = row * n_keep + gt_before + tl.minimum(eq_rank, quota)
        tl.store(out_ptr + dst, offs, mask=keep)


def _exclusive_cumsum(c: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(c.numel(), dtype=torch.int64, device=c.device)
    out[1:] = torch.cumsum(c[:-1], 0)
    return out


def select_16bit(x2d: torch.Tensor, n_keep: int, lo_rows: torch.Tensor) -> torch.Tensor | None:
    """Sorted flat indices of the ``n_keep`` largest entries of every row of a bf16/fp16 ``x2d`` (ties: the
    smallest flat indices), given per-row bounds ``lo_rows`` that at least ``n_keep`` entries per row reach.

    Returns ``None`` when some row has fewer than ``n_keep`` entries at or above its bound (the caller falls
    back). One host sync: that check (a single flag).
    """
    if triton is None:
        raise ImportError("select_16bit needs triton (pip install triton, or use the torch path)")
    if x2d.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"select_16bit handles bf16/fp16 scores, got {x2d.dtype}")
    rows, m = x2d.shape
    flat = x2d.contiguous().view(-1)
    n = flat.numel()
    dev = flat.device
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    one_row = rows == 1 or m % SELECT_BLOCK == 0
    grid = (triton.cdiv(n, SELECT_BLOCK),)
    meta = {"BLOCK": SELECT_BLOCK, "BLOCK_IN_ONE_ROW": one_row, "num_warps": SELECT_WARPS}
    hist = torch.zeros(rows * _BINS, dtype=torch.int32, device=dev)
    _hist_ge_kernel[grid](flat, lo_rows, hist, n, m, **meta)
    at_or_above = hist.view(rows, _BINS).flip(1).cumsum(1, dtype=torch.int64).flip(1)  # entries with key >= b
    if bool((at_or_above[:, 0] < n_keep).any()):  # host sync: a short row needs the caller's fallback
        return None
    t = (at_or_above >= n_keep).sum(1) - 1  # per row: the largest key with >= n_keep entries at or above
    padded = torch.cat([at_or_above, at_or_above.new_zeros(rows, 1)], dim=1)
    above = padded.gather(1, (t + 1)[:, None]).squeeze(1)
    ties = padded.gather(1, t[:, None]).squeeze(1) - above
    # the cut-off key back to its 16-bit value (the inverse of _key16)
    bits = torch.where(t >= 0x8000, t - 0x8000, 0xFFFF - t)
    cut = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(flat.dtype).contiguous()
    n_blocks = grid[0]
    gt_cnt = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    eq_cnt = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    _count_cut_kernel[grid](flat, cut, gt_cnt, eq_cnt, n, m, **meta)
    out = torch.empty(rows * n_keep, dtype=torch.int64, device=dev)
    _write_kept_kernel[grid](flat, cut, _exclusive_cumsum(gt_cnt), _exclusive_cumsum(eq_cnt), _exclusive_cumsum(above),
                             _exclusive_cumsum(ties), (n_keep - above).contiguous(), out, n, m, n_keep, **meta)
    return out
