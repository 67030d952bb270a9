"""Data parallelism with FSDP2-sharded CLT parameters, gradients and optimizer state, and an exact global BatchTopK."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_opt.strategies._sigterm import install_cpu_sigterm_check, new_cpu_group
from lightning_opt.strategies.global_batch_topk import GlobalBatchTopKStrategy, attach_topk_group

__all__ = ["FSDPGlobalBatchTopKStrategy", "consolidate_checkpoint", "largest_dim_placement"]


def largest_dim_placement(param: torch.nn.Parameter) -> Any:
    """FSDP2 ``shard_placement_fn``: shard each parameter on its largest dimension (the first of equals).

    A CLT's ``W_enc`` ``[L, d, F]`` and ``b_enc`` ``[L, F]`` would otherwise be sharded on the layer axis, padded to
    a multiple of the ranks (12 layers on 8 ranks: 16 rows, a third of the bytes padding); on ``F`` or ``d`` the
    padding is at most ``N - 1`` slices of that axis.
    """
    from torch.distributed.tensor import Shard

    if param.dim() == 0:
        return None
    sizes = list(param.shape)
    return Shard(sizes.index(max(sizes)))


def consolidate_checkpoint(path: str | Path, output: str | Path | None = None) -> Path:
    """Write the distributed checkpoint directory ``path`` (this strategy's default format) as one ordinary
    Lightning checkpoint file and return its path (default: ``<path>.consolidated``), in one process.

    The file loads with ``CLTModule.load_from_checkpoint(file)`` (or ``torch.load(file, weights_only=True)``); its
    optimizer state is keyed by parameter name (torch's distributed-checkpoint format). Holds the whole model and optimizer state in CPU memory once. (Lightning's
    ``consolidate_checkpoint`` command reads FSDPStrategy checkpoints, whose weights sit under another key.)
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path)
    meta = path / "meta.pt"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint directory (no meta.pt)")
    output = Path(output) if output is not None else path.with_name(path.name + ".consolidated")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "weights.pt")
        tensors = torch.load(Path(tmp) / "weights.pt", map_location="cpu", weights_only=True)
    checkpoint = torch.load(meta, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = tensors.pop("state_dict")
    n_opt = sum(1 for key in tensors if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [tensors.pop(f"optimizer_{i}") for i in range(n_opt)]
    torch.save(checkpoint, output)
    return output


class FSDPGlobalBatchTopKStrategy(ModelParallelStrategy):
    """Data parallelism where FSDP2 (``fully_shard``) shards every CLT's parameters, gradients and optimizer state
    over the ranks, and the BatchTopK keeps the ``k * tokens`` largest entries of the *global* batch.

    At setup it applies :func:`torch.distributed.fsdp.fully_shard` to every submodule that has a ``topk_group``
    attribute (the CLT's contract), over the one-dimensional data-parallel mesh (all ranks), and sets that
    attribute to the mesh's process group, so the selection is the big-batch one exactly (as
    :class:`~lightning_opt.strategies.GlobalBatchTopKStrategy`). The LightningModule needs no ``configure_model``.
    Each step FSDP2 all-gathers the parameters before the CLT's forward (the model's ops see plain tensors) and
    reduce-scatters the gradients after backward; each rank's optimizer updates its shard only. Nothing is
    all-reduced. See docs/strategies.md ("Sharded data parallel").

    Every parameter of the LightningModule must belong to such a submodule (others would not be synchronised).
    Code that reads the CLT's parameters outside its ``forward`` in the training step (``CLTModule``'s sparsity
    penalty and AuxK) needs ``reshard_after_forward=False`` (the default): the gathered parameters then stay in
    place until the gradients are reduce-scattered at the end of backward.

    Checkpoints: with ``save_distributed_checkpoint=True`` (the default) a checkpoint is a directory (one shard
    per rank plus ``meta.pt``), resumed with ``trainer.fit(ckpt_path=dir)`` under this strategy and converted to
    one file by :func:`consolidate_checkpoint` (then ``CLTModule.load_from_checkpoint(file)``);
    ``save_distributed_checkpoint=False`` writes one ordinary checkpoint file from rank 0.

    Args:
        reshard_after_forward: ``False`` (ZeRO-2 style): the gathered parameters stay from forward to the end of
            backward, one all-gather per step. ``True`` (ZeRO-3 style): freed after forward and gathered again
            for backward (less memory, a second all-gather).
        require_topk_module: raise if no submodule has ``topk_group`` (catches a wrong model early).
        cpu_sigterm_check: on SIGTERM to any rank, stop every rank at the next optimizer-step boundary,
            agreed once per step over a gloo group (no GPU wait; see ``strategies/_sigterm.py``). False:
            Lightning's own handling (rank 0's flag, per batch, on the device) unless ``AsyncCheckpoint``,
            which installs the same stop with a gloo group of its own, is attached.
        save_distributed_checkpoint, process_group_backend, timeout: as
            :class:`~lightning.pytorch.strategies.ModelParallelStrategy`.

    Example:
        >>> trainer = pl.Trainer(strategy=FSDPGlobalBatchTopKStrategy(), devices=4)  # doctest: +SKIP
    """

    strategy_name = "fsdp_global_batchtopk"

    def __init__(
        self,
        reshard_after_forward: bool = False,
        require_topk_module: bool = True,
        cpu_sigterm_check: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, **kw,
        )  # fmt: skip
        self.reshard_after_forward = reshard_after_forward
        self.require_topk_module = require_topk_module
        self.cpu_sigterm_check = cpu_sigterm_check
        self._cpu_group: Any = None
        self.topk_modules = 0

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank holds a data shard
        self._tensor_parallel_size = 1
        super().setup_environment()
        if self.cpu_sigterm_check:
            self._cpu_group = new_cpu_group()

    @property
    def topk_group(self) -> Any:
        """The process group the selection and the sharding run over (all ranks)."""
        return self.device_mesh["data_parallel"].get_group()

    def _shard_modules(self) -> None:
        from torch.distributed.fsdp import fully_shard

        module = self.lightning_module
        assert module is not None
        targets = [(name, sub) for name, sub in module.named_modules() if hasattr(sub, "topk_group")]
        # outermost only: a CLT inside another module that has the attribute is sharded with it
        targets = [(n, s) for n, s in targets if not any(n.startswith(o + ".") for o, _ in targets if o != n)]
        self.topk_modules = len(targets)
        if self.require_topk_module and not targets:
            raise ValueError(
                f"{type(self).__name__} found no submodule with a `topk_group` attribute in "
                f"{type(module).__name__}; it needs a model whose BatchTopK reads `topk_group` "
                "(e.g. lightning_opt.models.clt.CLT with activation='batchtopk_global'), or pass "
                "require_topk_module=False."
            )
        covered = {id(p) for _, sub in targets for p in sub.parameters()}
        loose = [n for n, p in module.named_parameters() if id(p) not in covered]
        if loose:
            raise ValueError(
                f"{type(self).__name__} shards only the CLT submodules; these parameters of "
                f"{type(module).__name__} are outside them and would not be synchronised: {loose}"
            )
        mesh = self.device_mesh["data_parallel"]
        for _, sub in targets:
            fully_shard(sub, mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                        shard_placement_fn=largest_dim_placement)
        attach_topk_group(module, self.topk_group)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup without its configure_model requirement: the strategy shards the CLTs itself
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._shard_modules()  # before the optimizers: their state then holds this rank's shards only
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        install_cpu_sigterm_check(trainer, self._cpu_group)

    def _reshard(self) -> None:
        # an evaluation forward (no backward) leaves the gathered parameters in place when
        # reshard_after_forward=False: free them, so training steps start from the shards
        from torch.distributed.fsdp import FSDPModule

        if self.lightning_module is not None:
            for sub in self.lightning_module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    @override
    def on_validation_end(self) -> None:
        self._reshard()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._reshard()
        super().on_test_end()

    @override
    def on_predict_end(self) -> None:
        self._reshard()
        super().on_predict_end()

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None:
            attach_topk_group(self.lightning_module, None)
        super().teardown()

    # the big-batch loss helpers of GlobalBatchTopKStrategy (they read topk_group and root_device only); FSDP2
    # averages gradients over the ranks as DDP does, so loss_sum's backward scaling holds unchanged
    data_sum = GlobalBatchTopKStrategy.data_sum
    loss_sum = GlobalBatchTopKStrategy.loss_sum
