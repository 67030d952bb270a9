"""DDP whose BatchTopK selects over the union of all ranks' tokens (the big-batch selection, exactly)."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_opt.models.clt_parallel import sum_forward
from lightning_opt.strategies._sigterm import install_cpu_sigterm_check, new_cpu_group

__all__ = ["GlobalBatchTopKStrategy", "attach_topk_group"]

GradCompression = Literal["none", "bf16", "fp16"]
# torch's DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks)
_COMPRESSION = {"none": None, "bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}


def attach_topk_group(module: torch.nn.Module, group: Any) -> int:
    """Set ``topk_group`` on every submodule that has the attribute; return how many were set."""
    count = 0
    for sub in module.modules():
        if hasattr(sub, "topk_group"):
            sub.topk_group = group
            count += 1
    return count


class GlobalBatchTopKStrategy(DDPStrategy):
    """Data parallelism where a CLT's BatchTopK keeps the ``k * tokens`` largest entries of the *global* batch.

    After setup it sets ``topk_group`` on every submodule that has that attribute (the CLT's contract), so
    :func:`lightning_opt.ops.global_topk.global_batch_topk` selects over all ranks; the module is unchanged.
    N ranks with batch B then give the masks, losses and gradients of one process with batch N x B, provided
    the loss is a per-rank mean over equal batches (DDP averages gradients) or uses :meth:`loss_sum` for
    ratio losses. See docs/strategies.md.

    Gradients are all-reduced by DDP (overlapped with backward, buckets of ``bucket_cap_mb``). By default the
    gradients are views into DDP's buckets (``gradient_as_bucket_view=True``: no copy in or out of the
    buckets; numerics unchanged).

    Args:
        require_topk_module: raise if no submodule has ``topk_group`` (catches a wrong model early).
        grad_compression: ``"none"`` (default; ``None`` means the same: exact float32 all-reduce) or
            ``"bf16"``/``"fp16"``: torch's DDP communication hook (``bf16_compress_hook`` /
            ``fp16_compress_hook``) casts each bucket to 16 bits before the all-reduce and back after,
            halving the bytes sent; the buckets still overlap with backward. This CHANGES the numerics
            (gradients are rounded to 8 or 11 mantissa bits before averaging), so results are no longer
            bit-comparable with one process. ``"bf16"`` needs CUDA and NCCL.
        cpu_sigterm_check: on SIGTERM to any rank, stop every rank at the next optimizer-step boundary,
            agreed once per step over a gloo group (no GPU wait; see ``strategies/_sigterm.py``). False:
            Lightning's own handling (rank 0's flag, per batch, on the device) unless ``AsyncCheckpoint``,
            which installs the same stop with a gloo group of its own, is attached.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (e.g. ``start_method``,
            ``process_group`` for a sub-group, ``bucket_cap_mb``, ``static_graph``).

    Example:
        >>> trainer = pl.Trainer(strategy=GlobalBatchTopKStrategy(), devices=2)  # doctest: +SKIP
    """

    strategy_name = "ddp_global_batchtopk"

    def __init__(
        self,
        require_topk_module: bool = True,
        grad_compression: GradCompression | None = "none",
        cpu_sigterm_check: bool = True,
        **kwargs: Any,
    ) -> None:
        grad_compression = "none" if grad_compression is None else grad_compression
        if grad_compression not in _COMPRESSION:
            raise ValueError(f"grad_compression must be one of {list(_COMPRESSION)}, got {grad_compression!r}")
        if grad_compression != "none" and kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("pass either grad_compression or ddp_comm_hook, not both")
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**kwargs)
        self.ddp_process_group: Any = kwargs.get("process_group")  # DDP's group, None for the default one
        self.grad_compression: GradCompression = grad_compression
        self.cpu_sigterm_check = cpu_sigterm_check
        self._cpu_group: Any = None
        self.require_topk_module = require_topk_module
        self.topk_modules = 0

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.grad_compression != "none":
            # Registered here rather than through Lightning's ddp_comm_hook, which skips CPU (gloo) runs.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            if self.grad_compression == "bf16" and self.root_device.type != "cuda":
                raise ValueError(
                    "grad_compression='bf16' needs CUDA and NCCL (torch's bf16 hook); on CPU use 'fp16'."
                )
            hook = getattr(default_hooks, _COMPRESSION[self.grad_compression])
            self.model.register_comm_hook(self.ddp_process_group, hook)

    @property
    def topk_group(self) -> Any:
        """The process group the selection runs over (DDP's group)."""
        return self.ddp_process_group or dist.group.WORLD

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self.cpu_sigterm_check:
            self._cpu_group = new_cpu_group()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        install_cpu_sigterm_check(trainer, self._cpu_group)
        assert self.lightning_module is not None
        self.topk_modules = attach_topk_group(self.lightning_module, self.topk_group)
        if self.require_topk_module and self.topk_modules == 0:
            raise ValueError(
                "GlobalBatchTopKStrategy found no submodule with a `topk_group` attribute in "
                f"{type(self.lightning_module).__name__}; it needs a model whose BatchTopK reads `topk_group` "
                "(e.g. lightning_opt.models.clt.CLT with activation='batchtopk_global'), or pass "
                "require_topk_module=False."
            )

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            attach_topk_group(self.lightning_module, None)  # the module works locally again afterwards
        super().teardown()

    def data_sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce sum over the data-parallel ranks, without gradient (for batch statistics)."""
        out = t.detach().to(self.root_device, copy=True)  # NCCL needs device tensors
        dist.all_reduce(out, group=self.topk_group)
        return out

    def loss_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Differentiable all-reduce sum of a loss term over the ranks; backward scaled by the world size.

        ``loss = loss_sum(sse) / loss_sum(sst)`` is then the big-batch ratio on every rank, and DDP's gradient
        averaging (division by the world size) yields the big-batch gradient.
        """
        world = dist.get_world_size(self.topk_group)
        return sum_forward(t, self.topk_group, grad_scale=float(world))
