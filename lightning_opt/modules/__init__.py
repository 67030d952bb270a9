"""LightningModules wrapping the models: losses, optimizers, logging."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

_EXPORTS = {
    "GPT2SpeedrunModule": "gpt2",
    "CLTModule": "clt",
    "SPDModule": "spd",
    "SPDTargetConfig": "spd",
    "SPDLossConfig": "spd",
    "SPDTrainConfig": "spd",
    "PGDConfig": "spd",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
