"""Optional packages: import lazily, fail with a message that names the extra and the fallback."""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

_EXTRA_OF = {
    "flash_attn": "gpu",
    "bitsandbytes": "gpu",
    "transformers": "hf",
    "huggingface_hub": "hf",
    "datasets": "hf",
    "triton": "gpu",
}


def is_available(module_name: str) -> bool:
    """True when ``module_name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def triton_runs_on(device_tensor) -> bool:
    """Where an imported Triton kernel can run: CUDA tensors, or any tensor under ``TRITON_INTERPRET=1``."""
    return device_tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def require(module_name: str, extra: str | None = None, purpose: str = "", fallback: str = "") -> ModuleType:
    """Import an optional package or raise an ``ImportError`` that says how to get it.

    Args:
        module_name: the import name, e.g. ``"flash_attn"``.
        extra: the pip extra that installs it (defaults to the known one for the package).
        purpose: what needs it, for the message.
        fallback: what is used instead when the caller can fall back, for the message.
    """
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        extra = extra or _EXTRA_OF.get(module_name, "")
        how = f"pip install 'lightning-opt[{extra}]'" if extra else f"pip install {module_name}"
        msg = f"{module_name!r} is not installed"
        if purpose:
            msg += f" ({purpose} needs it)"
        msg += f". Install it with: {how}."
        if fallback:
            msg += f" Without it, {fallback} is used."
        raise ImportError(msg) from err
