"""Triton kernels behind BatchTopK: the entries ``x >= lo`` in flat order, in two passes over ``x``.

Pass 1 (:func:`count_ge`): each program of ``block`` entries counts those at or above its row's bound (a read at
memory speed). The exclusive prefix sum of the block counts gives each block its first output slot. Pass 2: each
program numbers its hits with a block-local scan and writes ``(flat index, value)`` straight to its slots. No
atomics, no sort: the result is ``nonzero(x >= lo)`` and ``x[...]`` of it, and does not depend on scheduling.
One host sync, between the passes (the total sizes the buffers). Replaces an earlier single pass that reserved
room with one ``atomic_add`` per block and then sorted the hits (docs/clt.md has both candidate phases' timings).

:func:`compact_ge` is that candidate step. :func:`select_16bit` is the whole BatchTopK selection for bf16/fp16
scores: the same two passes, then a sort of only the candidates' 16-bit order keys gives each row's exact
cut-off, and a running count keeps the entries above it and the first ties. The output is ascending, ``n_keep``
per row, like the torch path.

Import is lazy and optional: :func:`available` says whether the kernels can run for a tensor (CUDA, or any
device under ``TRITON_INTERPRET=1``); callers fall back to torch otherwise.
"""

from __future__ import annotations

import torch

from lightning_opt._optional import triton_runs_on

try:  # optional dependency (the "triton" extra / the CUDA wheels of torch)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["available", "check_launch", "count_ge", "compact_counted", "compact_ge", "select_16bit"]

# default launch shape of both passes, entries per program x warps (the ``block`` / ``num_warps`` arguments; an
# H200 sweep of the whole selection, benchmarks/clt_step.py's select_sweep: 2048 x 4 fastest)
BLOCK = 2048
NUM_WARPS = 4
_BINS = 1 << 16


def available(x: torch.Tensor) -> bool:
    """Whether :func:`compact_ge` can run on ``x``'s device."""
    return triton is not None and triton_runs_on(x)


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
    def _count_ge_kernel(x_ptr, lo_ptr, cnt_ptr, n, row_len, BLOCK: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        # pass 1: per block, the count of entries at or above their row's bound (a read at memory speed)
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb  # NaN: never
        tl.store(cnt_ptr + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))

    @triton.jit
    def _compact_ordered_kernel(x_ptr, lo_ptr, pre_ptr, idx_ptr, val_ptr, n, row_len, cap, BLOCK: tl.constexpr,
                                BLOCK_IN_ONE_ROW: tl.constexpr, CAPPED: tl.constexpr):
        # pass 2: every entry at or above its bound to its slot in flat order (the block's exclusive prefix from
        # pass 1 plus a block-local scan; no atomics, no sort): its flat index and value. (int64 slots: an int32
        # scan-and-add here was slower in a probe on an H200.)
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb
        h = hit.to(tl.int32)
        dst = tl.load(pre_ptr + tl.program_id(0)) + (tl.cumsum(h, axis=0) - h).to(tl.int64)
        if CAPPED:  # buffers of ``cap`` slots sized before the count was known: drop what does not fit
            hit = hit & (dst < cap)
        tl.store(idx_ptr + dst, offs, mask=hit)
        tl.store(val_ptr + dst, x, mask=hit)


def _exclusive_cumsum(c: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(c.numel(), dtype=torch.int64, device=c.device)
    out[1:] = torch.cumsum(c[:-1], 0)
    return out


def check_launch(block: int, num_warps: int) -> None:
    """Raise ``ValueError`` unless ``block`` (entries per program) and ``num_warps`` are powers of two (Triton's
    ``tl.arange`` and warp counts need them)."""
    for name, v in (("block", block), ("num_warps", num_warps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power-of-two int, got {v!r}")


def _launch(flat: torch.Tensor, row_len: int, rows: int, block: int, num_warps: int
            ) -> tuple[tuple[int], dict[str, object]]:
    check_launch(block, num_warps)
    one_row = rows == 1 or row_len % block == 0
    return (triton.cdiv(flat.numel(), block),), {"BLOCK": block, "BLOCK_IN_ONE_ROW": one_row, "num_warps": num_warps}


def count_ge(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int, *, block: int = BLOCK,
             num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: per launch block of ``block`` entries (``num_warps`` warps a program), how many entries of
    ``flat`` reach their row's bound. Returns ``(pre, total)``: the blocks' exclusive prefix sums (int64) and the
    total as a one-element device tensor. No host sync."""
    if triton is None:
        raise ImportError("count_ge needs triton (pip install triton, or use the torch path)")
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    grid, meta = _launch(flat, row_len, lo_rows.numel(), block, num_warps)
    cnt = torch.empty(grid[0], dtype=torch.int32, device=flat.device)
    if flat.numel() > 0:
        _count_ge_kernel[grid](flat, lo_rows, cnt, flat.numel(), row_len, **meta)
    pre = _exclusive_cumsum(cnt)
    return pre, (pre[-1:] + cnt[-1:]) if cnt.numel() else pre.new_zeros(1)


def compact_counted(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int, pre: torch.Tensor,
                    total: int, capped: bool = False, *, block: int = BLOCK,
                    num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: the ``total`` entries of ``flat`` at or above their row's bound, ascending flat indices (int64)
    and values, given :func:`count_ge`'s prefix sums for the same ``flat``, bounds, row length and ``block``
    (the prefix sums are per block: pass the ``block`` that pass 1 ran with).

    ``capped=True``: ``total`` is a capacity chosen before the count was known (no host sync); the first
    ``min(count, total)`` slots are filled, the rest hold garbage (the caller masks them by the count)."""
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    grid, meta = _launch(flat, row_len, lo_rows.numel(), block, num_warps)
    if pre.numel() != grid[0]:
        raise ValueError(f"pre holds {pre.numel()} block prefix sums, block={block} needs {grid[0]}: pass "
                         "count_ge's block")
    idx = torch.empty(total, dtype=torch.int64, device=flat.device)
    val = torch.empty(total, dtype=flat.dtype, device=flat.device)
    if total > 0:
        _compact_ordered_kernel[grid](flat, lo_rows, pre, idx, val, flat.numel(), row_len, total, CAPPED=capped,
                                      **meta)
    return idx, val


def compact_ge(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int, *, block: int = BLOCK,
               num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat indices and values of the entries of ``flat`` with ``flat[i] >= lo_rows[i // row_len]``.

    Args:
        flat: contiguous 1-D scores (any float dtype).
        lo_rows: per-row bounds (one per ``row_len`` entries).
        row_len: entries per row.
        block: entries per program of both passes (a power of two; the result does not depend on it).
        num_warps: warps per program (a power of two).

    Returns:
        ``(indices int64, values)``, like ``nonzero(flat >= lo)`` and ``flat[indices]``. One host sync (the
        hit count sizes the result).
    """
    flat = flat.contiguous()
    launch = {"block": block, "num_warps": num_warps}
    pre, total = count_ge(flat, lo_rows, row_len, **launch)
    return compact_counted(flat, lo_rows, row_len, pre, int(total.item()), **launch)  # host sync: the count


def select_16bit(x2d: torch.Tensor, n_keep: int, lo_rows: torch.Tensor, *, block: int = BLOCK,
                 num_warps: int = NUM_WARPS) -> torch.Tensor | None:
    """Sorted flat indices of the ``n_keep`` largest entries of every row of a bf16/fp16 ``x2d`` (ties: the
    smallest flat indices), given per-row bounds ``lo_rows`` that at least ``n_keep`` entries per row reach.

    Two passes over ``x``: (1) per block, the count of entries at or above the bound; (2) those entries (the
    candidates), in flat order, to slots given by the block prefix sums, with their values. Then, on the
    candidates only: a sort of their row-major 16-bit order keys gives each row's exact cut-off (the
    ``n_keep``-th largest key), and the row keeps the entries above it and the first ``n_keep - above`` equal to
    it (a running count).

    ``block`` (entries per program) and ``num_warps`` are both passes' launch shape: powers of two; the result
    does not depend on them.

    Returns:
        ``None`` when some row has fewer than ``n_keep`` entries at or above its bound (the caller falls back).
        One host sync, between the passes: the candidate count (it sizes the buffers) and the per-row counts (the
        check). Rows that split a launch block (row length not a multiple of ``block``) are checked at the
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
    check_launch(block, num_warps)
    launch = {"block": block, "num_warps": num_warps}
    one_row = rows == 1 or m % block == 0
    pre, total = count_ge(flat, lo_rows, m, **launch)
    counts = [total]
    if one_row and rows > 1:  # blocks lie inside rows: per-row counts from the block counts
        block_counts = torch.diff(pre, append=total)
        counts.append(block_counts.view(rows, -1).sum(1))
    counts = torch.cat(counts).tolist()  # host sync: the total sizes the buffers, the rest is the check
    n_cand, per_row = counts[0], counts[1:]
    if n_cand < rows * n_keep or (per_row and min(per_row) < n_keep):
        return None
    idx, val = compact_counted(flat, lo_rows, m, pre, n_cand, **launch)
    out, short = _keep_candidates(idx, val, rows, m, n_keep)
    if not one_row and bool(short):  # second host sync: rows that split blocks were not checked above
        return None
    return out


def _keep_candidates(idx: torch.Tensor, val: torch.Tensor, rows: int, m: int, n_keep: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the candidates (flat order): the kept flat indices (``rows * n_keep``, ascending) and whether some
    row has fewer than ``n_keep`` candidates (then the indices are meaningless). No host sync.

    Each candidate gets the key ``row * 2**16 + 16-bit order key``; one sort of the keys gives each row's range
    and its ``n_keep``-th largest key (the cut-off); the row keeps the keys above it and, in flat order, the
    first ``n_keep - above`` equal to it."""
    dev = val.device
    from lightning_opt.ops.topk import _order_keys16

    key = _order_keys16(val)
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
