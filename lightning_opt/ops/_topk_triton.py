"""Triton kernels behind BatchTopK for bf16/fp16 scores, and the gather-dot of the CLT's dense decode backward.

One-pass selection (:func:`select_16bit_1pass`, what ``ops.topk.batch_topk_rows`` runs on CUDA), no host sync:

1. Stash pass (:func:`_stash_kernel`, the one read of ``x``): each program of ``block`` entries counts the entries
   at or above its row's bound (``lo``, from a sample) and writes the first ``cap`` of them, in flat order, to
   its own slots as ``(offset in the block << 16) | raw 16 bits`` (one int32). No atomics.
2. Compaction (:func:`_compact_stash_kernel`): the inclusive prefix sum of the block counts gives every block
   its first candidate slot; each block's hits go there in flat order, as int64 flat indices and int32 sort keys
   ``row << 16 | order key``, into buffers of a capacity fixed from the sample (``-1`` keys past the count). A
   block with more than ``cap`` hits (rare) is read again from ``x`` instead of its slots.
3. Cut-off and keep (torch, fixed shapes): one sort of the keys gives each row's ``n_keep``-th largest key;
   a row keeps the keys above it and, in flat order, the first ``n_keep - above`` equal to it (running
   counts give the output slots).
4. Exact fallback, on the device: when some row has fewer than ``n_keep`` candidates or the candidates do not
   fit their buffer (an unlucky sample, NaN rows, masses of ties at the bound), a flag computed on the device
   turns on five more kernels that otherwise return at once: two 256-bin histogram passes over ``x`` (high, then
   low byte of the order keys) give each row's exact cut-off, a counting pass and a one-program scan give every
   tile its output offset and tie rank, and a writing pass overwrites the output. Same result, same tie rule,
   about four more reads of ``x``; no host sync either way.

The output is ascending, ``n_keep`` per row, ties kept by smallest flat index; NaN is never kept while a row
has ``n_keep`` other entries (the fallback ranks NaN below ``-inf`` instead of raising, as the synced paths do).

Two-pass selection (:func:`select_16bit`, ``select_backend="triton_2pass"``): pass 1 (:func:`count_ge`) counts
the hits per block; the exclusive prefix sum gives each block its first output slot; pass 2 writes
``(flat index, value)`` there with a block-local scan. One host sync between the passes (the total sizes the
buffers, and the per-row counts are checked); then the same cut-off and keep step. :func:`compact_ge` is its
candidate step, also used by ``ops.topk.candidates_ge`` and ``ops.global_topk``.

:func:`grad_kept` is the activation gradient of the CLT's dense decode at the kept entries, every source layer
in one launch (no host-side layer bounds).

Import is lazy and optional: :func:`available` says whether the kernels can run for a tensor (CUDA, or any
device under ``TRITON_INTERPRET=1``); callers fall back to torch otherwise.
"""

from __future__ import annotations

import math

import torch

from lightning_opt._optional import triton_runs_on
from lightning_opt.ops._keys import order_keys16

try:  # optional dependency (the "triton" extra / the CUDA wheels of torch)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = ["available", "check_launch", "count_ge", "compact_counted", "compact_ge", "select_16bit",
           "select_16bit_1pass", "stash_pass", "compact_stash", "stash_capacity", "candidate_capacity", "grad_kept"]

# default launch shape of the two-pass selection's passes and the candidate step, entries per program x warps
# (the ``block`` / ``num_warps`` arguments; the measured choice is in docs/clt.md)
BLOCK = 2048
NUM_WARPS = 4
_BINS = 1 << 16
# the one-pass selection: entries per program x warps of the stash pass (its ``block`` / ``num_warps``). Chosen
# from the compiled code (ptxas, sm_90, registers per thread -> resident programs per SM of 64K registers and 64
# warps): 2048 x 8 uses 30 registers, so 8 programs (64 warps, the most an SM holds) with 32 KiB of scores in
# flight; 4096 x 8 (54 registers) holds 4 programs (32 warps) with the same 32 KiB, so a program's scan and stores
# overlap fewer other programs' loads; 4096 x 4 (96) holds 5 programs, 20 KiB; 8192 x 8 (106) and 16384 x 16 (115)
# hold 2 and 1; 1024 x 4 (31) holds 16 programs of 2 KiB (twice the per-program work per byte).
STASH_BLOCK = 2048
STASH_WARPS = 8
_VEC = 8  # entries per thread chunk of the stash pass (one 16-byte load of 16-bit scores)
_COMPACT_SLOTS = 1024  # stash slots read per program of the compaction
_FB_TILE = 4096  # entries per tile of the fallback passes
_FB_PROGRAMS = 1024  # programs of the fallback passes (persistent; they return at once when not needed)
_FB_CHUNK = 1024  # tiles per step of the fallback's one-program scan


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
        # scan-and-add here was slower.)
        offs, inb, row, x = _block(x_ptr, n, row_len, BLOCK, BLOCK_IN_ONE_ROW)
        lo = _per_row(lo_ptr, row, inb, BLOCK_IN_ONE_ROW)
        hit = (x.to(tl.float32) >= lo.to(tl.float32)) & inb
        h = hit.to(tl.int32)
        dst = tl.load(pre_ptr + tl.program_id(0)) + (tl.cumsum(h, axis=0) - h).to(tl.int64)
        if CAPPED:  # buffers of ``cap`` slots sized before the count was known: drop what does not fit
            hit = hit & (dst < cap)
        tl.store(idx_ptr + dst, offs, mask=hit)
        tl.store(val_ptr + dst, x, mask=hit)


    # ------------------------------------------------------------------ one-pass selection
    @triton.jit
    def _order_key(b):
        # int32 order key in [0, 2**16) of 16-bit float bits ``b`` (sign-extended int32): the order of the values,
        # -0 and +0 tie; real values get keys >= 0x7F (-inf's)
        b = tl.where(b == -32768, 0, b)  # -0 -> +0
        return (b ^ ((b >> 15) & 0x7FFF)) + 0x8000  # negatives: magnitude bits flipped; the sign shifted up

    @triton.jit
    def _key16(x):
        # order key of 16-bit floats; NaN gets 0, below every value (only the fallback ever sees a NaN's key)
        xf = x.to(tl.float32)  # (Triton's interpreter compares bf16 as raw bits)
        return tl.where(xf == xf, _order_key(x.to(tl.int16, bitcast=True).to(tl.int32)), 0)

    @triton.jit
    def _stash_kernel(x_ptr, lo_ptr, cnt_ptr, slot_ptr, n, row_len, cap, BLOCK: tl.constexpr, VEC: tl.constexpr,
                      EVEN: tl.constexpr, BLOCK_IN_ONE_ROW: tl.constexpr):
        # the one read of x: per block, the count of entries at or above their row's bound, and the first ``cap``
        # of them in flat order as (offset << 16 | raw 16 bits) in the block's slots. [BLOCK // VEC, VEC] tiles (VEC
        # entries per thread, one vector load): the scan runs over the VEC-entry chunks and inside each chunk, so
        # few registers stay live and many blocks fit on an SM (the loads in flight set the speed).
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK  # int64: x may exceed 2**31 entries
        r = tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        # x streams through once: evict_first keeps L2 for the slots and counts the later kernels read
        if EVEN:  # n is a multiple of BLOCK: no bounds mask
            x = tl.load(x_ptr + start + r, eviction_policy="evict_first")
        else:
            inb = r < tl.minimum(n - start, BLOCK).to(tl.int32)
            x = tl.load(x_ptr + start + r, mask=inb, other=0.0, eviction_policy="evict_first")
        if BLOCK_IN_ONE_ROW:
            lo = tl.load(lo_ptr + start // row_len)
        elif EVEN:
            lo = tl.load(lo_ptr + (start + r) // row_len)
        else:
            lo = tl.load(lo_ptr + (start + r) // row_len, mask=inb, other=0)
        hit = x.to(tl.float32) >= lo.to(tl.float32)  # NaN: never
        if not EVEN:
            hit = hit & inb
        h = hit.to(tl.int32)
        chunk = tl.sum(h, axis=1)
        pos = (tl.cumsum(chunk, axis=0) - chunk)[:, None] + tl.cumsum(h, axis=1) - h
        packed = (r << 16) | (x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
        tl.store(slot_ptr + pid.to(tl.int64) * cap + pos, packed, mask=hit & (pos < cap))
        tl.store(cnt_ptr + pid, tl.sum(chunk, axis=0))

    @triton.jit
    def _emit(flat, bits, dst, m, idx_ptr, key_ptr, row_len, cand_cap, ROWS: tl.constexpr):
        # candidates to slots ``dst``: flat index and sort key (row << 16 | order key of the raw 16 ``bits``)
        key = _order_key((bits << 16) >> 16)
        if ROWS:
            key = ((flat // row_len).to(tl.int32) << 16) | key
        m = m & (dst < cand_cap)
        tl.store(idx_ptr + dst, flat, mask=m)
        tl.store(key_ptr + dst, key, mask=m)

    @triton.jit
    def _compact_stash_kernel(x_ptr, lo_ptr, cnt_ptr, incl_ptr, slot_ptr, idx_ptr, key_ptr, n, nb, row_len,
                              cand_cap, BLOCK: tl.constexpr, CAP: tl.constexpr, GROUP: tl.constexpr,
                              SUB: tl.constexpr, ROWS: tl.constexpr):
        # GROUP blocks per program: each block's hits to its first candidate slot (inclusive prefix sum of the
        # counts minus its own count) onwards, in flat order; from its slots, or (rare: more than CAP hits) read
        # again from x in SUB-entry steps
        first = tl.program_id(0).to(tl.int64) * GROUP
        b = first + tl.arange(0, GROUP)
        bm = b < nb
        c = tl.load(cnt_ptr + b, mask=bm, other=0)
        start = tl.load(incl_ptr + b, mask=bm, other=0) - c
        j = tl.arange(0, CAP)
        m = (j[None, :] < c[:, None]) & (c[:, None] <= CAP)
        v = tl.load(slot_ptr + b[:, None] * CAP + j[None, :], mask=m, other=0)
        _emit(b[:, None] * BLOCK + (v >> 16), v & 0xFFFF, start[:, None] + j[None, :], m, idx_ptr, key_ptr, row_len,
              cand_cap, ROWS)
        over = (c > CAP).to(tl.int32)
        while tl.max(over, axis=0) > 0:  # the blocks of this group with more hits than slots, one at a time
            g = tl.argmax(over, axis=0)
            over = tl.where(tl.arange(0, GROUP) == g, 0, over)
            bg = first + g
            dst = tl.load(incl_ptr + bg) - tl.load(cnt_ptr + bg)
            for s0 in range(0, BLOCK, SUB):
                offs = bg * BLOCK + s0 + tl.arange(0, SUB)
                inb = offs < n
                xs = tl.load(x_ptr + offs, mask=inb, other=0.0)
                lo = tl.load(lo_ptr + offs // row_len, mask=inb, other=0)
                hit = (xs.to(tl.float32) >= lo.to(tl.float32)) & inb
                h = hit.to(tl.int32)
                _emit(offs, xs.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, dst + tl.cumsum(h, axis=0) - h, hit,
                      idx_ptr, key_ptr, row_len, cand_cap, ROWS)
                dst += tl.sum(h, axis=0)

    # ------------------------------------------------------------------ exact fallback (device-gated)
    @triton.jit
    def _fb_tile(x_ptr, t, row_len, tiles_per_row, TILE: tl.constexpr):
        # tile t of the fallback: TILE entries of one row; (row, flat indices, in-row mask, order keys)
        row = t // tiles_per_row
        col = (t - row * tiles_per_row).to(tl.int64) * TILE + tl.arange(0, TILE)
        inb = col < row_len
        flat = row.to(tl.int64) * row_len + col  # int64: rows * row_len may exceed 2**31
        x = tl.load(x_ptr + flat, mask=inb, other=0.0)
        return row, flat, inb, _key16(x)

    @triton.jit
    def _pick(h_ptr, need):
        # from a 256-bin histogram: the largest bin t with at least ``need`` entries in bins >= t, and the count
        # in bins > t
        bins = tl.arange(0, 256)
        h = tl.load(h_ptr + bins)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        t = tl.max(tl.where(at_or_above >= need, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > t, h, 0), axis=0)
        return t, above

    @triton.jit
    def _fb_cut(hist_ptr, rows, row, n_keep):
        # a row's exact cut-off key (its n_keep-th largest) and how many entries equal to it it keeps
        t1, a1 = _pick(hist_ptr + row * 256, n_keep)
        t2, a2 = _pick(hist_ptr + (rows + row) * 256, n_keep - a1)
        return t1 * 256 + t2, n_keep - a1 - a2

    @triton.jit
    def _fb_hist_kernel(x_ptr, fast_ptr, hist_ptr, rows, row_len, n_tiles, tiles_per_row, n_keep,
                        STAGE: tl.constexpr, TILE: tl.constexpr):
        # per row, a histogram of the keys' high byte (STAGE 0), then of the low byte of the keys whose high byte
        # is the row's cut-off byte (STAGE 1)
        if tl.load(fast_ptr) == 0:
            t = tl.program_id(0)
            while t < n_tiles:  # persistent (a while loop: the interpreter takes no tensor range bounds)
                row, flat, inb, key = _fb_tile(x_ptr, t, row_len, tiles_per_row, TILE)
                if STAGE == 0:
                    h = tl.histogram(key >> 8, 256, mask=inb)
                else:
                    t1, _ = _pick(hist_ptr + row * 256, n_keep)
                    h = tl.histogram(key & 255, 256, mask=inb & ((key >> 8) == t1))
                bins = tl.arange(0, 256)
                tl.atomic_add(hist_ptr + (STAGE * rows + row) * 256 + bins, h.to(tl.int64), mask=h > 0)
                t += tl.num_programs(0)

    @triton.jit
    def _fb_count_kernel(x_ptr, fast_ptr, hist_ptr, gt_ptr, eq_ptr, rows, row_len, n_tiles, tiles_per_row, n_keep,
                         TILE: tl.constexpr):
        # per tile: entries above the row's cut-off and equal to it
        if tl.load(fast_ptr) == 0:
            t = tl.program_id(0)
            while t < n_tiles:  # persistent (a while loop: the interpreter takes no tensor range bounds)
                row, flat, inb, key = _fb_tile(x_ptr, t, row_len, tiles_per_row, TILE)
                cut, _ = _fb_cut(hist_ptr, rows, row, n_keep)
                tl.store(gt_ptr + t, tl.sum(((key > cut) & inb).to(tl.int32), axis=0))
                tl.store(eq_ptr + t, tl.sum(((key == cut) & inb).to(tl.int32), axis=0))
                t += tl.num_programs(0)

    @triton.jit
    def _fb_scan_kernel(fast_ptr, hist_ptr, gt_ptr, eq_ptr, eq_before_ptr, kept_before_ptr, rows, tiles_per_row,
                        n_keep, CHUNK: tl.constexpr):
        # one program: per tile, the ties at the cut-off in the row's earlier tiles and the entries those keep
        if tl.load(fast_ptr) == 0:
            row = tl.program_id(0) * 0
            while row < rows:
                _, quota = _fb_cut(hist_ptr, rows, row, n_keep)
                run_eq = tl.full((), 0, tl.int64)
                run_kept = tl.full((), 0, tl.int64)
                c0 = row * 0
                while c0 < tiles_per_row:
                    c = c0 + tl.arange(0, CHUNK)
                    m = c < tiles_per_row
                    t = row.to(tl.int64) * tiles_per_row + c
                    eq = tl.load(eq_ptr + t, mask=m, other=0).to(tl.int64)
                    eq_before = run_eq + tl.cumsum(eq, axis=0) - eq
                    kept = (tl.load(gt_ptr + t, mask=m, other=0).to(tl.int64)
                            + tl.minimum(tl.maximum(quota - eq_before, 0), eq))
                    tl.store(eq_before_ptr + t, eq_before, mask=m)
                    tl.store(kept_before_ptr + t, run_kept + tl.cumsum(kept, axis=0) - kept, mask=m)
                    run_eq += tl.sum(eq, axis=0)
                    run_kept += tl.sum(kept, axis=0)
                    c0 += CHUNK
                row += 1

    @triton.jit
    def _fb_write_kernel(x_ptr, fast_ptr, hist_ptr, eq_before_ptr, kept_before_ptr, out_ptr, rows, row_len, n_tiles,
                         tiles_per_row, n_keep, TILE: tl.constexpr):
        # the kept entries of each tile (above the cut-off, and the first ties of the row) to their output slots
        if tl.load(fast_ptr) == 0:
            t = tl.program_id(0)
            while t < n_tiles:  # persistent (a while loop: the interpreter takes no tensor range bounds)
                row, flat, inb, key = _fb_tile(x_ptr, t, row_len, tiles_per_row, TILE)
                cut, quota = _fb_cut(hist_ptr, rows, row, n_keep)
                eq = ((key == cut) & inb).to(tl.int64)
                rank = tl.load(eq_before_ptr + t) + tl.cumsum(eq, axis=0)  # 1-based rank of a tie in its row
                keep = ((key > cut) & inb) | ((eq > 0) & (rank <= quota))
                k = keep.to(tl.int64)
                pos = row.to(tl.int64) * n_keep + tl.load(kept_before_ptr + t) + tl.cumsum(k, axis=0) - k
                tl.store(out_ptr + pos, flat, mask=keep)
                t += tl.num_programs(0)

    # ------------------------------------------------------------------ CLT dense decode: gradient at kept entries
    @triton.jit
    def _grad_kept_kernel(idx_ptr, w_off_ptr, w0_ptr, g_ptr, out_ptr, nnz, per_layer, n_features, d, n_layers,
                          W_MULT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        # out[e] = <g[tok, s:, :], W_s[feat]> for the kept entry e = (layer s, token tok, feature feat): the
        # decoder of source layer s is [F, (L - s) d] at w0_ptr + w_off[s] (elements, may be negative), g is
        # [N, L, d]
        e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        em = e < nnz
        flat = tl.load(idx_ptr + e, mask=em, other=0).to(tl.int64)
        s = flat // per_layer  # per_layer = tokens x features
        rest = flat - s * per_layer
        tok = rest // n_features
        feat = rest - tok * n_features
        width = (n_layers - s) * d
        w_off = tl.load(w_off_ptr + s, mask=em, other=0)
        if W_MULT > 1:  # every offset is a multiple of W_MULT elements (16 bytes): vector loads
            w_off = tl.multiple_of(w_off, W_MULT)
        w_row = w0_ptr + (w_off + feat * width)
        g_off = tok * (n_layers * d) + s * d
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        top = tl.max(tl.where(em, width, 0), axis=0)  # the widest row of these entries
        d0 = top * 0
        while d0 < top:
            cols = d0 + tl.arange(0, BLOCK_D)
            m = em[:, None] & (cols[None, :] < width[:, None])
            w = tl.load(w_row[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + g_off[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(w * g, axis=1)
            d0 += BLOCK_D
        tl.store(out_ptr + e, acc, mask=em)


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
    if rows >= 1 << 15:  # sort keys row << 16 | key stay below 2**31
        raise ValueError(f"select_16bit handles fewer than {1 << 15} rows, got {rows}")
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
    row has fewer than ``n_keep`` candidates (then the indices are meaningless). No host sync."""
    key = order_keys16(val)
    if rows > 1:
        key = key + (torch.div(idx, m, rounding_mode="floor").to(torch.int32) << 16)
    return _keep_by_keys(key, idx, rows, n_keep)


def _keep_by_keys(key: torch.Tensor, idx: torch.Tensor, rows: int, n_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut-off and keep step on candidates in flat order: ``key`` (int32) ``row * 2**16 + 16-bit order key``,
    ``-1`` for an empty slot (none before a filled one), ``idx`` their flat indices. Returns the kept flat indices
    (``rows * n_keep``, ascending; meaningless when some row is short) and a device flag: some row has fewer than
    ``n_keep`` candidates. Fixed shapes, no host sync.

    One sort of the keys gives each row's range and its ``n_keep``-th largest key (the cut-off); the row keeps the
    keys above it and, in flat order, the first ``n_keep - above`` equal to it."""
    dev = key.device
    sorted_keys = torch.sort(key).values
    base = torch.arange(rows + 1, device=dev, dtype=torch.int32) * _BINS
    bounds = torch.searchsorted(sorted_keys, base)  # [rows + 1]: where each row's keys start (and the end)
    start, end = bounds[:-1], bounds[1:]
    short = (end - start < n_keep).any()
    cut = sorted_keys[(end - n_keep).clamp(min=0)]  # the n_keep-th largest key of each row (row * 2**16 + key)
    above_from = torch.searchsorted(sorted_keys, cut, right=True)
    quota = n_keep - (end - above_from)  # ties kept: n_keep minus the keys above the cut-off
    # empty slots (key -1) need no mask: unless some row is short (then the result is discarded), every cut-off
    # is a real key (>= 0), which -1 neither equals nor exceeds
    if rows > 1:
        row = (key >> 16).clamp_(min=0).long()
        ties = above_from - torch.searchsorted(sorted_keys, cut)
        ties_before = (torch.cumsum(ties, 0) - ties)[row]
        cut, quota = cut[row], quota[row]
    eq = key == cut
    rank = torch.cumsum(eq, 0)  # 1-based rank of a tie inside its row, in flat order
    if rows > 1:
        rank -= ties_before
    keep = (key > cut) | (eq & (rank <= quota))
    total_out = rows * n_keep
    # every row keeps exactly n_keep and rows come in order: the running count is the output slot (clamped: a
    # short row's cut-off is meaningless and may keep too many; the caller discards that result)
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, total_out).clamp_(max=total_out)
    out = torch.empty(total_out + 1, dtype=torch.int64, device=dev)
    return out.scatter_(0, slot, idx)[:total_out], short


def stash_capacity(expect: float, block: int) -> int:
    """Slots per block of the one-pass selection's stash: a power of two at least twice the hits a block of
    ``block`` entries expects (``expect``: the expected fraction of entries at or above the bound) plus four
    standard deviations and 16, at most ``block``. A block with more hits is read again from ``x``."""
    mean = max(0.0, float(expect)) * block
    want = int(2 * mean + 4 * math.sqrt(mean) + 16)
    return min(block, 1 << (want - 1).bit_length())


def candidate_capacity(expect: float, rows: int, m: int) -> int:
    """Candidate buffer of the one-pass selection for ``rows`` rows of ``m`` entries: per row 1.5 x the expected
    candidates (``expect`` of the row) plus 1024, at most the row. More candidates than that (an unlucky sample
    or masses of ties at the bound) send the selection to its exact fallback."""
    return rows * min(m, int(1.5 * max(0.0, float(expect)) * m) + 1024)


def select_16bit_1pass(x2d: torch.Tensor, n_keep: int, lo_rows: torch.Tensor, expect: float, *,
                       block: int = STASH_BLOCK, num_warps: int = STASH_WARPS, slot_cap: int | None = None,
                       cand_cap: int | None = None, stats: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices of the ``n_keep`` largest entries of every row of a bf16/fp16 ``x2d`` (ties: the
    smallest flat indices), in one read of ``x`` and without a host sync (see the module docstring).

    Args:
        x2d: ``[rows, m]`` bf16/fp16 scores, fewer than ``2**15`` rows.
        n_keep: entries kept per row, ``1 <= n_keep <= m``.
        lo_rows: per-row bounds that about ``expect * m`` entries of each row reach (e.g. from a sample). Any
            bound gives the exact result; a bound that leaves a row short of ``n_keep`` entries, or many more
            candidates than the buffers hold, costs the fallback's passes.
        expect: the expected fraction of entries at or above the bound; sizes the buffers (no host sync).
        block: entries per program of the stash pass (a power of two in ``[64, 2**15]``); ``num_warps`` its
            warps. The result does not depend on them.
        slot_cap: stash slots per block (a power of two; default :func:`stash_capacity`); a block with more hits
            is read again from ``x`` by the compaction.
        cand_cap: candidate buffer (default :func:`candidate_capacity`).
        stats: optional int64 ``[3]`` device counters, incremented without a host sync: calls, calls whose answer
            the exact fallback wrote, and blocks with more hits than slots (read again from ``x``). Three more
            small launches per call when given.

    Returns:
        ``(indices, fast)``: int64 ``[rows * n_keep]`` flat indices, ascending, and a device bool: True when the
        candidates held the answer, False when the fallback wrote it. Rows with fewer than ``n_keep`` non-NaN
        entries keep NaN entries last (smallest flat indices first).
    """
    if triton is None:
        raise ImportError("select_16bit_1pass needs triton (pip install triton, or use the torch path)")
    if x2d.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"select_16bit_1pass handles bf16/fp16 scores, got {x2d.dtype}")
    rows, m = x2d.shape
    if rows >= 1 << 15:
        raise ValueError(f"select_16bit_1pass handles fewer than {1 << 15} rows, got {rows}")
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or not 1 <= n_keep <= m:
        raise ValueError(f"n_keep must be an int in [1, {m}], got {n_keep!r}")
    check_launch(block, num_warps)
    if not 64 <= block <= 1 << 15:
        raise ValueError(f"block must be in [64, {1 << 15}] (offsets are packed in 16 bits), got {block}")
    cap = stash_capacity(expect, block) if slot_cap is None else slot_cap
    check_launch(cap, 1)
    n_cand = candidate_capacity(expect, rows, m) if cand_cap is None else cand_cap
    if n_cand < 1:
        raise ValueError(f"cand_cap must be positive, got {n_cand}")
    flat = x2d.contiguous().view(-1)
    dev = flat.device
    lo_rows = lo_rows.to(flat.dtype).contiguous()
    cnt, slots = stash_pass(flat, lo_rows, m, cap, block=block, num_warps=num_warps)
    keys, idx, incl = compact_stash(flat, lo_rows, rows, m, cnt, slots, cap, n_cand, block)
    out, short = _keep_by_keys(keys, idx, rows, n_keep)
    # the candidates hold the answer when all fit and every row has n_keep of them
    fast = ~short & (incl[-1] <= n_cand)
    hist = torch.zeros(2 * rows * 256, dtype=torch.int64, device=dev)
    _fallback(flat, rows, m, n_keep, fast, hist, out)
    if stats is not None:
        stats += torch.stack((torch.ones_like(incl[-1]), (~fast).long(), (cnt > cap).sum()))
    return out, fast


def compact_stash(flat: torch.Tensor, lo_rows: torch.Tensor, rows: int, m: int, cnt: torch.Tensor,
                  slots: torch.Tensor, cap: int, n_cand: int, block: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-pass selection's compaction of :func:`stash_pass`'s output (``cnt``, ``slots`` for the same
    ``block`` and ``cap``): int32 sort keys (``row << 16 | order key`` for several rows, ``-1`` past the count),
    int64 flat indices (``n_cand`` slots, flat order) and the inclusive prefix sums of the block counts."""
    n = flat.numel()
    nb = triton.cdiv(n, block)
    incl = torch.cumsum(cnt, 0)  # int64
    keys = torch.full((n_cand,), -1, dtype=torch.int32, device=flat.device)
    idx = torch.empty(n_cand, dtype=torch.int64, device=flat.device)
    group = max(1, _COMPACT_SLOTS // cap)
    _compact_stash_kernel[(triton.cdiv(nb, group),)](flat, lo_rows, cnt, incl, slots, idx, keys, n, nb, m, n_cand,
                                                     BLOCK=block, CAP=cap, GROUP=group, SUB=min(block, 256),
                                                     ROWS=rows > 1)
    return keys, idx, incl


def stash_pass(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int, cap: int, *, block: int = STASH_BLOCK,
               num_warps: int = STASH_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-pass selection's read of ``flat`` (16-bit scores, rows of ``row_len``): per block of ``block``
    entries, the count of entries at or above their row's bound (int32 ``[blocks]``) and the first ``cap`` of
    them as ``offset << 16 | raw bits`` (int32 ``[blocks * cap]``, unwritten past the count)."""
    n = flat.numel()
    nb = triton.cdiv(n, block)
    cnt = torch.empty(nb, dtype=torch.int32, device=flat.device)
    slots = torch.empty(nb * cap, dtype=torch.int32, device=flat.device)
    rows = lo_rows.numel()
    _stash_kernel[(nb,)](flat, lo_rows.to(flat.dtype).contiguous(), cnt, slots, n, row_len, cap, BLOCK=block,
                         VEC=_VEC, EVEN=n % block == 0, BLOCK_IN_ONE_ROW=rows == 1 or row_len % block == 0,
                         num_warps=num_warps)
    return cnt, slots


def _fallback(flat: torch.Tensor, rows: int, m: int, n_keep: int, fast: torch.Tensor, hist: torch.Tensor,
              out: torch.Tensor) -> None:
    """The exact selection from ``flat`` into ``out`` where ``fast`` (a device flag) is False; five launches that
    return at once where it is True. ``hist``: ``2 * rows * 256`` zeroed int64."""
    tiles_per_row = triton.cdiv(m, _FB_TILE)
    n_tiles = rows * tiles_per_row
    flag = fast.to(torch.int32).reshape(1)
    programs = min(n_tiles, _FB_PROGRAMS)
    grid = (programs,)
    sizes = (rows, m, n_tiles, tiles_per_row, n_keep)
    _fb_hist_kernel[grid](flat, flag, hist, *sizes, STAGE=0, TILE=_FB_TILE)
    _fb_hist_kernel[grid](flat, flag, hist, *sizes, STAGE=1, TILE=_FB_TILE)
    gt = torch.empty(n_tiles, dtype=torch.int32, device=flat.device)
    eq = torch.empty(n_tiles, dtype=torch.int32, device=flat.device)
    _fb_count_kernel[grid](flat, flag, hist, gt, eq, *sizes, TILE=_FB_TILE)
    eq_before = torch.empty(n_tiles, dtype=torch.int64, device=flat.device)
    kept_before = torch.empty(n_tiles, dtype=torch.int64, device=flat.device)
    _fb_scan_kernel[(1,)](flag, hist, gt, eq, eq_before, kept_before, rows, tiles_per_row, n_keep, CHUNK=_FB_CHUNK)
    _fb_write_kernel[grid](flat, flag, hist, eq_before, kept_before, out, *sizes, TILE=_FB_TILE)


def grad_kept(indices: torch.Tensor, g: torch.Tensor, weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
              n_tokens: int, n_features: int) -> torch.Tensor:
    """The activation gradient of the CLT's dense decode at its kept entries, every source layer in one launch.

    ``out[e] = <g[tok, s:, :].flatten(), weights[s][feat]>`` (float32 accumulation) for the kept entry ``e`` with
    flat index ``indices[e] = (s * n_tokens + tok) * n_features + feat``. ``g``: ``[n_tokens, L, d]`` (the
    decode's output gradient); ``weights[s]``: ``[n_features, (L - s) * d]``, contiguous, one dtype. The
    decoders' addresses go to the device through pinned memory (no host sync); no layer bounds are needed.
    """
    if triton is None:
        raise ImportError("grad_kept needs triton (pip install triton, or use the torch path)")
    n_layers = len(weights)
    n, layers, d = g.shape
    if layers != n_layers or n != n_tokens:
        raise ValueError(f"g is {tuple(g.shape)}, expected [{n_tokens}, {n_layers}, d]")
    for s, w in enumerate(weights):
        if tuple(w.shape) != (n_features, (n_layers - s) * d) or not w.is_contiguous() or w.dtype != weights[0].dtype:
            raise ValueError(f"weights[{s}] must be contiguous [{n_features}, {(n_layers - s) * d}] "
                             f"{weights[0].dtype}, got {tuple(w.shape)} {w.dtype}")
    nnz = indices.numel()
    out = torch.empty(nnz, dtype=torch.float32, device=g.device)
    if nnz == 0:
        return out
    size = weights[0].element_size()
    # element offsets of every decoder from the first (whole: allocations are aligned to more than an element)
    offsets = torch.tensor([(w.data_ptr() - weights[0].data_ptr()) // size for w in weights], dtype=torch.int64)
    if g.is_cuda:  # pinned and asynchronous: a pageable copy would wait for the device
        offsets = offsets.pin_memory().to(g.device, non_blocking=True)
    aligned = all((w.data_ptr() - weights[0].data_ptr()) % 16 == 0 for w in weights)
    block_e = 16
    _grad_kept_kernel[(triton.cdiv(nnz, block_e),)](indices, offsets, weights[0], g.contiguous(), out, nnz,
                                                    n_tokens * n_features, n_features, d, n_layers,
                                                    W_MULT=16 // size if aligned else 1, BLOCK_E=block_e,
                                                    BLOCK_D=128)
    return out
