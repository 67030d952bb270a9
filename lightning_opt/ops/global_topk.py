"""Exact BatchTopK over the union of all ranks' tokens.

``global_batch_topk(x, k, group)`` keeps the ``k * tokens_total`` largest entries of the batch that is the
concatenation (in rank order) of every rank's ``x``, and zeroes the rest. It moves candidate *values* only,
never ``x``. ``tokens_total`` defaults to the sum of the ranks' token counts; pass it when ranks hold different
features of the same tokens.

Groups follow torch's convention: ``group=None`` is the default process group when ``torch.distributed`` is
initialised (a single process otherwise); ``group="local"`` selects over this process's ``x`` alone, without
communication, even inside an initialised group.

Tie rule: entries are ordered by (value descending, rank ascending, row-major flat index within the rank
ascending), i.e. by (value desc, flat index asc) in the concatenated batch. This is what a stable descending
sort of the concatenated, flattened batch gives, which is the reference the tests use. NaN entries are never
kept.

Algorithm (per rank, ``N`` local entries, ``K = k * tokens_total``):

1. Lower bound ``lo``: each rank estimates, from a fixed-seed random sample of its entries, a value that about
   ``1.1 K / world`` of its entries reach (plus a binomial margin), and the group takes the minimum (scalar
   collective).
2. Candidates: the flat indices with ``x >= lo``, ascending, and every rank's count. On CUDA with Triton a
   count pass, the counts' exchange and an ordered compaction pass: one host sync reads every rank's count;
   else ``nonzero`` (``ops.topk.candidates_ge``), a host sync for the local count and one for the exchanged
   counts. If fewer than ``K`` entries reach ``lo``
   over the group (an unlucky sample), the candidates are the entries at or above the local ``min(K, N)``-th
   largest value instead (exact, slower).
3. Threshold ``t``: the ``K``-th largest of all candidate values (``all_gather`` of the padded values; a top-k
   of the smaller side). Every element ``>= t`` on any rank is a candidate, so ``t`` is the exact ``K``-th
   largest of the batch.
4. Ties at ``t`` are shared out in rank order, then flat order (``all_gather`` of two counts per rank).
5. Output: zeros with the kept candidates scattered back, so gradients reach exactly the kept entries.

Ranks that hold different *features* of the same tokens (feature-sharded encoders) can instead gather every
rank's candidates once (:func:`shard_candidates`) and pick the same ``K`` entries from that pool on every rank
(:func:`top_positions`, same tie rule): no tie-count exchange, no second gather.

Bytes moved per rank and call (world ``W``): ``W * 24`` (token counts, sizes and bounds) ``+ W * 8`` (candidate
counts) ``+ W * C_max * elem_size`` (candidate values, ``C_max`` = the largest candidate count, about
``1.1 K / W``) ``+ W * 16`` (tie counts). For 2 ranks x 4096 tokens, k=200, float32: about 8 MB, against
3.2 GB for an ``all_gather`` of ``x`` at 98,304 features.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import torch
import torch.distributed as dist

from lightning_opt.ops.topk import (
    CandidatesBackend,
    _order_keys16,
    _sample_rank,
    candidates_ge,
    check_topk_options,
    triton_candidates,
)

__all__ = [
    "global_batch_topk", "batch_topk_threshold_sparse", "shard_candidates", "shard_candidates_padded", "top_positions",
    "all_gather",
]

_SAMPLE_SIZE = 1 << 18
_SAMPLE_SEED = 0x5EED
# ``group`` of the public functions: a process group, ``None`` (the default group when torch.distributed is
# initialised, else this process alone) or ``"local"`` (this process alone)
Group = Union["dist.ProcessGroup", Literal["local"], None]
_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    # A private generator: sampling must not advance the user's RNG (DDP ranks would drift apart).
    gen = _generators.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        _generators[device] = gen
    gen.manual_seed(_SAMPLE_SEED)
    return gen


def _resolve_group(group: Group) -> dist.ProcessGroup | None:
    """The process group ``group`` names, ``None`` meaning this process alone (see the module docstring)."""
    if isinstance(group, str):
        if group != "local":
            raise ValueError(f"group={group!r}: pass a process group, None (the default group) or 'local'")
        return None
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return group


def _group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in a resolved group (``None``: this process alone)."""
    if group is None:
        return 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "global_batch_topk got a process group but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group first, or pass group='local' for a local BatchTopK."
        )
    return dist.get_world_size(group)


def all_gather(t: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on every rank) stacked in rank order, ``[world, *t.shape]``, in one
    collective (no gradient)."""
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    # torch >= 2.13 renames all_gather_into_tensor to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous().view(-1), group=group)
    return out.view(world, *t.shape)


def _lower_bound(flat: torch.Tensor, frac: float) -> torch.Tensor:
    """A value that about ``frac * 1.1`` of ``flat`` reaches (plus a margin), estimated from a fixed-seed sample."""
    n = flat.numel()
    if n <= _SAMPLE_SIZE:
        sample = flat
    else:
        pos = torch.randint(0, n, (_SAMPLE_SIZE,), device=flat.device, generator=_generator(flat.device))
        sample = flat[pos]
    return torch.topk(sample.float(), _sample_rank(sample.numel(), frac), sorted=False).values.min()


def _kth_largest(pool: torch.Tensor, kth: int) -> torch.Tensor:
    """The ``kth`` largest value of a 1-D tensor (``1 <= kth <= pool.numel()``): a top-k of the smaller side
    (as fast as a full sort of the pool)."""
    rest = pool.numel() - kth + 1
    if rest < kth:  # the kth largest is the rest-th smallest: select the smaller side
        return torch.topk(pool, rest, largest=False, sorted=False).values.max()
    return torch.topk(pool, kth, sorted=False).values.min()


def _select(
    x: torch.Tensor,
    k: int,
    group: dist.ProcessGroup | None,
    tokens_total: int | None = None,
    numel_total: int | None = None,
    candidates_backend: CandidatesBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Candidate flat indices (ascending) of this rank's ``x``, a keep mask over them, and kept counts.

    A ``None`` mask means every candidate is kept. The third item is a ``[world]`` int64 device tensor: how
    many entries each rank of ``group`` keeps (from the tie statistics, no extra collective). Every rank runs
    the same collectives in the same order, so early exits depend only on group-wide quantities. ``group`` is
    resolved (``None``: this process alone).
    """
    check_topk_options(candidates_backend=candidates_backend)
    if x.dim() != 2:
        raise ValueError(f"global_batch_topk expects x of shape [tokens, features], got {tuple(x.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int (active features per token), got {k!r}")
    if tokens_total is not None and (isinstance(tokens_total, bool) or not isinstance(tokens_total, int)):
        raise ValueError(f"tokens_total must be an int or None, got {tokens_total!r}")
    if numel_total is not None and (
        isinstance(numel_total, bool) or not isinstance(numel_total, int) or tokens_total is None
    ):
        raise ValueError(
            f"numel_total must be an int and comes with tokens_total, got numel_total={numel_total!r}, "
            f"tokens_total={tokens_total!r}"
        )
    tokens, features = x.shape
    flat = x.detach().reshape(-1)
    n = flat.numel()
    world = _group_size(group)
    device = x.device
    empty_idx = torch.empty(0, dtype=torch.long, device=device)

    # Expected kept fraction of this rank's entries (only sizes the sample bound; exactness never depends on it).
    frac = k / features if tokens_total is None else k * tokens_total / max(1, n * world)
    lo_local = _lower_bound(flat, frac) if n > 0 and frac < 1 else None
    if world > 1 and tokens_total is not None and numel_total is not None:
        # Both totals known: only the bound crosses ranks, and nothing waits for the device here.
        lo_t = torch.full((), float("inf"), dtype=torch.float32, device=device)
        if lo_local is not None:
            lo_t = lo_local.float().reshape(())
        dist.all_reduce(lo_t, op=dist.ReduceOp.MIN, group=group)
        lo = lo_t.to(x.dtype)
        gathered = None
    elif world > 1:
        head = torch.tensor([float(tokens), float(n), float("inf")], dtype=torch.float64, device=device)
        if lo_local is not None:
            head[2] = lo_local
        gathered = all_gather(head, group, world)
        # Host sync: K = k * tokens_total sizes the selection.
        totals = gathered[:, :2].sum(0).tolist()
        numel_total = int(totals[1])
        tokens_total = int(totals[0]) if tokens_total is None else tokens_total
        lo = gathered[:, 2].min().to(x.dtype)
    else:
        numel_total = n
        tokens_total = tokens if tokens_total is None else tokens_total
        lo = None if lo_local is None else lo_local.to(x.dtype)
        gathered = None
    big_k = k * tokens_total
    if big_k == 0:
        return empty_idx, None, torch.zeros(world, dtype=torch.long, device=device)
    if big_k >= numel_total:
        if world > 1 and gathered is None:
            gathered = all_gather(
                torch.tensor([0.0, float(n)], dtype=torch.float64, device=device), group, world
            )
        sizes = gathered[:, 1].long() if world > 1 else torch.tensor([n], device=device)
        return torch.arange(n, device=device), None, sizes
    if lo is None:  # no bound estimated (not reached with n > 0 and K < numel): use the exact fallback
        lo = torch.tensor(float("inf"), dtype=x.dtype, device=device)

    # Candidates at or above the sampled bound. nonzero syncs with the host once: the candidate count sizes
    # every buffer after it.
    # The bound is the group's minimum, so this rank may see more than its own estimate: size by the larger.
    if n > 0:
        idx, counts_host = _candidates_exchanged(flat, lo.view(1), group, world, candidates_backend)
    else:
        idx, counts_host = empty_idx, _counts_of_ranks(0, group, world, device)
    if sum(counts_host) < big_k:
        idx, counts_host = _fallback_candidates(flat, big_k, group, world)
    vals = flat[idx]

    if world > 1:
        padded = torch.full((max(counts_host),), float("-inf"), dtype=vals.dtype, device=device)
        padded[: vals.numel()] = vals
        pool = all_gather(padded, group, world).view(-1)
    else:
        pool = vals
    # Every entry >= the true K-th largest is a candidate, so the K-th largest candidate is exact. Padding
    # (-inf) can only tie with a -inf threshold, and ties are counted over real entries below.
    t = _kth_largest(pool, big_k)

    gt = vals > t
    eq = vals == t
    stats = torch.stack([gt.sum(), eq.sum()])[None]
    if world > 1:
        stats = all_gather(stats[0], group, world)
    rank = dist.get_rank(group) if world > 1 else 0
    ties_needed = big_k - stats[:, 0].sum()
    # Ties go to earlier ranks first, then to smaller flat indices (idx ascends).
    quotas = (ties_needed - (torch.cumsum(stats[:, 1], 0) - stats[:, 1])).clamp(min=0)
    keep = gt | (eq & (torch.cumsum(eq.to(torch.long), 0) <= quotas[rank]))
    return idx, keep, stats[:, 0] + torch.minimum(stats[:, 1], quotas)


def global_batch_topk(
    x: torch.Tensor,
    k: int,
    group: Group = None,
    tokens_total: int | None = None,
    *,
    candidates_backend: CandidatesBackend = "auto",
) -> torch.Tensor:
    """Keep the ``k * tokens_total`` largest entries over all ranks' batches; zero the rest.

    Args:
        x: ``[tokens_local, features]`` on each rank (``features`` equal on every rank, ``tokens_local``
            may differ).
        k: mean number of active features per token.
        group: process group whose ranks share the budget. ``None`` (torch's convention) is the default
            process group when ``torch.distributed`` is initialised, so inside DDP every rank selects from
            the global batch; without an initialised group it is this process alone. ``"local"`` selects over
            this process's ``x`` only (no communication): per-rank BatchTopK.
        tokens_total: distinct tokens over the group, when ranks hold different *features* of the same tokens
            (e.g. encoders sharded over features); default: the sum of ``x.shape[0]`` over ranks.
        candidates_backend: the candidate step (``auto``, ``torch`` or ``triton``; see
            :func:`~lightning_opt.ops.topk.batch_topk_rows`); every choice selects the same entries.

    Returns:
        A tensor like ``x`` that equals ``x`` at the kept entries and is zero elsewhere. Gradients reach the
        kept entries only. Ties follow (value desc, rank asc, flat index asc); NaN entries are never kept.

    Example:
        >>> x = torch.tensor([[3.0, 1.0, 2.0], [0.5, 4.0, 2.0]])
        >>> global_batch_topk(x, k=1)
        tensor([[3., 0., 0.],
                [0., 4., 0.]])
    """
    idx, keep, _ = _select(x, k, _resolve_group(group), tokens_total, candidates_backend=candidates_backend)
    if keep is None and idx.numel() == x.numel():
        return x
    flat = x.reshape(-1)
    vals = flat[idx] if keep is None else torch.where(keep, flat[idx], 0)
    # Scatter the candidates (non-kept ones multiplied by 0) into zeros: no second host sync, and the
    # gradient of every non-kept entry is exactly zero.
    # (index_put_ in place: the out-of-place form would first copy the whole zero tensor)
    out = torch.zeros(x.numel(), dtype=x.dtype, device=x.device).index_put_((idx,), vals)
    return out.view_as(x)


def batch_topk_threshold_sparse(
    x: torch.Tensor,
    k: int,
    group: Group = None,
    tokens_total: int | None = None,
    return_counts: bool = False,
    numel_total: int | None = None,
    *,
    candidates_backend: CandidatesBackend = "auto",
) -> Any:
    """Like :func:`global_batch_topk` (the same ``group`` rule: ``None`` is the default process group when
    one is initialised, ``"local"`` this process alone) but return the kept entries as ``(flat_indices, values)``.

    ``flat_indices`` index ``x.reshape(-1)`` and ascend; ``values`` carry gradients to ``x``. Useful to feed
    :func:`lightning_opt.ops.sparse_decode.sparse_decode` without densifying.

    With ``return_counts=True`` the result is ``(flat_indices, values, counts)`` where ``counts`` is a host
    list of how many entries every rank of ``group`` keeps (rank order), read in the same host sync that
    sizes the result: a later gather of the kept entries needs no count exchange of its own.

    ``numel_total`` (with ``tokens_total``): the sum of ``x.numel()`` over the group, when the caller knows it
    (e.g. equal feature shards). The first exchange then needs no host sync. It must be right: the
    selection trusts it.
    """
    idx, keep, counts = _select(x, k, _resolve_group(group), tokens_total, numel_total, candidates_backend)
    counts_host = counts.tolist() if return_counts else None  # host sync (sizes the gathers after this)
    if keep is not None:
        idx = idx[keep]  # host sync: the kept count sizes the result (short wait after the one above)
    if return_counts:
        return idx, x.reshape(-1)[idx], counts_host
    return idx, x.reshape(-1)[idx]


def _shard_bound(x: torch.Tensor, k: int, group: dist.ProcessGroup | None, tokens_total: int, always: bool):
    """The opening of the feature-sharded candidate steps: ``(world, flat, K, kept fraction, lo)``, ``lo`` the
    group's minimum sampled bound as a float32 device scalar (an all-reduce, no host sync: the sizes are known).
    Where nothing needs selecting (no entries, or ``K`` covers them all) ``lo`` is ``+inf`` after the same
    all-reduce with ``always`` (so every rank runs the same collectives), else ``None`` without any collective
    (the caller returns before communicating; the ranks of equal shards all take that branch together)."""
    world = _group_size(group)
    flat = x.detach().reshape(-1)
    n = flat.numel()
    big_k = k * tokens_total
    frac = big_k / max(1, n * world)
    selecting = n > 0 and frac < 1
    if not selecting and not always:
        return world, flat, big_k, frac, None
    lo = torch.full((), float("inf"), dtype=torch.float32, device=x.device)
    if selecting:
        lo = _lower_bound(flat, frac).float().reshape(())
    if world > 1:
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return world, flat, big_k, frac, lo


def shard_candidates(
    x: torch.Tensor, k: int, group: Group, tokens_total: int, candidates_backend: CandidatesBackend = "auto"
) -> tuple[torch.Tensor, list[int]]:
    """Candidates of a rank that holds ``1/W`` of the *features* of the same tokens as the other ranks.

    Steps 1-2 of the algorithm above for equal feature shards: the union of every rank's candidates holds
    the global top-``k * tokens_total``. Returns this rank's candidate flat indices (ascending) and every
    rank's candidate count in rank order (host list: it sizes the gather that follows). One host sync (the
    exchanged counts) with the Triton candidate passes, two with the torch path (the local count first); the
    pool is then selected with :func:`top_positions` on each rank.
    """
    group = _resolve_group(group)
    world, flat, big_k, frac, lo = _shard_bound(x, k, group, tokens_total, always=True)
    n = flat.numel()
    if n > 0 and frac < 1:
        idx, counts = _candidates_exchanged(flat, lo.to(x.dtype).view(1), group, world, candidates_backend)
    else:
        idx, counts = torch.arange(n, device=x.device), _counts_of_ranks(n, group, world, x.device)
    if sum(counts) < big_k and n > 0:
        idx, counts = _fallback_candidates(flat, big_k, group, world)
    return idx, counts


def shard_candidates_padded(
    x: torch.Tensor, k: int, group: Group, tokens_total: int, candidates_backend: CandidatesBackend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`shard_candidates` without a host sync: fixed-size buffers, checked later.

    The capacity ``cap`` comes from the sample's estimate (1.3x plus 1024, the same on every rank of equal
    shards), so nothing waits for the device: the count and the ordered compaction (Triton passes on CUDA,
    ``nonzero_static`` otherwise) fill the first ``min(count, cap)`` slots. Returns ``(idx, counts, ok)``: this
    rank's candidate flat indices, ascending, ``-1`` past its count (``[cap]`` int64); every rank's count
    (``[world]`` int64, device); and a device flag, true when the ranks' buffers hold every candidate (no count
    above ``cap``) and at least ``k * tokens_total`` of them, i.e. when the pool holds the exact global top-K.
    The caller reads ``ok`` with a host sync it needs anyway and falls back to :func:`shard_candidates` when it
    is false (rare: an unlucky sample). ``None`` when there is nothing to select (``K`` covers every entry).
    """
    group = _resolve_group(group)
    world, flat, big_k, frac, lo = _shard_bound(x, k, group, tokens_total, always=False)
    n = flat.numel()
    if lo is None:
        return None
    s = min(n, _SAMPLE_SIZE)
    cap = min(n, int(1.3 * _sample_rank(s, frac) / s * n) + 1024)
    lo_x = lo.to(x.dtype).view(1)
    import lightning_opt.ops._topk_triton as _topk_triton

    if triton_candidates(flat, candidates_backend):
        pre, count = _topk_triton.count_ge(flat, lo_x, n)
        idx, _ = _topk_triton.compact_counted(flat, lo_x, n, pre, cap, capped=True)
        idx = torch.where(torch.arange(cap, device=flat.device) < count, idx, -1)
    else:
        hit = flat >= lo_x
        count = hit.sum().view(1)
        idx = torch.nonzero_static(hit, size=cap, fill_value=-1).squeeze(1)
    counts = all_gather(count, group, world).view(-1) if world > 1 else count
    ok = (counts <= cap).all() & (counts.sum() >= big_k)
    return idx, counts, ok


def _candidates_exchanged(flat: torch.Tensor, lo: torch.Tensor, group: dist.ProcessGroup | None, world: int,
                          backend: CandidatesBackend = "auto") -> tuple[torch.Tensor, list[int]]:
    """This rank's ascending candidate indices (``flat >= lo``) and every rank's candidate count (host list).

    With the Triton passes the local count is a device tensor after the counting pass: it is exchanged before
    the compaction, so the one host sync reads every rank's count. The torch path syncs for the local count
    (``nonzero``) and again for the exchanged counts."""
    import lightning_opt.ops._topk_triton as _topk_triton

    n = flat.numel()
    if triton_candidates(flat, backend):
        pre, count = _topk_triton.count_ge(flat, lo, n)
        counts = (all_gather(count, group, world).view(-1) if world > 1 else count).tolist()  # host sync
        rank = dist.get_rank(group) if world > 1 else 0
        return _topk_triton.compact_counted(flat, lo, n, pre, counts[rank])[0], counts
    idx, _ = candidates_ge(flat, lo, n, backend)  # host sync: the count
    return idx, _counts_of_ranks(idx.numel(), group, world, flat.device)


def _counts_of_ranks(count: int, group: dist.ProcessGroup | None, world: int, device: torch.device) -> list[int]:
    """Every rank's ``count`` in rank order, as a host list (a host sync: the counts size what follows)."""
    t = torch.tensor([count], dtype=torch.long, device=device)
    return (all_gather(t, group, world).view(-1) if world > 1 else t).tolist()


def _fallback_candidates(flat: torch.Tensor, big_k: int, group: dist.ProcessGroup | None,
                         world: int) -> tuple[torch.Tensor, list[int]]:
    """Candidates when the sampled bound left fewer than ``big_k`` over the group: every entry at or above this
    rank's ``min(K, N)``-th largest value (ties included) holds this rank's share of the global top-K."""
    n = flat.numel()
    if n > 0:
        idx = torch.nonzero(flat >= _kth_largest(flat, min(big_k, n))).squeeze(1)
    else:
        idx = torch.empty(0, dtype=torch.long, device=flat.device)
    return idx, _counts_of_ranks(idx.numel(), group, world, flat.device)


def top_positions(values: torch.Tensor, valid: torch.Tensor | None, n_keep: int) -> torch.Tensor:
    """Ascending positions of the ``n_keep`` largest ``values`` (ties: smaller position first).

    ``valid`` (bool, like ``values``) excludes padding. Needs at least ``n_keep`` valid, non-NaN entries.
    No host sync: the output size is ``n_keep``. 16-bit floats find the exact cut-off in a sort of their int32
    order keys; other dtypes use a top-k.
    """
    n = values.numel()
    device = values.device
    if values.dtype in (torch.bfloat16, torch.float16):
        key = _order_keys16(values)
        if valid is not None:
            key = torch.where(valid, key, -1)  # padding sorts below every real key
        # the n_keep-th largest key from one sort of the int32 keys, not a 2**16-bin histogram: its atomics
        # crowd the few bins the top values share
        sorted_keys = torch.sort(key).values
        cut = sorted_keys[n - n_keep]
        above = n - torch.searchsorted(sorted_keys, cut.view(1), right=True)
        gt, eq = key > cut, key == cut
    else:
        v = values if valid is None else torch.where(valid, values, float("-inf"))
        t = _kth_largest(v, n_keep)
        gt, eq = v > t, v == t
        if valid is not None:
            gt, eq = gt & valid, eq & valid
        above = gt.sum()
    keep = gt | (eq & (torch.cumsum(eq, 0) <= n_keep - above))
    # exactly n_keep are kept, in position order: the running count is the output slot
    slot = torch.where(keep, torch.cumsum(keep, 0) - 1, n_keep).clamp_(max=n_keep)
    # zeros, not empty: with fewer than n_keep valid entries (a pool the caller will discard) every position
    # must still index ``values``
    out = torch.zeros(n_keep + 1, dtype=torch.long, device=device)
    return out.scatter_(0, slot, torch.arange(n, device=device))[:n_keep]
