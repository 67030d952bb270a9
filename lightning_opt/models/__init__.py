"""Plain torch models (no Lightning here)."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

_EXPORTS = {
    "GPTConfig": "gpt2",
    "GPT": "gpt2",
    "CLTConfig": "clt",
    "CLT": "clt",
    "SPDConfig": "spd",
    "SPDModel": "spd",
    "ComponentPattern": "spd",
    "ComponentLayer": "spd",
    "TMSConfig": "toy",
    "TMSModel": "toy",
    "ResidMLPConfig": "toy",
    "ResidMLP": "toy",
    "SparseFeatureDataset": "toy",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
