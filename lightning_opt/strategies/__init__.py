"""Lightning strategies for CLT training across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.strategies.decoder_sharding import DecoderShardingStrategy as DecoderShardingStrategy
    from lightning_opt.strategies.fsdp_global_batch_topk import (
        FSDPGlobalBatchTopKStrategy as FSDPGlobalBatchTopKStrategy,
    )
    from lightning_opt.strategies.global_batch_topk import GlobalBatchTopKStrategy as GlobalBatchTopKStrategy

_EXPORTS = {
    "GlobalBatchTopKStrategy": "global_batch_topk",
    "DecoderShardingStrategy": "decoder_sharding",
    "FSDPGlobalBatchTopKStrategy": "fsdp_global_batch_topk",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
