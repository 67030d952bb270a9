"""Sort keys of 16-bit float values, shared by the top-k selections (torch and Triton paths)."""

from __future__ import annotations

import torch


def order_keys16(v: torch.Tensor) -> torch.Tensor:
    """Int32 keys in ``[0, 2**16)`` with the order of 16-bit float values (``-0`` and ``+0`` tie)."""
    bits = (v + 0).view(torch.int16)  # + 0 turns -0 into +0
    # negative values: flip the magnitude bits (larger magnitude, smaller key); then shift the sign up
    return (bits ^ ((bits >> 15) & 0x7FFF)).to(torch.int32) + 0x8000
