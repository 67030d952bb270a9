"""Differentiable collectives shared by the CLT strategies (one place for every all-reduce they issue)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_opt.ops.global_topk import _all_gather


class _SumForward(torch.autograd.Function):
    """Forward: all-reduce sum over ``group``. Backward: the incoming gradient times ``grad_scale``.

    Every rank computes the same function of the sum, so each rank's local term gets the full gradient
    (identity); ``grad_scale`` undoes a later averaging of parameter gradients over data-parallel ranks.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.grad_scale, None, None


class _SumBackward(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce sum of the gradient over ``group`` (Megatron's "f").

    Put on an input that every rank of ``group`` holds identically and feeds into a rank-specific slice of
    the computation, so the upstream (replicated) parameters receive the full gradient.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_forward(t: torch.Tensor, group: Any, grad_scale: float = 1.0) -> torch.Tensor:
    """Differentiable all-reduce sum (see :class:`_SumForward`)."""
    return _SumForward.apply(t, group, grad_scale)


def sum_backward(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity whose backward sums gradients over ``group`` (see :class:`_SumBackward`)."""
    return _SumBackward.apply(t, group)


def all_reduce_grads(params: list[torch.nn.Parameter], group: Any, world: int) -> int:
    """Average ``.grad`` of ``params`` over ``group`` in one flat buffer per dtype; return the bytes sent."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    sent = 0
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(world)
        dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return sent


class _GatherSparse(torch.autograd.Function):
    """Forward: every rank gets all ranks' ``(indices, values)`` (variable counts, rank order).

    Backward: the gradient of the gathered values is summed over ranks (each rank decoded its own output
    columns from all entries) and each rank keeps the part for its own entries.
    """

    @staticmethod
    def forward(
        ctx: Any,
        indices: torch.Tensor,
        values: torch.Tensor,
        group: Any,
        world: int,
        counts: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if counts is None:
            count = torch.tensor([indices.numel()], dtype=torch.long, device=indices.device)
            counts = _all_gather(count, group, world).view(-1).tolist()  # host sync: counts size the buffers
        width = max(counts)
        rank = dist.get_rank(group)
        ctx.group, ctx.counts, ctx.width, ctx.rank = group, counts, width, rank
        # One collective for both: each row holds an int64 index and the value's bytes.
        n, esz = indices.numel(), values.element_size()
        buf = torch.empty(width, 8 + esz, dtype=torch.uint8, device=indices.device)
        buf[:n, :8] = indices.to(torch.int64).contiguous().view(torch.uint8).view(n, 8)
        buf[:n, 8:] = values.contiguous().view(torch.uint8).view(n, esz)
        parts = _all_gather(buf, group, world)
        rows = torch.cat([parts[r, : counts[r]] for r in range(world)])
        out_idx = rows[:, :8].contiguous().view(torch.int64).view(-1)
        out_vals = rows[:, 8:].contiguous().view(values.dtype).view(-1)
        ctx.mark_non_differentiable(out_idx)
        return out_idx, out_vals

    @staticmethod
    def backward(ctx: Any, grad_idx: torch.Tensor | None, grad_vals: torch.Tensor) -> tuple[Any, ...]:
        counts, width = ctx.counts, ctx.width
        padded = grad_vals.new_zeros(len(counts), width)
        offset = 0
        for r, c in enumerate(counts):
            padded[r, :c] = grad_vals[offset : offset + c]
            offset += c
        dist.all_reduce(padded, group=ctx.group)
        return None, padded[ctx.rank, : counts[ctx.rank]].contiguous(), None, None, None


def gather_sparse(
    indices: torch.Tensor, values: torch.Tensor, group: Any, world: int, counts: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' sparse entries in rank order; gradients of ``values`` return summed to their owners.

    ``counts``: every rank's entry count (rank order) when already known on the host (e.g. from
    :func:`~lightning_opt.ops.global_topk.batch_topk_threshold_sparse` with ``return_counts=True``); saves a
    count exchange and its host sync.
    """
    if counts is not None and (len(counts) != world or counts[dist.get_rank(group)] != indices.numel()):
        raise ValueError(
            f"counts {counts} do not match this group (world {world}, {indices.numel()} local entries); "
            "pass the counts of the ranks of `group` in rank order, or None."
        )
    return _GatherSparse.apply(indices, values, group, world, counts)


class _GatherPadded(torch.autograd.Function):
    """Forward: all ranks' ``(indices, values)`` as ``[world * width]`` rows, rank-major, padding included.

    No compaction after the collective (a ``valid`` mask marks the real rows). Backward: each rank needs the
    summed gradient of its own rows only, so NCCL reduce-scatters it (half an all-reduce's bytes).
    """

    @staticmethod
    def forward(
        ctx: Any, indices: torch.Tensor, values: torch.Tensor, group: Any, world: int, counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max(counts))
        rank = dist.get_rank(group)
        ctx.group, ctx.count, ctx.width, ctx.rank, ctx.world = group, counts[rank], width, rank, world
        n, isz, vsz = indices.numel(), indices.element_size(), values.element_size()
        # One collective for both: a row holds the index's bytes, then the value's.
        buf = torch.empty(width, isz + vsz, dtype=torch.uint8, device=indices.device)
        buf[:n, :isz] = indices.contiguous().view(torch.uint8).view(n, isz)
        buf[:n, isz:] = values.contiguous().view(torch.uint8).view(n, vsz)
        buf[n:, :isz] = 255  # padding rows hold index -1 (the receivers' valid mask, no host copy)
        rows = _all_gather(buf, group, world).view(world * width, isz + vsz)
        out_idx = rows[:, :isz].contiguous().view(indices.dtype).view(-1)
        out_vals = rows[:, isz:].contiguous().view(values.dtype).view(-1)
        ctx.mark_non_differentiable(out_idx)
        return out_idx, out_vals

    @staticmethod
    def backward(ctx: Any, grad_idx: torch.Tensor | None, grad_vals: torch.Tensor) -> tuple[Any, ...]:
        grad = grad_vals.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            own = grad.new_empty(ctx.width)
            dist.reduce_scatter_tensor(own, grad, group=ctx.group)
        else:  # gloo has no reduce-scatter of flat tensors
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            own = grad.view(ctx.world, ctx.width)[ctx.rank]
        return None, own[: ctx.count].contiguous(), None, None, None


def gather_padded(
    indices: torch.Tensor, values: torch.Tensor, group: Any, world: int, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ranks' sparse entries, rank-major and padded to the largest count, plus the ``valid`` row mask.

    ``indices`` must be non-negative (padding rows get ``-1``). ``counts``: every rank's entry count in rank order (host ints). Gradients of the gathered values return
    summed to the rank that owns each entry; padding rows get none.
    """
    if len(counts) != world or counts[dist.get_rank(group)] != indices.numel():
        raise ValueError(
            f"counts {counts} do not match this group (world {world}, {indices.numel()} local entries); "
            "pass the counts of the ranks of `group` in rank order."
        )
    out_idx, out_vals = _GatherPadded.apply(indices, values, group, world, counts)
    return out_idx, out_vals, out_idx >= 0


class _TakeUnique(torch.autograd.Function):
    """``src[idx]`` for unique ``idx`` whose backward scatters (no sort-based accumulate)."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.n = src.numel()
        return src[idx]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (idx,) = ctx.saved_tensors
        return grad.new_zeros(ctx.n).index_copy_(0, idx, grad.contiguous()), None


class _TakeMasked(torch.autograd.Function):
    """``src[idx]`` where ``valid``, else 0; ``idx`` unique among the valid entries (the others may be anything
    in range). Backward scatters the valid entries' gradients (the rest go to a dump slot)."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx, valid)
        ctx.n = src.numel()
        return torch.where(valid, src[idx], 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        idx, valid = ctx.saved_tensors
        slot = torch.where(valid, idx, ctx.n)
        return grad.new_zeros(ctx.n + 1).scatter_(0, slot, grad.contiguous())[: ctx.n], None, None


def take_masked(src: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``where(valid, src[idx], 0)`` (1-D; ``idx`` in range and unique where ``valid``) with a scatter backward."""
    return _TakeMasked.apply(src, idx, valid)


def take_unique(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` (1-D, unique ``idx``) with a scatter backward."""
    return _TakeUnique.apply(src, idx)


class _GatherStacked(torch.autograd.Function):
    """Forward: every rank's ``t`` (same shape) stacked in rank order, ``[world, *t.shape]``. Backward: the
    gradient summed over ranks (each rank computed a different part of the loss from every rank's entries),
    this rank's slice of it returned."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return _all_gather(t.contiguous(), group, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None


def gather_stacked(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Every rank's ``t`` stacked as ``[world, *t.shape]``; the gradient returns summed to each owner."""
    return _GatherStacked.apply(t, group, world)
