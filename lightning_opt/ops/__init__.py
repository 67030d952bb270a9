"""Small pure functions and kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opt._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see (explicit re-exports); at run time names load on first use
    from lightning_opt.ops.attention import attention as attention
    from lightning_opt.ops.global_topk import batch_topk_threshold_sparse as batch_topk_threshold_sparse
    from lightning_opt.ops.global_topk import global_batch_topk as global_batch_topk
    from lightning_opt.ops.sparse_decode import clt_sparse_decode as clt_sparse_decode
    from lightning_opt.ops.topk import batch_topk_rows as batch_topk_rows
    from lightning_opt.ops.topk import jumprelu as jumprelu
    from lightning_opt.ops.topk import token_topk as token_topk

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
