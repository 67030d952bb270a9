"""Which classes ``torch.load(weights_only=True)`` may rebuild: our config dataclasses, registered where they live."""

from __future__ import annotations

import torch


def register_safe_globals(*classes: type) -> None:
    """Let ``torch.load(weights_only=True)`` (Lightning's default) read checkpoints holding these configs."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(list(classes))
