"""Small pure functions and kernels."""

from __future__ import annotations

from lightning_opt._lazy import lazy_exports

_EXPORTS = {
    "attention": "attention",
    "global_batch_topk": "global_topk",
    "batch_topk_threshold_sparse": "global_topk",
    "clt_sparse_decode": "sparse_decode",
    "batch_topk_rows": "topk",
    "token_topk": "topk",
    "jumprelu": "topk",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
