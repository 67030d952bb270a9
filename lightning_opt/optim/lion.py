"""Lion (EvoLved Sign Momentum, Chen et al., 2023): the sign of an interpolated momentum as the update."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim import Optimizer


class Lion(Optimizer):
    """Lion with decoupled weight decay, one ``torch._foreach_*`` call per operation and device/dtype bucket.

    Per parameter ``p`` with gradient ``g`` and momentum ``m`` (zeros at the first step)::

        p = p * (1 - lr * weight_decay)
        p = p - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g

    Every update entry is ``+-lr`` (or 0), so Lion wants a learning rate 3-10x smaller than AdamW's and a
    weight decay 3-10x larger (the paper's advice) to keep the same effective decay ``lr * weight_decay``.
    One state tensor per parameter (``exp_avg``), half of AdamW's.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(beta1, beta2)``: the interpolation weight of the update and the momentum's decay.
        weight_decay: decoupled weight decay (multiplied by ``lr``, as in AdamW and the paper).
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ValueError(f"Lion lr={lr} must be positive")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion betas={betas} must be two numbers in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"Lion weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            buckets: dict[tuple, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params, grads, exp_avgs = buckets[(p.device, p.dtype)]
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            for params, grads, exp_avgs in buckets.values():
                _lion_foreach(params, grads, exp_avgs, lr, beta1, beta2, wd)
        return loss


def _lion_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  lr: float | torch.Tensor, beta1: float, beta2: float, weight_decay: float) -> None:
    """One Lion step over tensors of one device and dtype."""
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, torch._foreach_mul(grads, 1 - beta1))
    torch._foreach_sign_(update)
    if torch.is_tensor(lr):  # a tensor learning rate stays on the device: no host sync
        torch._foreach_mul_(update, lr)
        torch._foreach_sub_(params, update)
    else:
        torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta2))
