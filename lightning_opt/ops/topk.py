"""Local sparsifying activations for transcoders: TopK per token, BatchTopK per row, JumpReLU.

All functions are plain torch and device-agnostic. Selections return ``(flat_indices, values)`` so a sparse
decoder can consume them directly; :func:`scatter_dense` turns them into a dense tensor when needed.

Tie rule (every selection here): entries are ranked by (value descending, flat index ascending), i.e. among
entries equal to the cut-off value the ones with the smallest flat index are kept. The kept *multiset of
values* always equals ``torch.topk``'s. NaN entries are never kept while a row has ``n`` other entries; for a
row with fewer, the candidate paths raise and the one-pass Triton selection keeps the row's NaN entries last.

BatchTopK algorithm (``batch_topk_rows``), for ``R`` rows of ``M`` entries keeping ``n`` per row:

1. A per-row lower bound ``lo`` from a fixed-seed sample of columns: a value that about ``1.1 n`` entries
   of the row reach (with a binomial margin), so every true top-``n`` entry is at or above it.
2. Candidates: the entries with ``x >= lo``, as ascending flat indices and values (one host sync: the count
   sizes the rest). On CUDA with Triton installed this is a counting pass and an ordered compaction pass
   (``ops._topk_triton.compact_ge``); otherwise ``nonzero(x >= lo)``. Both give the same indices. If a row
   has fewer than ``n`` candidates (unlucky sample) that row falls back to ``lo = -inf``.
3. Per row, the ``n``-th largest candidate is the exact threshold ``t``; keep ``> t`` and the first
   ``n - count(> t)`` entries ``== t``.

This touches ``x`` twice (sample gather aside): one compare + compaction, one gather. ``torch.topk`` over
hundreds of millions of entries with ``k`` near a million is several times slower (see docs/clt.md).

bf16/fp16 scores on CUDA with Triton skip steps 2-3 and the host sync: ``ops._topk_triton.select_16bit_1pass``
reads ``x`` once (per block, the entries ``>= lo`` to the block's own slots), compacts the candidates into
buffers whose size comes from the sample, sorts only their 16-bit order keys for each row's exact cut-off and
keeps by running counts; all shapes are fixed, so nothing waits for the device. When the sample misleads (a
row short of ``n`` candidates, more candidates than the buffers hold) a device-side exact fallback (histograms
of the order keys over ``x``) writes the result instead, still without a sync. Same result and tie rule. The
two-pass form (``select_backend="triton_2pass"``: a counting pass, one host sync, an ordered compaction pass)
stays available. The Triton selection is checked against a stable sort once per device and launch shape and
falls back with a warning if it disagrees.

Every path gives the same indices; the keyword arguments of :func:`batch_topk_rows` (``select_backend``,
``candidates_backend``, ``threshold_method``, validated by :func:`check_topk_options`) choose among them for
measurements and tests. ``"auto"`` picks the one-pass Triton selection where it runs (no host sync), and the
fastest choice of the other steps elsewhere (docs/clt.md compares the paths).
``triton_block`` and
``triton_num_warps`` set the Triton passes' launch shape (same indices for every shape; ``None``: the path's
default).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from lightning_opt.ops._keys import order_keys16 as _order_keys16  # noqa: F401  (ops.global_topk imports it here)

__all__ = [
    "batch_topk_rows",
    "check_topk_options",
    "token_topk",
    "scatter_dense",
    "jumprelu",
    "JumpReLUFunction",
]

_SAMPLE_COLS = 1 << 18
_SEED = 0x7A9B
# candidate step: "auto" (Triton passes on CUDA when importable, else torch), "torch" or "triton"
CandidatesBackend = Literal["auto", "torch", "triton"]
# threshold step: "histogram" (order-key histogram: no sort, no extra sync), "topk" (a top-k over the candidates)
# or "auto" (top-k for one row and on CPU, histogram for several rows on CUDA): with one row both have no extra
# sync and the top-k is the faster (docs/clt.md)
ThresholdMethod = Literal["auto", "histogram", "topk"]
# whole selection for bf16/fp16: "auto" (the one-pass Triton selection when it passes its self-check, else the
# candidate + threshold steps), "triton" (the one-pass Triton selection: no host sync), "triton_2pass" (the
# two-pass Triton selection: one host sync) or "candidates" (always the candidate + threshold steps)
SelectBackend = Literal["auto", "candidates", "triton", "triton_2pass"]


def check_topk_options(select_backend: str = "auto", candidates_backend: str = "auto",
                       threshold_method: str = "auto") -> None:
    """Raise ``ValueError`` naming the choices when one of :func:`batch_topk_rows`'s path options is unknown."""
    for name, value, kind in (("select_backend", select_backend, SelectBackend),
                              ("candidates_backend", candidates_backend, CandidatesBackend),
                              ("threshold_method", threshold_method, ThresholdMethod)):
        if value not in get_args(kind):
            raise ValueError(f"{name}={value!r} is unknown; choose one of {get_args(kind)}")


# default launch shapes of the Triton passes, entries per program x warps: the two-pass selection's and the
# candidate step's (``ops._topk_triton.BLOCK`` x ``NUM_WARPS``) and the one-pass selection's stash pass
# (``STASH_BLOCK`` x ``STASH_WARPS``), repeated so that importing this module does not import triton
# (tests/ops/test_topk.py checks that they agree)
_TRITON_BLOCK = 2048
_TRITON_NUM_WARPS = 4
_STASH_BLOCK = 2048
_STASH_WARPS = 8
_KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}
_BINS = 1 << 16
_MAX_BINS = 1 << 24  # rows * bins of the histogram; more rows use the top-k step

def _check_k(n_keep: int, m: int, what: str) -> None:
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or n_keep < 0:
        raise ValueError(f"{what} must be a non-negative int, got {n_keep!r}")
    if n_keep > m:
        raise ValueError(f"{what}={n_keep} exceeds the {m} entries available; lower k.")


_COLUMN_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _sample_columns(m: int, device: torch.device) -> torch.Tensor:
    """The fixed-seed sample of ``_SAMPLE_COLS`` column indices for rows of ``m`` entries, drawn once per
    ``(m, device)`` (a fresh generator: sampling never advances the user's RNG stream)."""
    key = (m, device)
    if key not in _COLUMN_CACHE:
        if len(_COLUMN_CACHE) >= 32:  # a few row lengths in practice; bound the memory anyway
            _COLUMN_CACHE.clear()
        gen = torch.Generator(device=device).manual_seed(_SEED)
        _COLUMN_CACHE[key] = torch.randint(0, m, (_SAMPLE_COLS,), device=device, generator=gen)
    return _COLUMN_CACHE[key]


def _row_lower_bounds(x2d: torch.Tensor, n_keep: int) -> tuple[torch.Tensor, float]:
    """Per-row value that at least ``n_keep`` entries reach with high probability, and the fraction of a row's
    entries expected at or above it (a host float: it sizes buffers without a sync)."""
    rows, m = x2d.shape
    if m <= _SAMPLE_COLS:
        # The whole row is the sample: the n-th largest is exact.
        return torch.topk(x2d.float(), n_keep, dim=1, sorted=False).values.amin(dim=1), n_keep / m
    cols = _sample_columns(m, x2d.device)
    sample = x2d.index_select(1, cols).float()  # index_select: less host work than advanced indexing
    # (2**18 columns: at 4096 x 12 x 8192 with k=200 about 1.3x the kept count is expected to pass, by the
    # margin of _sample_rank; ~2x with 2**15.)
    j = _sample_rank(_SAMPLE_COLS, n_keep / m)
    return torch.topk(sample, j, dim=1, sorted=False).values.amin(dim=1), j / _SAMPLE_COLS


def _sample_rank(s: int, frac: float) -> int:
    """Rank in a sample of ``s`` whose value bounds the top ``frac`` of the data with a margin."""
    mean = s * frac
    # Margin: 10% plus four binomial standard deviations plus a constant, so a fallback is rare.
    return min(s, int(math.ceil(1.1 * mean + 4.0 * math.sqrt(mean) + 16)))


def _launch_shape(path: str, block: int | None, num_warps: int | None) -> tuple[int, int]:
    """``(block, num_warps)`` of the Triton passes of ``path`` (``"triton"``: the one-pass selection's stash pass;
    else the two-pass selection and the candidate step), ``None`` meaning that path's default."""
    default = (_STASH_BLOCK, _STASH_WARPS) if path == "triton" else (_TRITON_BLOCK, _TRITON_NUM_WARPS)
    return (default[0] if block is None else block, default[1] if num_warps is None else num_warps)


def _select_path(x2d: torch.Tensor, backend: SelectBackend = "auto", *, block: int | None = None,
                 num_warps: int | None = None) -> str:
    """Which selection ``batch_topk_rows`` runs on ``x2d`` under ``backend``: ``"triton"`` (the one-pass Triton
    selection), ``"triton_2pass"`` or ``"candidates"`` (candidate and threshold steps). ``block`` x
    ``num_warps``: the Triton passes' launch shape (``None``: the path's default)."""
    if backend == "candidates" or x2d.dtype not in (torch.bfloat16, torch.float16):
        return "candidates"
    rows = x2d.shape[0]
    if backend == "triton_2pass":
        return "triton_2pass" if rows * _BINS <= _MAX_BINS else "candidates"
    if rows >= 1 << 15:
        return "candidates"
    if backend == "triton":
        return "triton"
    import lightning_opt.ops._topk_triton as _topk_triton

    if not _topk_triton.available(x2d):
        return "candidates"
    return "triton" if _select_16bit_works(x2d.device, "triton", *_launch_shape("triton", block, num_warps)) \
        else "candidates"


_SELECT_CHECKED: dict[tuple[torch.device, str, int, int], bool] = {}


def _select_16bit_works(device: torch.device, path: str = "triton", block: int = _STASH_BLOCK,
                        num_warps: int = _STASH_WARPS) -> bool:
    """Compile and check a Triton selection (``path``: ``"triton"`` one-pass or ``"triton_2pass"``) once per
    device and launch shape against a stable sort (ties, NaN, -0, rows that split a block, the one-pass
    selection's fallback and its fast path); a failure costs a warning and the torch path instead of a crash or
    a wrong selection."""
    key = (device, path, block, num_warps)
    if key not in _SELECT_CHECKED:
        import lightning_opt.ops._topk_triton as _topk_triton

        ok = False
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            # rows that split blocks, and rows of whole blocks (one bound per block)
            shapes = ((3, 5000, torch.bfloat16), (2, 2 * block, torch.float16))
            for rows, m, dtype in shapes:
                x = (torch.randn(rows, m, generator=gen) * 4).round().to(dtype)
                x[0, 3], x[1, 4], x[-1, 5] = float("nan"), -0.0, 0.0
                x = x.to(device)
                lo = x.float().topk(200, dim=1).values[:, -1].to(dtype)  # exact bounds (NaN-free rows 1, 2)
                # row 0 takes every entry: more candidates than the one-pass buffers hold (its fallback runs)
                lo[0] = float("-inf")
                if path == "triton":
                    got = _topk_triton.select_16bit_1pass(x, 150, lo, 200 / m, block=block, num_warps=num_warps)[0]
                else:
                    got = _topk_triton.select_16bit(x, 150, lo, block=block, num_warps=num_warps)
                ref = torch.sort(x.float().nan_to_num(float("-inf")), dim=1, descending=True, stable=True)
                ref = (ref.indices[:, :150].sort(dim=1).values + torch.arange(rows, device=device)[:, None] * m)
                if got is None or not torch.equal(got, ref.reshape(-1)):
                    raise RuntimeError("the Triton selection disagrees with a stable sort on a check problem")
                if path == "triton":  # the fast path too: rows 1.. alone, exact bounds
                    got = _topk_triton.select_16bit_1pass(x[1:], 150, lo[1:], 200 / m, block=block,
                                                          num_warps=num_warps)[0]
                    if not torch.equal(got, ref[1:].reshape(-1) - m):
                        raise RuntimeError("the Triton selection disagrees with a stable sort on a check problem")
            ok = True
        except Exception as err:  # any failure means: use the torch path
            import warnings

            warnings.warn(f"batch_topk_rows: Triton selection unusable ({err}); using the torch path", stacklevel=3)
        _SELECT_CHECKED[key] = ok
    return _SELECT_CHECKED[key]


def triton_candidates(flat: torch.Tensor, backend: CandidatesBackend = "auto") -> bool:
    """Whether the candidate step on ``flat`` runs the Triton passes under ``backend`` (``auto``: when
    ``ops._topk_triton`` can run on ``flat``'s device)."""
    if backend == "torch":
        return False
    import lightning_opt.ops._topk_triton as _topk_triton

    return backend == "triton" or _topk_triton.available(flat)


def candidates_ge(flat: torch.Tensor, lo_rows: torch.Tensor, row_len: int,
                  backend: CandidatesBackend = "auto", *, block: int = _TRITON_BLOCK,
                  num_warps: int = _TRITON_NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat indices and values of the entries with ``flat[i] >= lo_rows[i // row_len]``.

    Triton (a counting pass and an ordered compaction pass, see ``ops._topk_triton``) on CUDA when available,
    else ``nonzero``; the results are identical. One host sync: the count sizes the result.

    Args:
        flat: 1-D scores.
        lo_rows: per-row bounds (``flat``'s dtype).
        row_len: entries per row.
        backend: ``auto`` (Triton where it runs), ``torch`` or ``triton``.
        block: the Triton passes' entries per program (a power of two; unused by the torch path).
        num_warps: the Triton passes' warps per program (a power of two; unused by the torch path).
    """
    if triton_candidates(flat, backend):
        import lightning_opt.ops._topk_triton as _topk_triton

        return _topk_triton.compact_ge(flat, lo_rows, row_len, block=block, num_warps=num_warps)
    lo = lo_rows.to(flat.dtype)
    mask = (flat.view(-1, row_len) >= lo[:, None]).view(-1) if lo.numel() > 1 else flat >= lo.view(())
    idx = torch.nonzero(mask).squeeze(1)  # host sync: the count sizes the result
    return idx, flat[idx]


@torch.no_grad()
def _select_rows(x2d: torch.Tensor, n_keep: int, select_backend: SelectBackend = "auto",
                 candidates_backend: CandidatesBackend = "auto",
                 threshold_method: ThresholdMethod = "auto", *, block: int | None = None,
                 num_warps: int | None = None) -> torch.Tensor:
    """Sorted flat indices into ``x2d`` of the ``n_keep`` largest entries of every row (``block`` x
    ``num_warps``: the Triton passes' launch shape, ``None``: the path's default)."""
    rows, m = x2d.shape
    device = x2d.device
    if n_keep == 0 or rows == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if n_keep == m:
        return torch.arange(rows * m, device=device)
    lo, expect = _row_lower_bounds(x2d, n_keep)
    lo = lo.to(x2d.dtype)
    path = _select_path(x2d, select_backend, block=block, num_warps=num_warps)
    block, num_warps = _launch_shape(path, block, num_warps)
    launch = {"block": block, "num_warps": num_warps}
    if path == "triton":  # no host sync: fixed shapes, a device-side fallback
        import lightning_opt.ops._topk_triton as _topk_triton

        return _topk_triton.select_16bit_1pass(x2d, n_keep, lo, expect, **launch)[0]
    if path == "triton_2pass":
        import lightning_opt.ops._topk_triton as _topk_triton

        idx = _topk_triton.select_16bit(x2d, n_keep, lo, **launch)
        if idx is not None:
            return idx
        # a row with fewer than n_keep entries at or above its bound (unlucky sample, or NaN): the paths below
        # lower that row's bound (and name rows without n_keep non-NaN entries)
    flat = x2d.reshape(-1)
    for _attempt in range(2):
        # one host sync: the candidate count sizes every buffer after it
        cand, vals = candidates_ge(flat, lo, m, candidates_backend, **launch)
        if rows == 1:
            counts_host = [cand.numel()]  # already on the host: no second sync
        else:
            row_of = torch.div(cand, m, rounding_mode="floor")
            counts_host = torch.bincount(row_of, minlength=rows).tolist()  # tiny; rows ints
        short = [r for r, c in enumerate(counts_host) if c < n_keep]
        if not short:
            break
        if _attempt == 1:
            raise ValueError(
                f"BatchTopK: row(s) {short[:5]} have fewer than {n_keep} non-NaN entries; "
                "check the pre-activations for NaN or lower k."
            )
        lo = lo.clone()
        lo[short] = float("-inf")
    method = threshold_method
    if method == "auto":
        method = "histogram" if x2d.is_cuda and rows > 1 else "topk"
    if method == "histogram" and vals.dtype in _KEY_BITS and rows * _BINS <= _MAX_BINS:
        return _keep_by_histogram(cand, vals, rows, m, n_keep)
    return _keep_by_topk(cand, vals, counts_host, n_keep)


def _keep_by_topk(cand: torch.Tensor, vals: torch.Tensor, counts_host: list[int], n_keep: int) -> torch.Tensor:
    """Reference threshold step: a top-k over each row's candidates, then the tie quota (any dtype)."""
    kept: list[torch.Tensor] = []
    start = 0
    for c in counts_host:
        seg_vals = vals[start : start + c]
        seg_idx = cand[start : start + c]
        rest = c - n_keep + 1
        if rest < n_keep:
            # the n-th largest is the (c - n + 1)-th smallest: a smaller top-k on the negated values
            t = -torch.topk(-seg_vals, rest, sorted=False).values.min()
        else:
            t = torch.topk(seg_vals, n_keep, sorted=False).values.min()
        gt = seg_vals > t
        eq = seg_vals == t
        quota = n_keep - gt.sum()
        keep = gt | (eq & (torch.cumsum(eq, 0) <= quota))
        # Exactly n_keep are True; a stable sort moves them first without a host sync.
        order = torch.sort((~keep).to(torch.uint8), stable=True).indices[:n_keep]
        kept.append(seg_idx[order])
        start += c
    return torch.cat(kept) if len(kept) > 1 else kept[0]


def _order_keys(v: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 keys with the order of the float values ``v`` (bf16/fp16: 16 bits, fp32: 32 bits).

    Sign-magnitude bits become an unsigned order: positives get the top bit set, negatives are reflected.
    ``-0`` gets ``+0``'s key (they are equal values, hence ties). NaN must not occur (never a candidate)."""
    bits = _KEY_BITS[v.dtype]
    top = 1 << (bits - 1)
    full = (1 << bits) - 1
    ints = torch.int16 if bits == 16 else torch.int32
    b = v.view(ints).to(torch.int64) & full
    key = torch.where(b >= top, full - b, b + top)
    return torch.where(b == top, top, key)


def _hist_cut(bins: torch.Tensor, valid: torch.Tensor | None, rows: int, row: torch.Tensor,
              need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the largest bin ``t`` with at least ``need`` entries in bins ``>= t`` and the count in bins
    ``> t``. ``bins`` in ``[0, 2**16)``; entries with ``valid`` False are ignored."""
    slot = row * _BINS + bins
    if valid is not None:
        slot = torch.where(valid, slot, rows * _BINS)  # a dump bin past the end
    # index_add, not bincount: CUDA bincount reads the maximum on the host to size its output (a sync)
    hist = torch.zeros(rows * _BINS + 1, dtype=torch.int64, device=bins.device)
    hist = hist.index_add_(0, slot, torch.ones_like(slot))[: rows * _BINS].view(rows, _BINS)
    at_or_above = hist.flip(1).cumsum(1).flip(1)  # [rows, bins]: entries in bins >= b
    t = (at_or_above >= need[:, None]).sum(1) - 1  # non-increasing in b, so a count finds the last bin
    padded = torch.cat([at_or_above, at_or_above.new_zeros(rows, 1)], dim=1)
    above = padded.gather(1, (t + 1)[:, None]).squeeze(1)
    return t, above


def _keep_by_histogram(cand: torch.Tensor, vals: torch.Tensor, rows: int, m: int, n_keep: int) -> torch.Tensor:
    """Threshold step without sorting: the exact cut-off key per row from a 2**16-bin histogram of the
    candidates' order keys (two levels for fp32), then keep ``> t`` and the first ties ``== t`` by flat index.
    Fixed-size output (``rows * n_keep``, rows in order, ascending inside a row): no host sync."""
    key = _order_keys(vals)
    row = torch.div(cand, m, rounding_mode="floor") if rows > 1 else torch.zeros_like(cand)
    need = torch.full((rows,), n_keep, dtype=torch.int64, device=cand.device)
    if _KEY_BITS[vals.dtype] == 16:
        t, above = _hist_cut(key, None, rows, row, need)
    else:  # fp32: the high 16 bits pick a bin, the low 16 bits of the entries in that bin refine it
        hi = key >> 16
        t_hi, above_hi = _hist_cut(hi, None, rows, row, need)
        t_lo, above_lo = _hist_cut(key & (_BINS - 1), hi == t_hi[row], rows, row, need - above_hi)
        t, above = (t_hi << 16) | t_lo, above_hi + above_lo
    cut = t[row]
    gt = key > cut
    eq = key == cut
    rank = torch.cumsum(eq, 0)
    if rows > 1:  # tie rank inside the row: subtract the ties of the rows before
        per_row = torch.zeros(rows, dtype=torch.int64, device=cand.device).index_add_(0, row, eq.long())
        rank = rank - (torch.cumsum(per_row, 0) - per_row)[row]
    keep = gt | (eq & (rank <= (n_keep - above)[row]))
    total = rows * n_keep
    # every row keeps exactly n_keep and rows come in order: the running count is the output slot
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, total)
    out = torch.empty(total + 1, dtype=cand.dtype, device=cand.device)
    return out.scatter_(0, slot, cand)[:total]


def batch_topk_rows(
    x2d: torch.Tensor,
    n_keep: int,
    *,
    select_backend: SelectBackend = "auto",
    candidates_backend: CandidatesBackend = "auto",
    threshold_method: ThresholdMethod = "auto",
    triton_block: int | None = None,
    triton_num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``n_keep`` largest entries of every row of ``x2d``.

    With one row this is BatchTopK over a whole batch (``n_keep = k * tokens``); with one row per layer it
    is per-layer BatchTopK. The three path options select the same indices; ``"auto"`` takes the one-pass Triton
    selection (no host sync) where it runs.
    So do the Triton passes' launch shapes.

    Args:
        x2d: ``[rows, entries]`` scores (e.g. pre-activations); gradients flow into the returned values.
        n_keep: entries kept per row.
        select_backend: for bf16/fp16 ``x2d``: ``auto`` (the one-pass Triton selection where it runs and passes
            its self-check), ``triton`` (insist on it), ``triton_2pass`` (the two-pass Triton selection: one host
            sync) or ``candidates`` (the candidate and threshold steps).
        candidates_backend: the candidate step: ``auto`` (Triton passes where they run), ``torch``
            (``nonzero``) or ``triton``.
        threshold_method: the threshold step: ``auto`` (``histogram`` for several rows on CUDA, else
            ``topk``), ``histogram`` (a 2**16-bin histogram of order keys) or ``topk`` (a top-k of each row's
            candidates).
        triton_block: entries per program of the Triton passes of the path taken, a power of two; ``None``:
            that path's default (one-pass stash pass 2048, see ``ops._topk_triton.STASH_BLOCK``; two-pass
            selection and candidate step 2048).
        triton_num_warps: warps per program of those passes, a power of two; ``None``: the path's default
            (8 and 4).

    Returns:
        ``(flat_indices, values)``: int64 indices into ``x2d.reshape(-1)``, ascending within each row and
        rows in order, and ``x2d.reshape(-1)[flat_indices]`` (differentiable).

    Example:
        >>> idx, val = batch_topk_rows(torch.tensor([[3.0, 1.0, 2.0, 0.5]]), 2)
        >>> idx.tolist(), val.tolist()
        ([0, 2], [3.0, 2.0])
    """
    if x2d.dim() != 2:
        raise ValueError(f"batch_topk_rows expects a 2-D tensor [rows, entries], got shape {tuple(x2d.shape)}")
    _check_k(n_keep, x2d.shape[1], "entries kept per row")
    check_topk_options(select_backend, candidates_backend, threshold_method)
    from lightning_opt.ops._topk_triton import check_launch

    check_launch(_TRITON_BLOCK if triton_block is None else triton_block,
                 _TRITON_NUM_WARPS if triton_num_warps is None else triton_num_warps)
    idx = _select_rows(x2d.detach(), n_keep, select_backend, candidates_backend, threshold_method,
                       block=triton_block, num_warps=triton_num_warps)
    return idx, _TakeUnique.apply(x2d.reshape(-1), idx)


def token_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``k`` largest entries along the last dimension of every row (TopK per token).

    Returns ``(flat_indices, values)`` into ``x.reshape(-1)``, ``k`` per row, in row order. Ties inside a
    row follow ``torch.topk``.
    """
    _check_k(k, x.shape[-1], "k")
    m = x.shape[-1]
    rows = x.reshape(-1, m)
    local = torch.topk(rows.detach(), k, dim=1, sorted=False).indices
    flat = (local + torch.arange(rows.shape[0], device=x.device)[:, None] * m).reshape(-1)
    return flat, _TakeUnique.apply(x.reshape(-1), flat)


class _TakeUnique(torch.autograd.Function):
    """``flat[idx]`` for distinct indices. Its backward is a plain scatter into zeros; ``flat[idx]``'s own
    backward is ``index_put_(accumulate=True)``, which on CUDA sorts the indices first to add duplicates."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(idx)
        ctx.numel = flat.numel()
        return flat[idx]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        return torch.zeros(ctx.numel, dtype=grad.dtype, device=grad.device).scatter_(0, idx, grad), None


def scatter_dense(indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A zero tensor shaped like ``like`` holding ``values`` at ``indices`` (differentiable in values)."""
    flat = torch.zeros(like.numel(), dtype=values.dtype, device=values.device)
    # in place: the out-of-place scatter would first copy the whole zero tensor (autograd is fine with it)
    return flat.scatter_(0, indices, values).view(like.shape)


class JumpReLUFunction(torch.autograd.Function):
    """``x * (x > threshold)`` with straight-through gradients.

    * d/dx: ``1[x > threshold]`` (the usual pass-through of kept entries).
    * d/dthreshold: ``-(threshold / bandwidth) * K((x - threshold) / bandwidth)`` with the rectangle kernel
      ``K(u) = 1[|u| < 1/2]`` (Rajamanoharan et al., 2024), summed over broadcast dimensions.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_x = grad_th = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out * (x > threshold).to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            near = ((x - threshold).abs() < 0.5 * eps).to(grad_out.dtype)
            g = grad_out * near * (-(threshold.to(grad_out.dtype)) / eps)
            # Reduce over the dimensions the threshold was broadcast along.
            while g.dim() > threshold.dim():
                g = g.sum(0)
            for d, size in enumerate(threshold.shape):
                if size == 1 and g.shape[d] != 1:
                    g = g.sum(d, keepdim=True)
            grad_th = g.to(threshold.dtype)
        return grad_x, grad_th, None


def jumprelu(x: torch.Tensor, threshold: torch.Tensor, bandwidth: float = 0.01) -> torch.Tensor:
    """JumpReLU with straight-through threshold gradients; see :class:`JumpReLUFunction`."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return JumpReLUFunction.apply(x, threshold, bandwidth)
