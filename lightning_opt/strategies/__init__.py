"""Lightning strategies for CLT training across ranks."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

_EXPORTS = {
    "GlobalBatchTopKStrategy": "global_batch_topk",
    "DecoderShardingStrategy": "decoder_sharding",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
