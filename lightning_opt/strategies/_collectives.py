"""Differentiable collectives shared by the CLT strategies (one place for every all-reduce they issue)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


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
