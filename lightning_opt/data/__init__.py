"""Token shards, tokenizers, the offline corpus, activation sources."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

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
