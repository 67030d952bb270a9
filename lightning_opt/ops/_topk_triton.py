"""Triton kernel behind the BatchTopK candidate step: ``x >= lo`` plus compaction in one pass over ``x``.

Each program compares ``BLOCK`` entries with their row's bound, numbers its hits with a block-local prefix
sum, reserves room for them with one ``atomic_add`` on a global counter and writes ``(flat index, value)``
pairs into preallocated buffers. Blocks reserve in arbitrary order, so the caller sorts the (few) hits by
index afterwards; the result is then identical to ``nonzero(x >= lo)`` and does not depend on scheduling.

:func:`select_16bit` is the whole BatchTopK selection for bf16/fp16 scores in two passes over ``x``: per-block counts of the entries at or above a lower bound, then those entries (the candidates)
in flat order to slots given by the block prefix sums; a sort of the few candidates' 16-bit order keys gives each row's exact cut-off, and a running count keeps the entries above it and the first ties. The
output is ascending, ``n_keep`` per row, like the torch path.

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
    def _count_ge_kernel(x_ptr, lo_ptr, cnt_ptr, n, row_len, BLOCK: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        # pass 1: per block, the count of entries at or above their row's bound (a read at memory speed)
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb  # NaN: never
        tl.store(cnt_ptr + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))

    @triton.jit
    def _compact_ordered_kernel(x_ptr, lo_ptr, pre_ptr, idx_ptr, val_ptr, n, row_len, BLOCK: tl.constexpr,
                                BLOCK_IN_ONE_ROW: tl.constexpr):
        # pass 2: every entry at or above its bound to its slot in flat order (the block's exclusive prefix from
        # pass 1 plus a block-local scan; no atomics, no sort): its flat index and value. (int64 slots: on an H200
        # an int32 scan-and-add here ran at half the speed.)
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb
        h = hit.to(tl.int32)
        dst = tl.load(pre_ptr + tl.program_id(0)) + (tl.cumsum(h, axis=0) - h).to(tl.int64)
        tl.store(idx_ptr + dst, offs, mask=hit)
        tl.store(val_ptr + dst, x, mask=hit)


def _exclusive_cumsum(c: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(c.numel(), dtype=torch.int64, device=c.device)
    out[1:] = torch.cumsum(c[:-1], 0)
    return out


def select_16bit(x2d: torch.Tensor, n_keep: int, lo_rows: torch.Tensor) -> torch.Tensor | None:
    """Sorted flat indices of the ``n_keep`` largest entries of every row of a bf16/fp16 ``x2d`` (ties: the
    smallest flat indices), given per-row bounds ``lo_rows`` that at least ``n_keep`` entries per row reach.

    Two passes over ``x``: (1) per block, the count of entries at or above the bound; (2) those entries (the
    candidates), in flat order, to slots given by the block prefix sums, with their values. Then, on the
    candidates only: a sort of their row-major 16-bit order keys gives each row's exact cut-off (the
    ``n_keep``-th largest key), and the row keeps the entries above it and the first ``n_keep - above`` equal to
    it (a running count).

    Returns:
        ``None`` when some row has fewer than ``n_keep`` entries at or above its bound (the caller falls back).
        One host sync, between the passes: the candidate count (it sizes the buffers) and the per-row counts (the
        check). Rows that split a launch block (row length not a multiple of ``SELECT_BLOCK``) are checked at the
        end instead: a second sync.
    """
    if triton is None:
        raise ImportError("select_16bit needs triton (pip install triton, or use the torch path)")
    if x2d.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"select_16bit handles bf16/fp16 scores, got {x2d.dtype}")
    rows, m = x2d.shape
    if rows > 1 << 15:
        raise ValueError(f"select_16bit handles at most {1 << 15} rows, got {rows}")
    flat = x2d.contiguous().view(-1)
    n = flat.numel()
    dev = flat.device
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    one_row = rows == 1 or m % SELECT_BLOCK == 0
    grid = (triton.cdiv(n, SELECT_BLOCK),)
    meta = {"BLOCK": SELECT_BLOCK, "BLOCK_IN_ONE_ROW": one_row, "num_warps": SELECT_WARPS}
    cnt = torch.empty(grid[0], dtype=torch.int32, device=dev)
    _count_ge_kernel[grid](flat, lo_rows, cnt, n, m, **meta)
    pre = _exclusive_cumsum(cnt)
    counts = [pre[-1:] + cnt[-1:]]
    if one_row and rows > 1:
        counts.append(cnt.view(rows, -1).sum(1))  # blocks lie inside rows: per-row counts from block counts
    counts = torch.cat(counts).tolist()  # host sync: the total sizes the buffers, the rest is the check
    total, per_row = counts[0], counts[1:] if rows > 1 else counts
    if total < rows * n_keep or (per_row and min(per_row) < n_keep):
        return None
    idx = torch.empty(total, dtype=torch.int64, device=dev)
    val = torch.empty(total, dtype=flat.dtype, device=dev)
    _compact_ordered_kernel[grid](flat, lo_rows, pre, idx, val, n, m, **meta)
    out, short = _keep_candidates(idx, val, rows, m, n_keep)
    if not one_row and bool(short):  # second host sync: rows that split blocks were not checked above
        return None
    return out


def _key16_torch(v: torch.Tensor) -> torch.Tensor:
    # int32 order key of 16-bit floats, like _key16 in the kernels (-0 gets +0's key)
    b = v.view(torch.int16).to(torch.int32) & 0xFFFF
    key = torch.where(b >= 0x8000, 0xFFFF - b, b + 0x8000)
    return torch.where(b == 0x8000, 0x8000, key)


def _keep_candidates(idx: torch.Tensor, val: torch.Tensor, rows: int, m: int, n_keep: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the candidates (flat order): the kept flat indices (``rows * n_keep``, ascending) and whether some
    row has fewer than ``n_keep`` candidates (then the indices are meaningless). No host sync.

    Each candidate gets the key ``row * 2**16 + 16-bit order key``; one sort of the keys gives each row's range
    and its ``n_keep``-th largest key (the cut-off); the row keeps the keys above it and, in flat order, the
    first ``n_keep - above`` equal to it."""
    dev = val.device
    key = _key16_torch(val)
    if rows > 1:
        row = torch.div(idx, m, rounding_mode="floor").to(torch.int32)
        key = key + (row << 16)
    sorted_keys = torch.sort(key).values
    base = torch.arange(rows + 1, device=dev, dtype=torch.int32) * _BINS
    bounds = torch.searchsorted(sorted_keys, base)  # [rows + 1]: where each row's keys start (and the end)
    start, end = bounds[:-1], bounds[1:]
    short = (end - start < n_keep).any()
    cut = sorted_keys[(end - n_keep).clamp(min=0)]  # the n_keep-th largest key of each row (row * 2**16 + key)
    above_from = torch.searchsorted(sorted_keys, cut, right=True)
    quota = n_keep - (end - above_from)  # ties kept: n_keep minus the keys above the cut-off
    if rows > 1:
        ties = above_from - torch.searchsorted(sorted_keys, cut)
        ties_before = (torch.cumsum(ties, 0) - ties)[row.long()]
        cut, quota = cut[row.long()], quota[row.long()]
    else:
        ties_before = 0
    eq = key == cut
    rank = torch.cumsum(eq, 0) - ties_before  # 1-based rank of a tie inside its row, in flat order
    keep = (key > cut) | (eq & (rank <= quota))
    total_out = rows * n_keep
    # every row keeps exactly n_keep and rows come in order: the running count is the output slot (clamped: a
    # short row's cut-off is meaningless and may keep too many; the caller discards that result)
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, total_out).clamp_(max=total_out)
    out = torch.empty(total_out + 1, dtype=torch.int64, device=dev)
    return out.scatter_(0, slot, idx)[:total_out], short
