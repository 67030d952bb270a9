"""Optimizers and schedules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.optim.factory import build_optimizer as build_optimizer
    from lightning_opt.optim.lion import Lion as Lion
    from lightning_opt.optim.muon import Muon as Muon

_EXPORTS = {
    "Lion": "lion",
    "Muon": "muon",
    "build_optimizer": "factory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
