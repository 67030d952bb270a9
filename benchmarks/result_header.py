"""The fields every benchmark result JSON starts with: what ran, where, with which versions, how."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch


def result_header(name: str, on_gpu: bool | None = None) -> dict[str, Any]:
    """``benchmark``, ``device`` (the GPU's name, else the CPU's), ``torch``, ``lightning``, ``command``."""
    import lightning

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    return {
        "benchmark": name,
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "command": " ".join([sys.executable, *sys.argv]),
    }
