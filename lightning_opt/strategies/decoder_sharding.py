"""Shard a CLT's decoders over the output (d_model) axis; compose with data parallelism (data x model)."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_opt.strategies._collectives import (
    all_reduce_grads,
    gather_padded,
    gather_sparse,
    sum_backward,
    sum_forward,
    take_masked,
    take_unique,
)
from lightning_opt.strategies._sigterm import install_cpu_sigterm_check, new_cpu_group
from lightning_opt.strategies.global_batch_topk import attach_topk_group

__all__ = ["DecoderShardingStrategy"]


def _no_mark(name: str) -> None:
    pass


_FORMATS = ("consolidated", "sharded")
# Feature-sharded encoders within one decoder group: gather the candidates and select on every rank (True)
# or the general path (selection collectives, then a gather of the kept entries). benchmarks/clt_scaling.py
# compares them.
_POOL_SELECT = True
# the pool selection without a host sync before the gather (fixed-size candidate buffers, checked at the
# decode's bounds sync); False: the synced candidate step (benchmarks/clt_scaling.py's A/B)
_PADDED_POOL = True


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

    Checkpoints: ``"consolidated"`` (default) gathers the shards so the file holds full-width tensors and loads
    in one process with any strategy; ``"sharded"`` writes a directory with one file per decoder shard. Both
    load back into this strategy with the same ``M`` (a consolidated one with any ``M``). After ``fit``, the
    decoders are gathered back, so the module is whole again.

    Args:
        model_parallel_size: ``M``, ranks per decoder group (default: all ranks, i.e. no data parallelism).
        checkpoint_format: ``"consolidated"`` or ``"sharded"``.
        global_topk: with ``D > 1``, set ``topk_group`` to the data group (big-batch BatchTopK).
        shard_encoder: also shard the encoders over features (``n_features / M`` per rank and layer): each
            rank encodes its features, BatchTopK runs over the union (exact), and the sparse activations are
            all-gathered inside the decoder group. Needs ``activation="batchtopk_global"``.
        cpu_sigterm_check: run Lightning's per-step SIGTERM flag exchange over a gloo group instead of the
            device, so it does not wait for the GPU every step (see ``strategies/_sigterm.py``).
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
        self.model_parallel_size = model_parallel_size
        self.checkpoint_format = checkpoint_format
        self.global_topk = global_topk
        self.shard_encoder = shard_encoder
        self.cpu_sigterm_check = cpu_sigterm_check
        self._cpu_group: Any = None
        self._model_group: Any = None
        self._data_group: Any = None
        self._sharded: dict[str, tuple[int, ...]] = {}  # state-dict key -> full shape
        self._clts: list[torch.nn.Module] = []
        self._loss_sum_calls = 0
        self._full_now = False  # module temporarily whole (evaluation inside fit)
        self._failed = False
        self.grad_bytes_per_step = 0
        # Optional callable(name) called after each phase of the sharded forward (benchmarks time phases).
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
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        install_cpu_sigterm_check(trainer, self._cpu_group)
        if self.mp_size > 1:
            # Norm clipping must see the norm of the whole model, not of this rank's shards.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

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
                dist.broadcast(t.data, src=0)

    def _slice(self, full_last: int) -> tuple[int, int]:
        width = full_last // self.mp_size
        return self.model_rank * width, (self.model_rank + 1) * width

    def _shard(self) -> None:
        module = self.lightning_module
        assert module is not None
        self._clts = [m for m in module.modules() if hasattr(m, "shard_decoder_")]
        if not self._clts:
            raise ValueError(
                f"DecoderShardingStrategy found no submodule with `shard_decoder_` in {type(module).__name__}; "
                "it shards lightning_opt.models.clt.CLT decoders."
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
                clt.shard_decoder_(*self._slice(cfg.d_model))
                if self.shard_encoder:
                    self._shard_encoder(clt)
                self._wrap_decode(clt)
            if self.global_topk and self.dp_size > 1:
                attach_topk_group(clt, self._data_group)
        after = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        self._sharded = {k: before[k] for k in after if after[k] != before[k]}

    def _shard_encoder(self, clt: torch.nn.Module) -> None:
        cfg = clt.config
        if cfg.activation != "batchtopk_global":
            raise ValueError(
                f"shard_encoder=True needs activation='batchtopk_global' (one budget over all features), got "
                f"{cfg.activation!r}; use shard_encoder=False."
            )
        if cfg.n_features % self.mp_size:
            raise ValueError(
                f"n_features={cfg.n_features} is not divisible by model_parallel_size={self.mp_size}."
            )
        start, stop = self._slice(cfg.n_features)
        with torch.no_grad():
            clt.W_enc.data = clt.W_enc.data[..., start:stop].contiguous()
            clt.b_enc.data = clt.b_enc.data[..., start:stop].contiguous()

    def _wrap_forward(self, clt: torch.nn.Module) -> None:
        """Forward with feature-sharded encoders: local encode, exact global BatchTopK, gather sparse acts."""
        from lightning_opt.models.clt import CLTOutput
        from lightning_opt.ops.global_topk import batch_topk_threshold_sparse

        decode_sparse = type(clt).decode_sparse.__get__(clt)  # unwrapped: the gather sums the gradients
        strategy = self

        def sharded_forward(x: torch.Tensor, dense: bool | None = None) -> Any:
            pre = clt.encode(x)  # [L, N, F / M]: this rank's features of every layer
            n_layers, n_tokens, width = pre.shape
            n_features = clt.config.n_features
            mark = strategy.phase_hook or _no_mark
            mark("encode")
            if _POOL_SELECT and not (strategy.global_topk and strategy.dp_size > 1):
                return strategy._select_in_group(clt, pre, decode_sparse, mark)
            first = 0
            if strategy.global_topk and strategy.dp_size > 1:
                group, tokens_total = (
                    dist.group.WORLD,
                    int(strategy.data_sum(pre.new_tensor(float(n_tokens)))),
                )
                first = strategy.data_rank * strategy.mp_size  # this decoder group's ranks in WORLD
            else:
                group, tokens_total = strategy._model_group, n_tokens
            idx, vals, counts = batch_topk_threshold_sparse(
                pre.reshape(n_tokens, n_layers * width),
                clt.config.k,
                group=group,
                tokens_total=tokens_total,
                return_counts=True,
                # equal feature shards: every token has n_layers * n_features entries over the group, so the
                # selection needs no host sync to size itself
                numel_total=tokens_total * n_layers * n_features,
            )
            mark("select")
            # Local flat index in [L, N, F/M] -> global flat index in [L, N, F].
            layer_token = torch.div(idx, width, rounding_mode="floor")
            feature = idx - layer_token * width + strategy.model_rank * width
            all_idx, all_vals = gather_sparse(
                layer_token * n_features + feature,
                torch.relu(vals),
                strategy._model_group,
                strategy.mp_size,
                counts=counts[first : first + strategy.mp_size],
            )
            all_idx, order = torch.sort(all_idx)  # rank-order runs -> ascending (the decode's layout)
            all_vals = all_vals[order]
            mark("gather")
            recon = decode_sparse(all_idx, all_vals, n_tokens)
            mark("decode")
            return CLTOutput(recon, pre, None, all_idx, all_vals)

        clt.forward = sharded_forward

    def _select_in_group(
        self,
        clt: torch.nn.Module,
        pre: torch.Tensor,
        decode_sparse: Callable[..., Any],
        mark: Callable[[str], None],
        padded: bool | None = None,
    ) -> Any:
        """BatchTopK over one decoder group (same tokens, features split): gather candidates, select on every rank.

        One gather of every rank's candidates (about ``1.1 K`` entries over the group) replaces the
        value gather, tie-count gather and kept-entry gather of the general path; each rank then finds the
        same ``K`` entries in the pool (sort cut-off, fixed output size). ``padded`` (default ``_PADDED_POOL``):
        fixed-size candidate buffers and no host sync before the decode's layer bounds, read together with
        the pool's exactness flag (false: this method reruns with ``padded=False``, the synced candidate step).
        """
        from lightning_opt.models.clt import CLTOutput
        from lightning_opt.ops.global_topk import shard_candidates, shard_candidates_padded, top_positions

        n_layers, n_tokens, width = pre.shape
        n_features, k = clt.config.n_features, clt.config.k
        group, world = self._model_group, self.mp_size
        if padded is None:
            padded = _PADDED_POOL
        padded_out = shard_candidates_padded(pre, k, group, n_tokens) if padded else None
        if padded_out is not None:
            # No host sync until the decode's layer bounds: candidates in fixed-size buffers (-1 past the count)
            idx, _, ok = padded_out
            valid = idx >= 0
            idx = idx.clamp(min=0)
            values, counts = take_masked(pre.reshape(-1), idx, valid), [idx.numel()] * world
        else:
            idx, counts = shard_candidates(pre, k, group, n_tokens)
            values, ok = take_unique(pre.reshape(-1), idx), None
        mark("select")
        # Local flat index in [L, N, F / M] -> global flat index in [L, N, F] (int32 when it fits: fewer
        # bytes to gather and a 4-byte sort).
        layer_token = torch.div(idx, width, rounding_mode="floor")
        global_idx = idx + layer_token * (n_features - width) + self.model_rank * width
        if n_layers * n_tokens * n_features < 2**31:
            global_idx = global_idx.to(torch.int32)
        if ok is not None:
            global_idx = torch.where(valid, global_idx, -1)  # padding: the receivers' valid mask
        pool_idx, pool_vals, pool_valid = gather_padded(global_idx, values, group, world, counts)
        big_k = k * n_tokens if ok is not None else min(k * n_tokens, sum(counts))
        pos = top_positions(pool_vals.detach(), pool_valid, big_k)
        # rank-major pool -> ascending global indices (grouped by layer, then token: the decode's layout)
        all_idx, order = torch.sort(pool_idx[pos])
        all_vals = torch.relu(take_unique(pool_vals, pos[order]))
        all_idx = all_idx.long()
        layer_bounds = None
        if ok is not None:
            # the one host sync of the forward: the decode's layer bounds, and whether the padded pool held the
            # exact top-K (else, rarely, redo with the synced path)
            edges = torch.arange(n_layers + 1, device=all_idx.device) * (n_tokens * n_features)
            host = torch.cat([torch.searchsorted(all_idx, edges), ok.long().view(1)]).tolist()
            if not host[-1]:
                return self._select_in_group(clt, pre, decode_sparse, mark, padded=False)
            layer_bounds = host[:-1]
        mark("gather")
        recon = decode_sparse(all_idx, all_vals, n_tokens, layer_bounds=layer_bounds)
        mark("decode")
        return CLTOutput(recon, pre, None, all_idx, all_vals)

    def _wrap_decode(self, clt: torch.nn.Module) -> None:
        decode_sparse = clt.decode_sparse
        group = self._model_group

        def sharded_decode_sparse(indices: torch.Tensor, values: torch.Tensor, n_tokens: int) -> torch.Tensor:
            # Backward sums d(loss)/d(values) over the decoder group: the encoder gets the full gradient.
            return decode_sparse(indices, sum_backward(values, group), n_tokens)

        def sharded_decode(acts: torch.Tensor) -> torch.Tensor:
            # Dense activations go through the sparse path so only nnz gradient values cross ranks.
            # nonzero syncs with the host once (the count sizes the sparse form).
            flat = acts.reshape(-1)
            idx = torch.nonzero(flat.detach()).squeeze(1)
            return sharded_decode_sparse(idx, flat[idx], acts.shape[1])

        clt.decode_sparse = sharded_decode_sparse
        clt.decode = sharded_decode
        if self.shard_encoder:
            self._wrap_forward(clt)

    def _set_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point the sharded entries at ``tensors`` (parameters keep their identity for the optimizer)."""
        module = self.lightning_module
        assert module is not None
        with torch.no_grad():
            for name, value in tensors.items():
                owner_name, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                current = getattr(owner, attr)
                if isinstance(current, torch.nn.Parameter):
                    current.data = value
                else:
                    setattr(owner, attr, value)

    def _gather_full(self) -> None:
        """Make the module whole: gather every decoder shard; decode runs unsharded."""
        module = self.lightning_module
        if module is None or not self._sharded or self._full_now:
            return
        state = module.state_dict(keep_vars=True)
        self._set_tensors({name: self._gather_last(state[name].detach()) for name in self._sharded})
        for clt in self._clts:
            clt.d_out_slice = None
            for attr in ("decode", "decode_sparse", "forward"):
                with suppress(AttributeError):
                    delattr(clt, attr)
        self._full_now = True

    def _reshard(self) -> None:
        """Back to this rank's slice after an evaluation on the whole module."""
        module = self.lightning_module
        if module is None or not self._full_now:
            return
        state = module.state_dict(keep_vars=True)
        sliced = {}
        for name, full in self._sharded.items():
            start, stop = self._slice(full[-1])
            sliced[name] = state[name].detach()[..., start:stop].contiguous()
        self._set_tensors(sliced)
        for clt in self._clts:
            clt.d_out_slice = self._slice(clt.config.d_model)
            self._wrap_decode(clt)
        self._full_now = False

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``clip_grad_norm_`` with the global norm: shard norms summed over the decoder group, once each."""
        assert self.lightning_module is not None
        sharded = {id(p) for n, p in self.lightning_module.named_parameters() if n in self._sharded}
        params = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        if not params:
            return
        zero = params[0].grad.new_zeros((), dtype=torch.float32)
        sq_sharded = sum((p.grad.detach().float().pow(2).sum() for p in params if id(p) in sharded), zero)
        sq_shared = sum((p.grad.detach().float().pow(2).sum() for p in params if id(p) not in sharded), zero)
        dist.all_reduce(sq_sharded, group=self._model_group)
        coef = (clip_val / ((sq_sharded + sq_shared).sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef)

    # Evaluation runs on the whole module: the module's metrics compare with full-width targets.
    @override
    def on_validation_start(self) -> None:
        self._gather_full()

    @override
    def on_validation_end(self) -> None:
        assert self.lightning_module is not None
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._reshard()

    @override
    def on_test_start(self) -> None:
        self._gather_full()

    @override
    def on_predict_start(self) -> None:
        self._gather_full()

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
        if self.checkpoint_format == "consolidated":
            return state if self._full_now else self._gather_state(state)
        return self._slice_state(state) if self._full_now else state

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
                # Optimizer moments stay sharded even while the module is whole for evaluation.
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
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

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
        _optimizers_to_device(self.optimizers, self.root_device)

    # ---------------------------------------------------------------- teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # no collectives in teardown: other ranks may not reach them
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if not self._failed and dist.is_available() and dist.is_initialized():
            self._gather_full()
        for clt in self._clts:
            attach_topk_group(clt, None)
        self._sharded, self._full_now = {}, False
        super().teardown()
