"""lightning-opt: fast, hard-to-break research training on PyTorch Lightning."""

from __future__ import annotations

__version__ = "0.1.0"
