"""Training callbacks that work with any LightningModule."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

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
