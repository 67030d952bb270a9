"""Training callbacks that work with any LightningModule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.callbacks.async_checkpoint import AsyncCheckpoint as AsyncCheckpoint
    from lightning_opt.callbacks.cuda_memory import CudaMemoryHygiene as CudaMemoryHygiene
    from lightning_opt.callbacks.eval_throttle import EvalThrottle as EvalThrottle
    from lightning_opt.callbacks.loss_clamp import LossClamp as LossClamp
    from lightning_opt.callbacks.matmul_precision import MatmulPrecision as MatmulPrecision
    from lightning_opt.callbacks.nan_skip import NaNSkip as NaNSkip
    from lightning_opt.callbacks.progress_bar import LazyProgressBar as LazyProgressBar
    from lightning_opt.callbacks.speed_monitor import SpeedMonitor as SpeedMonitor

_EXPORTS = {
    "NaNSkip": "nan_skip",
    "LossClamp": "loss_clamp",
    "AsyncCheckpoint": "async_checkpoint",
    "EvalThrottle": "eval_throttle",
    "CudaMemoryHygiene": "cuda_memory",
    "SpeedMonitor": "speed_monitor",
    "LazyProgressBar": "progress_bar",
    "MatmulPrecision": "matmul_precision",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
