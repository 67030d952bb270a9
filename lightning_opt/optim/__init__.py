"""Optimizers and schedules."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

_EXPORTS = {
    "Lion": "lion",
    "Muon": "muon",
    "build_optimizer": "factory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
