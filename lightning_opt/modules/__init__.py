"""LightningModules wrapping the models: losses, optimizers, logging."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.modules.clt import CLTModule as CLTModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule as GPT2SpeedrunModule
    from lightning_opt.modules.spd import PGDConfig as PGDConfig
    from lightning_opt.modules.spd import SPDLossConfig as SPDLossConfig
    from lightning_opt.modules.spd import SPDModule as SPDModule
    from lightning_opt.modules.spd import SPDTargetConfig as SPDTargetConfig
    from lightning_opt.modules.spd import SPDTrainConfig as SPDTrainConfig

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
