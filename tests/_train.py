"""Small shared test helper: a few optimizer steps of a language model on one batch."""

from __future__ import annotations

import torch


def loss_drop(model: torch.nn.Module, opt, x: torch.Tensor, steps: int) -> tuple[float, float]:
    """First and last loss of ``steps`` steps of next-token training on ``x`` (targets: ``x`` shifted by one)."""
    losses = []
    for _ in range(steps):
        loss = model(x, x.roll(-1, 1))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses[0], losses[-1]
