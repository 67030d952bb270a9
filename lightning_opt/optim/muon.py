"""Muon: momentum SGD whose update for each hidden matrix is orthogonalised by Newton-Schulz iterations.

Written from the description in Keller Jordan's Muon post and the GPT-2 speedrun: Nesterov momentum, then
the quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315) run in bfloat16, and the update
scaled by ``sqrt(max(1, rows / cols))`` so that tall and wide matrices move alike.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (``U V^T`` of its SVD); bfloat16 on GPUs, float32 on CPU."""
    a, b, c = 3.4445, -4.7750, 2.0315
    # CPUs have no fast bf16 matmul: there the iteration runs in float32
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if transposed else x


class Muon(Optimizer):
    """Muon for 2-D (or higher, flattened after the first dim) parameters.

    Args:
        params: the hidden matrices. Embeddings, the output head and vectors belong to AdamW.
        lr: learning rate (the speedrun uses 0.05).
        momentum: momentum coefficient.
        nesterov: use Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        weight_decay: decoupled weight decay.

    Example:
        >>> opt = Muon([torch.nn.Parameter(torch.randn(8, 4))], lr=0.02)
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"Muon lr={lr} must be positive")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps={ns_steps} must be >= 1")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes matrices only; got a parameter of shape {tuple(p.shape)}. "
                                     "Give vectors and scalars to AdamW (see lightning_opt.optim.build_optimizer).")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - group["momentum"])
                g = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                shape = g.shape
                update = newton_schulz(g.reshape(shape[0], -1), group["ns_steps"]).view(shape)
                scale = max(1.0, shape[0] / g[0].numel()) ** 0.5
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)
        return loss
