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

import functools
import math
from collections import defaultdict

import torch
from torch.optim import Optimizer

JORDAN = (3.4445, -4.7750, 2.0315)  # one quintic for every step (Keller Jordan's Muon)
NS_COEFFICIENTS = ("jordan", "polar_express")


def _optimal_quintic(lo: float, hi: float, iters: int = 60) -> tuple[float, float, float, float]:
    """The odd quintic ``p(x) = a x + b x^3 + c x^5`` closest to 1 on ``[lo, hi]`` in the max norm, and that
    distance ``E``: Remez exchange over the four points where the error alternates (``lo``, the two interior
    extrema of ``p``, ``hi``). An interval too narrow to resolve gets the quintic flat at ``hi``."""
    if lo / hi > 1 - 1e-4:
        return 15 / (8 * hi), -10 / (8 * hi**3), 3 / (8 * hi**5), 0.0
    pts = [lo + (hi - lo) * (1 - math.cos(math.pi * i / 3)) / 2 for i in range(4)]
    a = b = c = err = 0.0
    for _ in range(iters):
        lhs = torch.tensor([[x, x**3, x**5, (-1) ** i] for i, x in enumerate(pts)], dtype=torch.float64)
        a, b, c, err = torch.linalg.solve(lhs, torch.ones(4, dtype=torch.float64)).tolist()
        disc = 9 * b * b - 20 * a * c  # p'(x) = a + 3b x^2 + 5c x^4: its roots in x^2
        if disc <= 0 or c == 0:
            break
        roots = sorted((-3 * b - sign * math.sqrt(disc)) / (10 * c) for sign in (1, -1))
        inner = [math.sqrt(y) for y in roots if lo**2 < y < hi**2]
        if len(inner) != 2:
            break
        new = [lo, inner[0], inner[1], hi]
        done = max(abs(x - y) for x, y in zip(new, pts)) < 1e-15 * hi
        pts = new
        if done:
            break
    return a, b, c, abs(err)


@functools.cache
def polar_express_coefficients(steps: int = 5, lower: float = 1e-3, cushion: float = 0.01,
                               safety: float = 1.01) -> tuple[tuple[float, float, float], ...]:
    """Per-step quintic coefficients in the manner of Polar Express (Amsel et al., 2025): each step's quintic is
    the best one (max norm) for the interval the singular values are known to lie in, and that interval then
    becomes the quintic's image. Computed here, not copied: start from ``[lower, 1]`` (the input is divided by
    its Frobenius norm, so no singular value exceeds 1; smaller ones than ``lower`` are treated as noise);
    ``cushion`` keeps each step's interval at least that fraction of its top, so an early step does not bend
    the polynomial for values it cannot reach anyway; ``safety`` evaluates every quintic at ``x / safety``, a
    margin for bfloat16 rounding. The defaults were picked on CPU by the distance to the exact polar factor
    after five bfloat16 steps (tests/optim/test_optim.py checks that it beats the fixed quintic)."""
    lo, hi, out = lower, 1.0, []
    for _ in range(steps):
        a, b, c, _ = _optimal_quintic(max(lo, cushion * hi), hi)
        grid = torch.linspace(lo, hi, 20001, dtype=torch.float64)
        image = a * grid + b * grid**3 + c * grid**5
        lo, hi = float(image.min()), float(image.max())
        out.append((a / safety, b / safety**3, c / safety**5))
    return tuple(out)


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients: str = "jordan") -> torch.Tensor:
    """Approximately orthogonalise ``g`` (``U V^T`` of its SVD), batched over leading dimensions.

    bfloat16 on GPUs, float32 on CPU (CPUs have no fast bf16 matmul). ``coefficients``: ``"jordan"`` (the same
    quintic every step) or ``"polar_express"`` (a quintic per step, :func:`polar_express_coefficients`:
    closer to ``U V^T`` after five steps than the fixed quintic at the same cost; docs/optim.md).
    """
    if coefficients not in NS_COEFFICIENTS:
        raise ValueError(f"newton_schulz coefficients={coefficients!r}: choose one of {NS_COEFFICIENTS}")
    per_step = polar_express_coefficients(steps) if coefficients == "polar_express" else (JORDAN,) * steps
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in per_step:
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
        ns_coefficients: ``"jordan"`` (one quintic for every Newton-Schulz step) or ``"polar_express"``
            (a quintic per step, closer to the exact orthogonalisation; see :func:`newton_schulz`).
        normuon_beta2: ``None`` (plain Muon) or the decay of a per-neuron second moment in the manner of
            NorMuon (Li et al., 2025): each orthogonalised update is divided, neuron by neuron (the rows of a
            tall or square matrix, the columns of a wide one), by the root of a running mean of its squares
            (bias-corrected), then scaled back to the Frobenius norm it had, so the learning rate keeps its
            meaning while neurons whose updates run large are evened out. One ``[rows, 1]`` or ``[1, cols]``
            buffer per parameter.

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
        ns_coefficients: str = "jordan",
        normuon_beta2: float | None = None,
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
        if ns_coefficients not in NS_COEFFICIENTS:
            raise ValueError(f"Muon ns_coefficients={ns_coefficients!r}: choose one of {NS_COEFFICIENTS}")
        if normuon_beta2 is not None and not 0 <= normuon_beta2 < 1:
            raise ValueError(f"Muon normuon_beta2={normuon_beta2} must be in [0, 1) or None")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      weight_decay=weight_decay, momentum_start=momentum_start,
                                      momentum_warmup_steps=momentum_warmup_steps, split_fused=split_fused,
                                      ns_coefficients=ns_coefficients, normuon_beta2=normuon_beta2,
                                      steps_done=0))
        self.batched = batched
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes matrices only; got a parameter of shape {tuple(p.shape)}. "
                                     "Give vectors and scalars to AdamW (see lightning_opt.optim.build_optimizer).")

    def load_state_dict(self, state_dict) -> None:
        """Load; a state without every Muon option (torch keeps only the saved group keys) is refused."""
        missing = sorted({k for g in state_dict.get("param_groups", []) for k in [*self.defaults, "steps_done"]
                          if k not in g})
        if missing:
            raise ValueError(f"this Muon optimizer state lacks {missing}: it was not written by this Muon; start "
                             "the optimizer fresh (load the weights only) or resume with the version that wrote it")
        super().load_state_dict(state_dict)

    def _normuon(self, p: torch.Tensor, update: torch.Tensor, beta2: float) -> torch.Tensor:
        """Per-neuron second-moment normalisation of one orthogonalised update, its Frobenius norm kept."""
        u = update.reshape(update.shape[0], -1).float()
        dim = 1 if u.shape[0] >= u.shape[1] else 0  # neurons along the longer side
        ms = u.square().mean(dim=dim, keepdim=True)
        state = self.state[p]
        if "normuon_v" not in state:
            state["normuon_v"], state["normuon_steps"] = torch.zeros_like(ms), 0
        state["normuon_steps"] += 1  # per parameter: the bias correction starts with its first update
        v = state["normuon_v"]
        v.lerp_(ms, 1 - beta2)
        normed = u / ((v / (1 - beta2 ** state["normuon_steps"])).sqrt() + 1e-8)
        normed = normed * (u.norm() / (normed.norm() + 1e-12))
        return normed.view(update.shape).to(update.dtype)

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
            # every group has these keys: the defaults at construction, checked by load_state_dict
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
                out = newton_schulz(stacked, group["ns_steps"], coefficients=group["ns_coefficients"])
                for k, (i, j, tall) in enumerate(members):
                    # tall blocks are scaled by sqrt(rows / cols); wide ones (scale 1) need no multiply
                    ortho[i][j] = out[k].mT * (out[k].shape[1] / out[k].shape[0]) ** 0.5 if tall else out[k]
            final = [(torch.cat(o, dim=0) if len(o) > 1 else o[0]).view(p.shape).to(p.dtype)
                     for p, o in zip(params, ortho)]
            if group["normuon_beta2"] is not None:
                final = [self._normuon(p, u, group["normuon_beta2"]) for p, u in zip(params, final)]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, final, alpha=-group["lr"])
        return loss
