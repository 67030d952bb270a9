"""Plain torch models (no Lightning here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.models.clt import CLT as CLT
    from lightning_opt.models.clt import CLTConfig as CLTConfig
    from lightning_opt.models.gpt2 import GPT as GPT
    from lightning_opt.models.gpt2 import GPTConfig as GPTConfig
    from lightning_opt.models.gpt2 import GPTExecution as GPTExecution
    from lightning_opt.models.spd import ComponentLayer as ComponentLayer
    from lightning_opt.models.spd import ComponentPattern as ComponentPattern
    from lightning_opt.models.spd import SPDConfig as SPDConfig
    from lightning_opt.models.spd import SPDModel as SPDModel
    from lightning_opt.models.toy import ResidMLP as ResidMLP
    from lightning_opt.models.toy import ResidMLPConfig as ResidMLPConfig
    from lightning_opt.models.toy import SparseFeatureDataset as SparseFeatureDataset
    from lightning_opt.models.toy import TMSConfig as TMSConfig
    from lightning_opt.models.toy import TMSModel as TMSModel

_EXPORTS = {
    "GPTConfig": "gpt2",
    "GPTExecution": "gpt2",
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
