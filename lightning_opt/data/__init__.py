"""Token shards, tokenizers, the offline corpus, activation sources."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.data.activations import CachedActivations as CachedActivations
    from lightning_opt.data.activations import CLTDataModule as CLTDataModule
    from lightning_opt.data.activations import MLPActivationCapture as MLPActivationCapture
    from lightning_opt.data.activations import write_activation_cache as write_activation_cache
    from lightning_opt.data.corpus import default_corpus_shards as default_corpus_shards
    from lightning_opt.data.datamodule import TokenShardDataModule as TokenShardDataModule
    from lightning_opt.data.shards import read_shard as read_shard
    from lightning_opt.data.shards import resolve_files as resolve_files
    from lightning_opt.data.shards import write_shard as write_shard
    from lightning_opt.data.tokenizer import ByteTokenizer as ByteTokenizer
    from lightning_opt.data.tokenizer import gpt2_encoding as gpt2_encoding

_EXPORTS = {
    "read_shard": "shards",
    "write_shard": "shards",
    "resolve_files": "shards",
    "default_corpus_shards": "corpus",
    "ByteTokenizer": "tokenizer",
    "gpt2_encoding": "tokenizer",
    "TokenShardDataModule": "datamodule",
    "CLTDataModule": "activations",
    "MLPActivationCapture": "activations",
    "CachedActivations": "activations",
    "write_activation_cache": "activations",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
