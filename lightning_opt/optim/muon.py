"""Muon: momentum SGD whose update for each hidden matrix is orthogonalised by Newton-Schulz iterations.

Written from the description in Keller Jordan's Muon post and the GPT-2 speedrun: Nesterov momentum, then
the quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315) run in bfloat16, and the update
scaled by ``sqrt(max(1, rows / cols))`` so that tall and wide matrices move alike.

Speed: the step orthogonalises all matrices of one shape together, as one batched iteration (a 12-layer
GPT-2 has two shapes once tall matrices are transposed, so 2 x 5 batched iterations instead of 48 x 5
small ones), and the momentum and parameter updates are ``torch._foreach`` calls. Nothing synchronises
with the host.

Fused projections: a parameter with a ``muon_row_splits`` attribute (a tuple of row counts, e.g. the
query, key and value rows of a fused ``c_attn``) is orthogonalised block by block, as if the blocks were
separate matrices, which they are for the model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.optim import Optimizer


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (``U V^T`` of its SVD), batched over leading dimensions.

    bfloat16 on GPUs, float32 on CPU (CPUs have no fast bf16 matmul).
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if transposed else x


def momentum_at(step: int, momentum: float, start: float | None, warmup_steps: int) -> float:
    """Momentum after ``step`` optimizer steps: linear from ``start`` to ``momentum`` over ``warmup_steps``."""
    if start is None or warmup_steps <= 0:
        return momentum
    frac = min(step / warmup_steps, 1.0)
    return (1 - frac) * start + frac * momentum


def _blocks(p: torch.Tensor, g2d: torch.Tensor) -> list[torch.Tensor]:
    splits = getattr(p, "muon_row_splits", None)
    if not splits:
        return [g2d]
    if sum(splits) != g2d.shape[0]:
        raise ValueError(f"muon_row_splits={tuple(splits)} do not add up to the parameter's {g2d.shape[0]} rows")
    return list(g2d.split(list(splits), dim=0))


class Muon(Optimizer):
    """Muon for 2-D (or higher, flattened after the first dim) parameters.

    Args:
        params: the hidden matrices. Embeddings, the output head and vectors belong to AdamW.
        lr: learning rate (the speedrun uses 0.05).
        momentum: momentum coefficient (after the warmup).
        nesterov: use Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        weight_decay: decoupled weight decay.
        momentum_start: momentum at the first step, raised linearly to ``momentum`` over
            ``momentum_warmup_steps`` steps (the speedrun: 0.85 -> 0.95 over 300 steps); ``None`` = none.
        momentum_warmup_steps: length of that warmup.
        split_fused: orthogonalise the row blocks of parameters that carry ``muon_row_splits`` separately
            (``False``: treat every parameter as one matrix).
        batched: orthogonalise same-shape matrices together (``False``: one matrix at a time, the
            unbatched reference; the result is the same up to bfloat16 rounding).

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
        momentum_start: float | None = None,
        momentum_warmup_steps: int = 0,
        split_fused: bool = True,
        batched: bool = True,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"Muon lr={lr} must be positive")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if momentum_start is not None and not 0 <= momentum_start < 1:
            raise ValueError(f"Muon momentum_start={momentum_start} must be in [0, 1)")
        if momentum_warmup_steps < 0:
            raise ValueError(f"Muon momentum_warmup_steps={momentum_warmup_steps} must be >= 0")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps={ns_steps} must be >= 1")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay, momentum_start=momentum_start,
                                      momentum_warmup_steps=momentum_warmup_steps, split_fused=split_fused,
                                      steps_done=0))
        self.batched = batched
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes matrices only; got a parameter of shape {tuple(p.shape)}. "
                                     "Give vectors and scalars to AdamW (see lightning_opt.optim.build_optimizer).")

    def load_state_dict(self, state_dict) -> None:
        """Load, then fill the options a checkpoint from an older version lacks from this optimizer's own
        (torch keeps only the saved group keys). Such a checkpoint trained with its full momentum: a configured
        warmup counts as done, it does not restart mid-run."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            had_steps = "steps_done" in group
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if not had_steps:
                group["steps_done"] = group["momentum_warmup_steps"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # every group has these keys: the defaults at construction, load_state_dict fills older checkpoints
            mom = momentum_at(group["steps_done"], group["momentum"], group["momentum_start"],
                              group["momentum_warmup_steps"])
            group["steps_done"] += 1
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                bufs.append(state["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - mom)
            updates = torch._foreach_lerp(grads, bufs, mom) if group["nesterov"] else bufs

            # every block of every parameter, oriented wide (rows <= cols), bucketed by shape
            buckets: dict[tuple[int, ...], list[tuple[int, int, bool]]] = defaultdict(list)
            blocks: list[list[torch.Tensor]] = []
            for i, (p, u) in enumerate(zip(params, updates)):
                u2d = u.reshape(u.shape[0], -1)
                bl = _blocks(p, u2d) if group["split_fused"] else [u2d]
                blocks.append(bl)
                for j, b in enumerate(bl):
                    tall = b.shape[0] > b.shape[1]
                    key = ((b.shape[1], b.shape[0]) if tall else tuple(b.shape)) + (b.device, b.dtype)
                    buckets[key if self.batched else (i, j)].append((i, j, tall))
            ortho: list[list[torch.Tensor | None]] = [[None] * len(bl) for bl in blocks]
            for members in buckets.values():
                stacked = torch.stack([blocks[i][j].mT if tall else blocks[i][j] for i, j, tall in members])
                out = newton_schulz(stacked, group["ns_steps"])
                for k, (i, j, tall) in enumerate(members):
                    # tall blocks are scaled by sqrt(rows / cols); wide ones (scale 1) need no multiply
                    ortho[i][j] = out[k].mT * (out[k].shape[1] / out[k].shape[0]) ** 0.5 if tall else out[k]
            final = [(torch.cat(o, dim=0) if len(o) > 1 else o[0]).view(p.shape).to(p.dtype)
                     for p, o in zip(params, ortho)]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, final, alpha=-group["lr"])
        return loss
