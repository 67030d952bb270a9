"""Float32 matmul precision (TF32 on NVIDIA GPUs) for the span of one Trainer stage."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch import Callback
from typing_extensions import override

MatmulPrecisionName = Literal["highest", "high", "medium"]
_CHOICES = ("highest", "high", "medium")


class MatmulPrecision(Callback):
    """Call ``torch.set_float32_matmul_precision(precision)`` at setup and restore the previous value at teardown.

    ``high`` lets float32 matmuls use TF32 tensor cores on Ampere and later NVIDIA GPUs: inputs rounded to a
    10-bit mantissa, float32 accumulation; the H100 SXM's dense peak is 494.7 TFLOPS in TF32 against 66.9 in
    float32. It changes whatever multiplies float32 matrices: a ``32-true`` run, and the matmuls that stay
    float32 in a ``bf16-mixed`` run (those outside autocast). ``medium`` also allows bfloat16 products;
    ``highest`` is plain float32.

    The value is global to the process, so the callback restores it when the stage ends (fit, validate, test
    or predict): code that runs after ``trainer.fit`` sees what it saw before. The setting is saved in the
    checkpoint's callback state and, through LightningCLI, in the run's ``config.yaml``.

    Args:
        precision: ``highest``, ``high`` (TF32) or ``medium``.
    """

    def __init__(self, precision: MatmulPrecisionName = "high") -> None:
        if precision not in _CHOICES:
            raise ValueError(f"MatmulPrecision(precision={precision!r}): choose one of {_CHOICES}")
        self.precision = precision
        self._previous: str | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is None:  # a stage set up twice keeps the value from before the first
            self._previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.precision)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            torch.set_float32_matmul_precision(self._previous)
            self._previous = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The run's own setting wins over the checkpoint's (a resumed run may change the precision)."""
