"""Optimizer state placement for the strategies that set up their own optimizers."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import torch
from lightning.fabric.utilities import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Moves every optimizer's state tensors to ``device``, leaving each ``step`` counter where it is
    (torch optimizers keep it on the CPU unless they were built with ``capturable=True``)."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if not isinstance(state, MutableMapping):
                optimizer.state[param] = apply_to_collection(state, torch.Tensor, move_data_to_device, device)
                continue
            for key, value in state.items():
                if key != "step":
                    state[key] = move_data_to_device(value, device)
