"""Shard a CLT's decoders over the output (d_model) axis; compose with data parallelism (data x model)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_opt.models.clt import CLT
from lightning_opt.models.clt_parallel import SELECTIONS, CLTShardSpec, all_reduce_grads, sum_forward
from lightning_opt.modules.base import TrainingModule
from lightning_opt.strategies._optim_state import optimizers_to_device
from lightning_opt.strategies._sigterm import install_cpu_sigterm_check, new_cpu_group
from lightning_opt.strategies.global_batch_topk import attach_topk_group

__all__ = ["DecoderShardingStrategy"]

_FORMATS = ("consolidated", "sharded")


def _shard_file(model_rank: int, model_size: int) -> str:
    return f"decoder_shard_{model_rank:03d}_of_{model_size:03d}.ckpt"


class DecoderShardingStrategy(DDPStrategy):
    """Each rank of a decoder group keeps ``d_model / M`` output columns of every CLT decoder.

    Ranks are laid out as ``rank = data_rank * M + model_rank``: the ``M`` ranks of a *decoder group* see the
    same batch, compute the (replicated) encoder and the sparse activations, and each decodes its own slice
    of the output columns, so no ``[tokens, d_model]`` tensor crosses ranks. Backward sums the gradient of the
    sparse activation *values* over the decoder group (``nnz`` floats), which gives the replicated encoder
    its full gradient. With ``D = world / M > 1`` data groups, gradients are averaged over the ``D`` ranks
    that hold the same shard, and BatchTopK is made global over them (as in
    :class:`~lightning_opt.strategies.GlobalBatchTopKStrategy`).

    The module's loss must be a mean over its slice's output columns (e.g. ``F.mse_loss(recon,
    y[..., start:stop])`` with ``start, stop = clt.d_out_slice``): the strategy averages it over the decoder
    group, which equals the full-width mean exactly. Ratio losses use :meth:`loss_sum` / :meth:`data_sum`
    instead (docs/strategies.md); the strategy then leaves the loss alone.

    The strategy builds the process groups, slices every :class:`~lightning_opt.models.clt.CLT` of the module
    at setup (before the optimizers exist) and gives it a
    :class:`~lightning_opt.models.clt_parallel.CLTShardSpec`; the CLT's own ``forward``/``decode`` compute its
    shard. Evaluation (validation, test, predict) runs sharded too, with the spec's ``gather_output`` on, so the
    module sees full-width outputs. Norm clipping needs the module's ``configure_gradient_clipping`` to call
    :func:`lightning_opt.models.clt_parallel.clip_grad_norm_` (the norm of the whole model;
    :class:`~lightning_opt.modules.clt.CLTModule` does); a module that keeps Lightning's default hook is refused
    when ``gradient_clip_val`` is set.

    Checkpoints: ``"consolidated"`` (default) gathers the shards so the file holds full-width tensors and loads
    in one process with any strategy; ``"sharded"`` writes a directory with one file per decoder shard. Both
    load back into this strategy with the same ``M`` (a consolidated one with any ``M``). After ``fit``, the
    shards are gathered back into whole parameters, so the module is whole again.

    Args:
        model_parallel_size: ``M``, ranks per decoder group (default: all ranks, i.e. no data parallelism).
        checkpoint_format: ``"consolidated"`` or ``"sharded"``.
        global_topk: with ``D > 1``, set ``topk_group`` to the data group (big-batch BatchTopK).
        shard_encoder: also shard the encoders over features (``n_features / M`` per rank and layer): each
            rank encodes its features, BatchTopK runs over the union (exact), and the sparse activations are
            all-gathered inside the decoder group. Needs ``activation="batchtopk_global"``.
        selection: how feature-sharded encoders select within one decoder group (``CLTShardSpec.selection``):
            ``"padded_pool"`` (default, no host sync before the decode), ``"synced_pool"`` or ``"general"``.
            With ``D > 1`` and ``global_topk`` the budget spans the data group and the general path runs.
        cpu_sigterm_check: on SIGTERM to any rank, stop every rank at the next optimizer-step boundary,
            agreed once per step over a gloo group (no GPU wait; see ``strategies/_sigterm.py``). False:
            Lightning's own handling (rank 0's flag, per batch, on the device) unless ``AsyncCheckpoint``,
            which installs the same stop with a gloo group of its own, is attached.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (e.g. ``start_method``);
            DDP's own wrapper is not used.

    Example:
        >>> # 4 GPUs = 2 data groups x 2 decoder shards, encoders sharded over features
        >>> strategy = DecoderShardingStrategy(model_parallel_size=2, shard_encoder=True)
        >>> trainer = pl.Trainer(accelerator="gpu", devices=4, strategy=strategy)  # doctest: +SKIP
    """

    strategy_name = "ddp_decoder_sharding"

    def __init__(
        self,
        model_parallel_size: int | None = None,
        checkpoint_format: str = "consolidated",
        global_topk: bool = True,
        shard_encoder: bool = False,
        cpu_sigterm_check: bool = True,
        selection: str = "padded_pool",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if model_parallel_size is not None and (
            isinstance(model_parallel_size, bool)
            or not isinstance(model_parallel_size, int)
            or model_parallel_size < 1
        ):
            raise ValueError(
                f"model_parallel_size must be a positive int or None, got {model_parallel_size!r}"
            )
        if checkpoint_format not in _FORMATS:
            raise ValueError(f"checkpoint_format must be one of {_FORMATS}, got {checkpoint_format!r}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.model_parallel_size = model_parallel_size
        self.checkpoint_format = checkpoint_format
        self.global_topk = global_topk
        self.shard_encoder = shard_encoder
        self.cpu_sigterm_check = cpu_sigterm_check
        self.selection = selection
        self._cpu_group: Any = None
        self._model_group: Any = None
        self._data_group: Any = None
        self._sharded: dict[str, tuple[int, ...]] = {}  # state-dict key -> full shape
        self._clts: list[CLT] = []
        self._loss_sum_calls = 0
        self._failed = False
        self.grad_bytes_per_step = 0
        # Optional callable(name) called after each phase of the feature-sharded forward (benchmarks time
        # phases); passed to the CLTs' specs at setup.
        self.phase_hook: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ layout
    @property
    def mp_size(self) -> int:
        return self.model_parallel_size or self.world_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.mp_size

    @property
    def model_rank(self) -> int:
        return self.global_rank % self.mp_size

    @property
    def data_rank(self) -> int:
        return self.global_rank // self.mp_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one decoder group read the same batch.
        return {"num_replicas": self.dp_size, "rank": self.data_rank}

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        m = self.mp_size
        if self.world_size % m:
            raise ValueError(
                f"model_parallel_size={m} does not divide the world size {self.world_size}; pick a divisor."
            )
        # Every rank must create every group, in the same order.
        for d in range(self.world_size // m):
            group = dist.new_group(list(range(d * m, (d + 1) * m)))
            if d == self.data_rank:
                self._model_group = group
        for j in range(m):
            group = dist.new_group(list(range(j, self.world_size, m)))
            if j == self.model_rank:
                self._data_group = group
        if self.cpu_sigterm_check:
            self._cpu_group = new_cpu_group()

    # ------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_from_rank_zero()
        self._shard()
        self._check_clipping(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        install_cpu_sigterm_check(trainer, self._cpu_group)

    @override
    def configure_ddp(self) -> None:
        """Not used: gradients are averaged over the data group in :meth:`post_backward`."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints are sliced into the already-sharded module

    def _broadcast_from_rank_zero(self) -> None:
        assert self.lightning_module is not None
        with torch.no_grad():
            for t in [*self.lightning_module.parameters(), *self.lightning_module.buffers()]:
                dist.broadcast(t.detach(), src=0)

    def _slice(self, full_last: int) -> tuple[int, int]:
        width = full_last // self.mp_size
        return self.model_rank * width, (self.model_rank + 1) * width

    def _shard(self) -> None:
        module = self.lightning_module
        assert module is not None
        self._clts = [m for m in module.modules() if isinstance(m, CLT)]
        if not self._clts:
            raise ValueError(
                f"DecoderShardingStrategy found no lightning_opt.models.clt.CLT in {type(module).__name__}; "
                "it shards CLT decoders."
            )
        before = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        for clt in self._clts:
            cfg = clt.config
            if cfg.decoder_tying != "untied":
                raise ValueError(
                    f"DecoderShardingStrategy needs untied decoders, got decoder_tying={cfg.decoder_tying!r}; "
                    "use GlobalBatchTopKStrategy (data parallel) for tied decoders."
                )
            if cfg.d_model % self.mp_size:
                raise ValueError(
                    f"d_model={cfg.d_model} is not divisible by model_parallel_size={self.mp_size}; pick a "
                    "model_parallel_size that divides d_model."
                )
            if self.mp_size > 1:
                clt.shard_(self._spec(clt))
            if self.global_topk and self.dp_size > 1:
                attach_topk_group(clt, self._data_group)
        after = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        self._sharded = {k: before[k] for k in after if after[k] != before[k]}

    def _spec(self, clt: CLT) -> CLTShardSpec:
        """This rank's part of ``clt``: its output columns (and features), and the mesh's groups."""
        cfg = clt.config
        features = None
        if self.shard_encoder:
            if cfg.activation != "batchtopk_global":
                raise ValueError(
                    f"shard_encoder=True needs activation='batchtopk_global' (one budget over all features), "
                    f"got {cfg.activation!r}; use shard_encoder=False."
                )
            if cfg.n_features % self.mp_size:
                raise ValueError(
                    f"n_features={cfg.n_features} is not divisible by model_parallel_size={self.mp_size}."
                )
            features = self._slice(cfg.n_features)
        return CLTShardSpec(
            d_out=self._slice(cfg.d_model),
            features=features,
            model_group=self._model_group,
            model_size=self.mp_size,
            model_rank=self.model_rank,
            data_group=self._data_group,
            data_size=self.dp_size,
            data_rank=self.data_rank,
            mesh_group=dist.group.WORLD,
            selection=self.selection,
            phase_hook=self.phase_hook,
        )

    def _check_clipping(self, trainer: pl.Trainer) -> None:
        """Norm clipping of shards needs the module's hook to compute the whole model's norm."""
        module = self.lightning_module
        if self.mp_size == 1 or not trainer.gradient_clip_val or trainer.gradient_clip_algorithm == "value":
            return
        hook = type(module).configure_gradient_clipping
        if hook in (pl.LightningModule.configure_gradient_clipping, TrainingModule.configure_gradient_clipping):
            raise ValueError(
                f"gradient_clip_val with DecoderShardingStrategy(model_parallel_size={self.mp_size}): "
                f"{type(module).__name__}.configure_gradient_clipping would clip each rank's shards by their own "
                "norm. Override it to call lightning_opt.models.clt_parallel.clip_grad_norm_(self, params, "
                "gradient_clip_val) (the norm of the whole model), as CLTModule does."
            )

    def _set_gather_output(self, gather: bool) -> None:
        for clt in self._clts:
            if clt.shard is not None and clt.shard.gather_output != gather:
                clt.shard = replace(clt.shard, gather_output=gather)

    # Evaluation runs sharded with full-width outputs: the module's metrics compare with full-width targets.
    @override
    def on_validation_start(self) -> None:
        self._set_gather_output(True)

    @override
    def on_validation_end(self) -> None:
        self._set_gather_output(False)

    @override
    def on_test_start(self) -> None:
        self._set_gather_output(True)

    @override
    def on_test_end(self) -> None:
        self._set_gather_output(False)

    @override
    def on_predict_start(self) -> None:
        self._set_gather_output(True)

    @override
    def on_predict_end(self) -> None:
        self._set_gather_output(False)

    # ---------------------------------------------------------------- training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._loss_sum_calls = 0
        out = super().training_step(*args, **kwargs)
        if self.mp_size == 1 or self._loss_sum_calls:
            return out
        # Mean of the slice means over equal slices is the full-width mean.
        if isinstance(out, torch.Tensor):
            return sum_forward(out, self._model_group) / self.mp_size
        if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
            return {**out, "loss": sum_forward(out["loss"], self._model_group) / self.mp_size}
        return out

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.dp_size > 1:
            assert self.lightning_module is not None
            params = [p for p in self.lightning_module.parameters() if p.requires_grad]
            self.grad_bytes_per_step = all_reduce_grads(params, self._data_group, self.dp_size)

    def loss_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Differentiable sum of a scalar loss term over all ranks (backward scaled for data averaging)."""
        self._loss_sum_calls += 1
        return sum_forward(t, dist.group.WORLD, grad_scale=float(self.dp_size))

    def data_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks holding the same columns, without gradient (batch statistics)."""
        out = t.detach().to(self.root_device, copy=True)  # NCCL needs device tensors
        if self.dp_size > 1:
            dist.all_reduce(out, group=self._data_group)
        return out

    # ------------------------------------------------------------- checkpoints
    def _gather_last(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.mp_size)]
        dist.all_gather(parts, t.contiguous(), group=self._model_group)
        return torch.cat(parts, dim=-1)

    def _gather_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, **{name: self._gather_last(state[name]) for name in self._sharded}}

    def _slice_state(self, state: dict[str, Any]) -> dict[str, Any]:
        out = dict(state)
        for name, full in self._sharded.items():
            if name not in state:
                continue
            t = state[name]
            if tuple(t.shape) == full:
                start, stop = self._slice(full[-1])
                out[name] = t[..., start:stop].contiguous()
            elif t.shape[-1] * self.mp_size != full[-1]:
                raise ValueError(
                    f"checkpoint entry {name!r} has shape {tuple(t.shape)}; expected the full {full} or a 1/"
                    f"{self.mp_size} shard. A sharded checkpoint loads only with the same model_parallel_size."
                )
        return out

    def _param_names(self, optimizer: torch.optim.Optimizer) -> list[str | None]:
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        return self._gather_state(state) if self.checkpoint_format == "consolidated" else state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self.checkpoint_format != "consolidated" or not self._sharded:
            return state
        assert self.lightning_module is not None
        opt = getattr(optimizer, "_optimizer", optimizer)
        names = self._param_names(opt)
        new_state = {}
        for idx, entry in state["state"].items():
            name = names[idx]
            if name in self._sharded:
                full = self._sharded[name]
                shard_shape = torch.Size((*full[:-1], full[-1] // self.mp_size))
                entry = {
                    k: self._gather_last(v) if isinstance(v, torch.Tensor) and v.shape == shard_shape else v
                    for k, v in entry.items()
                }
            new_state[idx] = entry
        return {**state, "state": new_state}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.checkpoint_format == "consolidated":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        # One file per decoder shard, written by the first data-parallel replica of that shard.
        if self.data_rank == 0:
            os.makedirs(filepath, exist_ok=True)
            meta = {"decoder_sharding": {"model_parallel_size": self.mp_size, "model_rank": self.model_rank}}
            path = Path(filepath) / _shard_file(self.model_rank, self.mp_size)
            self.checkpoint_io.save_checkpoint({**checkpoint, **meta}, path, storage_options=storage_options)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if path.is_dir():
            shard = path / _shard_file(self.model_rank, self.mp_size)
            if not shard.exists():
                found = sorted(p.name for p in path.glob("decoder_shard_*"))
                raise FileNotFoundError(
                    f"sharded checkpoint {path} has no {shard.name} (found {found}); load it with the "
                    "model_parallel_size it was saved with, or save a consolidated checkpoint."
                )
            return self.checkpoint_io.load_checkpoint(shard, weights_only=weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if isinstance(checkpoint.get("state_dict"), dict):
            # this rank's slices, so the module's on_load_checkpoint compares with the shapes it holds
            checkpoint["state_dict"] = self._slice_state(checkpoint["state_dict"])
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(self._slice_state(checkpoint["state_dict"]), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            names = self._param_names(optimizer)
            state = {}
            for idx, entry in opt_state["state"].items():
                name = names[idx]
                if name in self._sharded:
                    full, start, stop = self._sharded[name], *self._slice(self._sharded[name][-1])
                    entry = {
                        k: v[..., start:stop].contiguous()
                        if isinstance(v, torch.Tensor) and tuple(v.shape) == full
                        else v
                        for k, v in entry.items()
                    }
                state[idx] = entry
            optimizer.load_state_dict({**opt_state, "state": state})
        optimizers_to_device(self.optimizers, self.root_device)

    # ---------------------------------------------------------------- teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collectives in teardown: other ranks may not reach them
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if not self._failed and dist.is_available() and dist.is_initialized():
            for clt in self._clts:
                clt.unshard_()  # whole parameters again (the optimizers are done with the shards)
        for clt in self._clts:
            attach_topk_group(clt, None)
        self._sharded = {}
        super().teardown()
