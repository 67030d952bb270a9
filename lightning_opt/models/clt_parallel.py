"""The CLT's distribution: which part of a :class:`~lightning_opt.models.clt.CLT` a rank holds, and every
collective the sharded model issues (plain ``torch.distributed``, no Lightning).

* :class:`CLTShardSpec`: this rank's output columns (and features) and the process groups of the
  ``data x model`` mesh; :meth:`CLT.shard_ <lightning_opt.models.clt.CLT.shard_>` slices the parameters to it.
* differentiable collectives: :func:`sum_forward`, :func:`sum_backward` (Megatron's "f"), :func:`gather_sparse`,
  :func:`gather_padded`, :func:`gather_stacked`, :func:`gather_columns`; the index takes of the pool selection
  (:func:`take_masked`, :func:`take_unique`).
* the optimizer step's: :func:`all_reduce_grads` (data-parallel gradient averaging) and :func:`clip_grad_norm_`
  (the norm of the whole sharded model).

``lightning_opt.strategies`` builds the groups and calls these; the model calls them from its forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_opt.ops.global_topk import all_gather

__all__ = [
    "SELECTIONS",
    "CLTShardSpec",
    "all_gather_last",
    "all_reduce_grads",
    "clip_grad_norm_",
    "gather_columns",
    "gather_padded",
    "gather_sparse",
    "gather_stacked",
    "sum_backward",
    "sum_forward",
    "take_masked",
    "take_unique",
]

SELECTIONS = ("padded_pool", "synced_pool", "general")


@dataclass(frozen=True)
class CLTShardSpec:
    """Which part of a :class:`CLT` this rank holds, and the process groups of the mesh.

    Ranks form a ``data x model`` mesh, ``rank = data_rank * model_size + model_rank``: the ``model_size``
    ranks of a *decoder group* see the same tokens and each holds the output columns ``d_out`` of every
    decoder (and, with ``features``, the features ``features`` of every layer's encoder); the ``data_size``
    ranks of a *data group* hold the same slices and see different tokens. :meth:`CLT.shard_` slices the
    parameters to it; :meth:`CLT.forward`, :meth:`CLT.decode` and :meth:`CLT.decode_sparse` then compute this
    rank's shard and issue the collectives the shard needs (``lightning_opt.strategies.DecoderShardingStrategy``
    builds the groups and sets the spec).

    Args:
        d_out: ``(start, stop)``: decoder output columns (d_model axis) held here; the recon is
            ``[N, L, stop - start]`` and matches ``y[..., start:stop]``.
        features: ``(start, stop)``: features of every layer whose encoder columns (``W_enc[..., start:stop]``,
            ``b_enc[..., start:stop]``) are held here; ``None``: the encoder is replicated. Needs
            ``activation="batchtopk_global"`` and ``model_group``.
        model_group: process group of the decoder group; ``None``: a local slice without collectives (the
            decoder then gets the gradient of its columns only).
        model_size, model_rank: size of the decoder group and this rank's place in it.
        data_group, data_size, data_rank: the data-parallel axis (ranks holding the same slices). The model
            uses it only through ``CLT.topk_group`` (BatchTopK over the data group); gradient averaging is the
            strategy's.
        mesh_group: all ranks of the mesh in mesh order (``None``: the default group). Feature-sharded encoders
            select over it when ``CLT.topk_group`` is set (one budget over the mesh's tokens and features).
        selection: feature-sharded encoders within one decoder group: ``"padded_pool"`` (every rank's
            candidates gathered in fixed-size buffers, the same ``K`` picked on every rank, one host sync at the
            decode's layer bounds; the synced pool when the buffers were too small), ``"synced_pool"`` (the
            candidate counts read first, then a gather of exactly the candidates) or ``"general"`` (selection
            collectives, then a gather of the kept entries; always used when the budget spans the data group).
        gather_output: :meth:`CLT.forward` all-gathers the recon over the decoder group (full-width outputs, for
            evaluation; its backward keeps this rank's columns, right when every rank computes the same loss).
        phase_hook: optional ``callable(name)`` called after ``encode``, ``select``, ``gather`` and ``decode`` of
            the feature-sharded forward (benchmarks time the phases).
    """

    d_out: tuple[int, int]
    features: tuple[int, int] | None = None
    model_group: Any = None
    model_size: int = 1
    model_rank: int = 0
    data_group: Any = None
    data_size: int = 1
    data_rank: int = 0
    mesh_group: Any = None
    selection: str = "padded_pool"
    gather_output: bool = False
    phase_hook: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        for name in ("model_size", "data_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CLTShardSpec.{name} must be a positive int, got {v!r}")
        if not 0 <= self.model_rank < self.model_size or not 0 <= self.data_rank < self.data_size:
            raise ValueError(
                f"ranks out of range: model_rank={self.model_rank} of {self.model_size}, "
                f"data_rank={self.data_rank} of {self.data_size}"
            )
        for name in ("d_out", "features"):
            v = getattr(self, name)
            if v is not None and (len(v) != 2 or not 0 <= v[0] < v[1]):
                raise ValueError(f"CLTShardSpec.{name} must be (start, stop) with 0 <= start < stop, got {v!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"CLTShardSpec.selection={self.selection!r} is unknown; choose one of {SELECTIONS}")
        if self.features is not None and self.model_group is None:
            raise ValueError("feature-sharded encoders (features=...) need the decoder group (model_group)")

    @property
    def collective(self) -> bool:
        """Whether the decoder group spans ranks (collectives in forward and backward)."""
        return self.model_group is not None


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
            counts = all_gather(count, group, world).view(-1).tolist()  # host sync: counts size the buffers
        width = max(counts)
        rank = dist.get_rank(group)
        ctx.group, ctx.counts, ctx.width, ctx.rank = group, counts, width, rank
        # One collective for both: each row holds an int64 index and the value's bytes.
        n, esz = indices.numel(), values.element_size()
        buf = torch.empty(width, 8 + esz, dtype=torch.uint8, device=indices.device)
        buf[:n, :8] = indices.to(torch.int64).contiguous().view(torch.uint8).view(n, 8)
        buf[:n, 8:] = values.contiguous().view(torch.uint8).view(n, esz)
        parts = all_gather(buf, group, world)
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
        rows = all_gather(buf, group, world).view(world * width, isz + vsz)
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
        return all_gather(t.contiguous(), group, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None


def gather_stacked(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Every rank's ``t`` stacked as ``[world, *t.shape]``; the gradient returns summed to each owner."""
    return _GatherStacked.apply(t, group, world)


def all_gather_last(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` along the last axis, in rank order (no gradient)."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _GatherColumns(torch.autograd.Function):
    """Forward: every rank's output columns concatenated (full width). Backward: this rank's columns of the
    gradient (every rank of the group computes the same function of the full output)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, world: int, rank: int) -> torch.Tensor:
        ctx.width, ctx.rank = t.shape[-1], rank
        return all_gather_last(t, group, world)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None, None, None


def gather_columns(t: torch.Tensor, group: Any, world: int, rank: int) -> torch.Tensor:
    """Every rank's output columns concatenated on the last axis; the backward keeps this rank's columns."""
    return _GatherColumns.apply(t, group, world, rank)


def clip_grad_norm_(module: nn.Module, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """:func:`torch.nn.utils.clip_grad_norm_` with the norm of the whole model when CLTs in ``module`` are sharded.

    The squared norms of the sharded parameters (:meth:`CLT.sharded_parameters` of every CLT with a decoder
    group) are summed over the decoder group; every other parameter is replicated in the group and counts once.
    Without sharded CLTs this is ``torch.nn.utils.clip_grad_norm_``. Call it from
    ``LightningModule.configure_gradient_clipping`` (as :class:`~lightning_opt.modules.clt.CLTModule` does);
    the norm stays on the device (no host sync). Returns the total norm.
    """
    params = [p for p in parameters if p.grad is not None]
    clts = [m for m in module.modules() if isinstance(getattr(m, "shard", None), CLTShardSpec) and m.shard.collective]
    if not clts:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    groups = {id(c.shard.model_group) for c in clts if c.shard is not None}
    if len(groups) > 1:
        raise ValueError("the sharded CLTs of one module must share one decoder group")
    if not params:
        return torch.zeros(())
    sharded = {id(p) for c in clts for p in c.sharded_parameters()}
    zero = params[0].grad.new_zeros((), dtype=torch.float32)
    sq_sharded = sum((p.grad.detach().float().pow(2).sum() for p in params if id(p) in sharded), zero)
    sq_shared = sum((p.grad.detach().float().pow(2).sum() for p in params if id(p) not in sharded), zero)
    dist.all_reduce(sq_sharded, group=clts[0].shard.model_group)
    total = (sq_sharded + sq_shared).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([p.grad for p in params], coef)
    return total
