"""Cross-layer transcoder (CLT): plain torch model, activations, the AuxK loss and the circuit-tracer export.

A CLT reads the MLP input (normalised residual stream) ``x_l`` of every layer ``l`` and reconstructs the MLP
output ``y_t`` of every layer ``t`` from the features of all layers ``l <= t`` (Anthropic, "Circuit
Tracing", 2025)::

    a_l   = act(x_l W_enc[l] + b_enc[l])                      features of layer l, [N, F]
    y_t  ~= sum_{l <= t} a_l W_dec[l][:, t - l] + b_dec[t]

Layouts (the contract with ``lightning_opt.strategies``; see also docs/clt.md):

* inputs and targets ``x, y``: ``[N, L, d_model]`` (token-major, as the activation pipeline yields them).
* encoder: one parameter ``W_enc`` ``[L, d_model, F]`` and ``b_enc`` ``[L, F]`` (one batched matmul).
* pre-activations and activations: layer-major ``[L, N, F]``; the flat index of (layer l, token n,
  feature f) is ``(l * N + n) * F + f``. Sparse activations are ``(flat_indices, values)`` in that layout.
* untied decoder: ``W_dec`` is an ``nn.ParameterList`` and ``W_dec[l]`` is ``[F, L - l, d_out]`` (source l to
  targets l..L-1, circuit-tracer's ``W_dec_l``); ``b_dec`` is ``[L, d_out]``. ``d_out = d_model`` unless
  the model holds a shard (:class:`CLTShardSpec`, :meth:`CLT.shard_`): then the last (d_model) axis is the
  spec's ``d_out`` columns, and with ``features`` the encoder's last (feature) axis is sliced too.
* tied decoders: ``per_source`` keeps ``W_dec[l]`` as ``[F, 1, d_out]`` (one vector per feature for all
  targets), ``per_target`` keeps ``W_dec_tgt`` ``[L, F, d_out]`` (target t reads the sum of the features of
  layers <= t).

Global BatchTopK across ranks: ``CLT.topk_group`` (default ``None`` = local). When it is set and the activation
is ``batchtopk_global``, the selection calls
``lightning_opt.ops.global_topk.batch_topk_threshold_sparse(pre.view(N, L * F), k, group=topk_group)``;
``pre`` is the layer-major buffer seen as N rows, so the selected set is exact over all entries.

Sparse decode: :meth:`CLT.decode_sparse` takes ``(flat_indices, values)`` (grouped by layer, then token) and
calls ``lightning_opt.ops.sparse_decode.sparse_decode`` once per source layer with the CSR rows of that layer
and ``W_dec[l].reshape(F, (L - l) * d_out)``; ``CLTExecution.sparse_decode_impl`` is its backend (``auto``: Triton
on CUDA, ``embedding_bag`` otherwise).

Sharding: :meth:`CLT.shard_` slices the parameters to a :class:`CLTShardSpec` (this rank's output columns and,
optionally, features, plus the process groups of the data x model mesh); ``forward``, ``decode`` and
``decode_sparse`` then compute this rank's shard and issue the collectives it needs (the sparse activations'
gradient summed over the decoder group; with feature-sharded encoders the selection over the group and the
gather of the kept entries). The spec, those collectives and :func:`clip_grad_norm_` (the norm of the whole
model) live in :mod:`lightning_opt.models.clt_parallel`; ``CLTShardSpec`` and ``clip_grad_norm_`` import from here too.
``lightning_opt.strategies.DecoderShardingStrategy`` builds the groups and shards the model at setup.

Losses: FVU, the tanh sparsity penalty and the pre-activation loss are functions of tensors, in
:mod:`lightning_opt.models.clt_losses` (importable from here too); :func:`auxk_loss` decodes through the model.

Normalisation: the model owns ``in_shift/in_scale`` and ``out_shift/out_scale`` buffers (``[L, d_model]``);
:meth:`CLT.encode` normalises inputs, :meth:`CLT.decode` predicts *normalised* targets, and
:meth:`CLT.denormalize` maps back. :meth:`CLT.folded_weights` folds them into the weights for export.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lightning_opt._optional import is_available
from lightning_opt.models.clt_losses import (
    fvu,
    fvu_per_layer,
    preactivation_loss,
    tanh_sparsity_penalty,
    tanh_sparsity_penalty_sparse,
)
from lightning_opt.models.clt_parallel import (
    CLTShardSpec,
    all_gather_last,
    clip_grad_norm_,
    gather_columns,
    gather_padded,
    gather_sparse,
    gather_stacked,
    sum_backward,
    sum_forward,
    take_masked,
    take_unique,
)
from lightning_opt.ops import sparse_decode
from lightning_opt.ops.global_topk import (
    batch_topk_threshold_sparse,
    shard_candidates,
    shard_candidates_padded,
    top_positions,
)
from lightning_opt.ops.topk import (
    CandidatesBackend,
    SelectBackend,
    ThresholdMethod,
    batch_topk_rows,
    check_topk_options,
    jumprelu,
    scatter_dense,
    token_topk,
)

__all__ = [
    "CLTConfig",
    "CLTShardSpec",
    "CLT",
    "CLTOutput",
    "ACTIVATIONS",
    "fvu",
    "fvu_per_layer",
    "tanh_sparsity_penalty",
    "preactivation_loss",
    "auxk_loss",
    "tanh_sparsity_penalty_sparse",
    "save_circuit_tracer",
    "load_circuit_tracer",
    "clip_grad_norm_",
]

ACTIVATIONS = ("relu", "topk", "batchtopk", "batchtopk_global", "jumprelu")
_TOPK_ACTIVATIONS = ("topk", "batchtopk", "batchtopk_global")
_TYINGS = ("untied", "per_source", "per_target")
_NORMS = ("none", "mean_std", "sqrt_d_model")


@dataclass
class CLTConfig:
    """Shape and behaviour of a cross-layer transcoder.

    Args:
        n_layers: layers of the target model (one encoder per layer).
        d_model: width of the target model's residual stream / MLP output.
        n_features: features per layer (``F``).
        activation: ``relu``; ``topk`` (each token keeps its k largest features in each layer);
            ``batchtopk`` (each layer keeps its ``k * tokens`` largest entries over tokens x features);
            ``batchtopk_global`` (the ``k * tokens`` largest entries over tokens x all layers' features: k
            active per token on average over all layers, crosslayer-coding's BatchTopK); ``jumprelu``.
            Kept entries go through ReLU, so a kept pre-activation <= 0 gives 0.
        k: active features per token (see ``activation``); required for the top-k activations.
        decoder_tying: ``untied`` (a decoder per source-target pair), ``per_source`` or ``per_target``.
        normalization: ``none``, ``mean_std`` (per-layer, per-dimension mean and std) or ``sqrt_d_model``
            (per-layer scalar so the mean norm is sqrt(d_model)); statistics come from the data.
        jumprelu_threshold: initial JumpReLU threshold (in normalised units).
        jumprelu_bandwidth: straight-through rectangle width for the threshold gradient.
        topk_select_backend, topk_candidates_backend, topk_threshold_method: which path the BatchTopK
            selection takes (``select_backend``, ``candidates_backend``, ``threshold_method`` of
            :func:`~lightning_opt.ops.topk.batch_topk_rows`; the candidate step also of the global selection
            across ranks). Every path selects the same entries; ``"auto"`` takes the one-pass Triton selection
            (no host sync) where it runs.
    """

    n_layers: int
    d_model: int
    n_features: int
    activation: str = "batchtopk_global"
    k: int | None = 32
    decoder_tying: str = "untied"
    normalization: str = "none"
    jumprelu_threshold: float = 0.03
    jumprelu_bandwidth: float = 0.01
    topk_select_backend: SelectBackend = "auto"
    topk_candidates_backend: CandidatesBackend = "auto"
    topk_threshold_method: ThresholdMethod = "auto"

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_features"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"CLTConfig.{name} must be a positive int, got {v!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"CLTConfig.activation={self.activation!r} is unknown; choose one of {ACTIVATIONS}")
        if self.activation in _TOPK_ACTIVATIONS:
            if self.k is None or isinstance(self.k, bool) or not isinstance(self.k, int) or self.k <= 0:
                raise ValueError(f"activation={self.activation!r} needs a positive int k, got {self.k!r}")
            limit = self.n_features * (self.n_layers if self.activation == "batchtopk_global" else 1)
            if self.k > limit:
                where = "all layers' features" if self.activation == "batchtopk_global" else "features per layer"
                raise ValueError(
                    f"k={self.k} is larger than the {limit} {where}; lower k or raise n_features."
                )
        if self.decoder_tying not in _TYINGS:
            raise ValueError(f"CLTConfig.decoder_tying={self.decoder_tying!r} is unknown; choose one of {_TYINGS}")
        if self.normalization not in _NORMS:
            raise ValueError(f"CLTConfig.normalization={self.normalization!r} is unknown; choose one of {_NORMS}")
        if self.jumprelu_threshold <= 0 or self.jumprelu_bandwidth <= 0:
            raise ValueError("jumprelu_threshold and jumprelu_bandwidth must be > 0")
        check_topk_options(self.topk_select_backend, self.topk_candidates_backend, self.topk_threshold_method)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CLTOutput(NamedTuple):
    """What :meth:`CLT.forward` returns.

    ``recon`` is in normalised target space, ``[N, L, d_out]``; ``pre`` and ``acts`` are ``[L, N, F]``
    (``acts`` is dense); ``indices``/``values`` are the sparse activations for top-k activations (else None).
    """

    recon: torch.Tensor
    pre: torch.Tensor
    acts: torch.Tensor | None
    indices: torch.Tensor | None
    values: torch.Tensor | None


@dataclass
class CLTExecution:
    """How a :class:`CLT` is computed: settings under which the same weights mean the same model.

    Args:
        sparse_decode_impl: backend of :func:`~lightning_opt.ops.sparse_decode.sparse_decode`: ``auto``, ``torch``
            or ``triton``.
        dense_sparse_grad: the dense decode of top-k activations takes its activation gradient at the kept
            entries only (``True``, the faster) or through the plain dense matmul (``False``).
        compile_encode: in training mode, the encoder runs through ``torch.compile`` (``CLTModule(compile=True)``).
    """

    sparse_decode_impl: str = "auto"
    dense_sparse_grad: bool = True
    compile_encode: bool = False


class CLT(nn.Module):
    """Cross-layer transcoder. See the module docstring for layouts and the strategies contract.

    Example:
        >>> cfg = CLTConfig(n_layers=2, d_model=8, n_features=16, activation="batchtopk_global", k=2)
        >>> clt = CLT(cfg)
        >>> out = clt(torch.randn(5, 2, 8))
        >>> out.recon.shape, int((out.acts != 0).sum()) <= 10
        (torch.Size([5, 2, 8]), True)
    """

    def __init__(self, config: CLTConfig, execution: CLTExecution | None = None) -> None:
        super().__init__()
        self.config = config
        self.execution = execution if execution is not None else CLTExecution()
        L, d, nf = config.n_layers, config.d_model, config.n_features
        self.topk_group: Any = None
        self.shard: CLTShardSpec | None = None  # the part this rank holds (shard_), None: the whole model
        self.W_enc = nn.Parameter(torch.empty(L, d, nf))
        self.b_enc = nn.Parameter(torch.zeros(L, nf))
        if config.decoder_tying == "per_target":
            self.W_dec = nn.ParameterList()
            self.W_dec_tgt = nn.Parameter(torch.empty(L, nf, d))
        else:
            width = (lambda s: L - s) if config.decoder_tying == "untied" else (lambda s: 1)
            self.W_dec = nn.ParameterList(nn.Parameter(torch.empty(nf, width(s), d)) for s in range(L))
            self.W_dec_tgt = None
        self.b_dec = nn.Parameter(torch.zeros(L, d))
        if config.activation == "jumprelu":
            self.log_threshold = nn.Parameter(torch.full((L, nf), math.log(config.jumprelu_threshold)))
        else:
            self.log_threshold = None
        self.register_buffer("in_shift", torch.zeros(L, d))
        self.register_buffer("in_scale", torch.ones(L, d))
        self.register_buffer("out_shift", torch.zeros(L, d))
        self.register_buffer("out_scale", torch.ones(L, d))
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Anthropic's CLT init: encoder U(+-1/sqrt(F)), decoder U(+-1/sqrt(L * d_model))."""
        L, d, nf = self.config.n_layers, self.config.d_model, self.config.n_features
        self.W_enc.uniform_(-1 / math.sqrt(nf), 1 / math.sqrt(nf))
        bound = 1 / math.sqrt(L * d)
        for w in self.decoder_params():
            w.uniform_(-bound, bound)

    def decoder_params(self) -> list[nn.Parameter]:
        return [self.W_dec_tgt] if self.W_dec_tgt is not None else list(self.W_dec)

    @property
    def d_out(self) -> int:
        return self.b_dec.shape[-1]

    @property
    def d_out_slice(self) -> tuple[int, int] | None:
        """``(start, stop)`` of the output columns :meth:`forward` returns (``None``: all of ``d_model``)."""
        spec = self.shard
        return None if spec is None or spec.gather_output else spec.d_out

    @torch.no_grad()
    def set_normalization(self, stats: dict[str, Any]) -> None:
        """Set the normalisation buffers from activation statistics.

        Args:
            stats: ``in_mean, in_std, out_mean, out_std`` (``[L, d_model]``) and ``in_norm, out_norm``
                (``[L]``, mean L2 norm per layer), as stored by the activation cache.
        """
        mode = self.config.normalization
        if mode == "none":
            return
        if self.shard is not None:
            raise RuntimeError("set_normalization must be called before shard_ (or shard_decoder_)")
        L, d = self.config.n_layers, self.config.d_model
        dev = self.in_shift.device

        def t(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in stats:
                raise ValueError(f"normalization={mode!r} needs statistic {name!r}; got keys {sorted(stats)}")
            v = torch.as_tensor(stats[name], dtype=torch.float32, device=dev)
            if tuple(v.shape) != shape:
                raise ValueError(
                    f"statistic {name!r} has shape {tuple(v.shape)}, expected {shape} "
                    f"(n_layers={L}, d_model={d}); the statistics belong to a different target model."
                )
            return v

        for side in ("in", "out"):
            if mode == "mean_std":
                shift, scale = t(f"{side}_mean", (L, d)), t(f"{side}_std", (L, d)).clamp_min(1e-6)
            else:
                norm = t(f"{side}_norm", (L,)).clamp_min(1e-6)
                shift, scale = torch.zeros(L, d, device=dev), (norm / math.sqrt(d))[:, None].expand(L, d)
            getattr(self, f"{side}_shift").copy_(shift)
            getattr(self, f"{side}_scale").copy_(scale)

    @torch.no_grad()
    def shard_decoder_(self, start: int, stop: int) -> CLT:
        """Keep only output dimensions ``[start, stop)`` of the decoder, locally (no process group).

        After this, decode methods return ``[N, L, stop - start]``; compare them with ``y[..., start:stop]``.
        Same as ``shard_(CLTShardSpec(d_out=(start, stop)))``.
        """
        return self.shard_(CLTShardSpec(d_out=(start, stop)))

    def _shard_slots(self, spec: CLTShardSpec) -> list[tuple[nn.Module, str, tuple[int, int]]]:
        """``(owner, name, (start, stop))`` of every parameter ``spec`` slices (always its last axis)."""
        slots: list[tuple[nn.Module, str, tuple[int, int]]] = []
        if self.W_dec_tgt is not None:
            slots.append((self, "W_dec_tgt", spec.d_out))
        slots += [(self.W_dec, str(i), spec.d_out) for i in range(len(self.W_dec))]
        slots.append((self, "b_dec", spec.d_out))
        if spec.features is not None:
            slots += [(self, "W_enc", spec.features), (self, "b_enc", spec.features)]
        return slots

    @torch.no_grad()
    def shard_(self, spec: CLTShardSpec) -> CLT:
        """Hold only the part of the model ``spec`` names: new (smaller) parameters, sliced on their last axis.

        Call it before an optimizer is built over the parameters. :meth:`forward`, :meth:`decode` and
        :meth:`decode_sparse` then compute this rank's shard (see :class:`CLTShardSpec`); :meth:`unshard_`
        gathers the whole model back.
        """
        cfg = self.config
        if self.shard is not None:
            raise RuntimeError(f"this CLT already holds a shard ({self.shard.d_out} of the outputs)")
        if spec.d_out[1] > cfg.d_model:
            raise ValueError(f"need 0 <= start < stop <= d_model={cfg.d_model}, got {spec.d_out}")
        if spec.collective and cfg.decoder_tying != "untied":
            raise ValueError(
                f"decoders sharded over ranks must be untied, got decoder_tying={cfg.decoder_tying!r}"
            )
        if spec.features is not None:
            if cfg.activation != "batchtopk_global":
                raise ValueError(
                    f"feature-sharded encoders need activation='batchtopk_global' (one budget over all "
                    f"features), got {cfg.activation!r}"
                )
            if spec.features[1] > cfg.n_features:
                raise ValueError(f"features {spec.features} exceed n_features={cfg.n_features}")
        for owner, name, (start, stop) in self._shard_slots(spec):
            full = getattr(owner, name)
            part = full.detach()[..., start:stop].clone(memory_format=torch.contiguous_format)
            setattr(owner, name, nn.Parameter(part, requires_grad=full.requires_grad))
        self.shard = spec
        return self

    @torch.no_grad()
    def unshard_(self) -> CLT:
        """Gather the shards of the decoder group back into whole parameters (new ``Parameter`` objects)."""
        spec = self.shard
        if spec is None:
            return self
        if not spec.collective:
            raise RuntimeError("a local shard (no model_group) cannot be gathered back")
        for owner, name, _ in self._shard_slots(spec):
            part = getattr(owner, name)
            full = all_gather_last(part.detach(), spec.model_group, spec.model_size)
            setattr(owner, name, nn.Parameter(full, requires_grad=part.requires_grad))
        self.shard = None
        return self

    def sharded_parameters(self) -> list[nn.Parameter]:
        """The parameters that hold a slice (empty when the model is whole)."""
        return [] if self.shard is None else [getattr(o, n) for o, n, _ in self._shard_slots(self.shard)]

    # --------------------------------------------------------------- encoding
    def _check_input(self, x: torch.Tensor, what: str = "x") -> None:
        L, d = self.config.n_layers, self.config.d_model
        if x.dim() != 3 or x.shape[1] != L or x.shape[2] != d:
            raise ValueError(
                f"CLT expects {what} of shape [tokens, n_layers={L}, d_model={d}], got {tuple(x.shape)}; "
                "check that the activations come from the model the CLT was configured for."
            )

    def normalize_inputs(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.normalization == "none":
            return x
        return (x - self.in_shift) / self.in_scale

    def normalize_targets(self, y: torch.Tensor) -> torch.Tensor:
        if self.config.normalization == "none":
            return y
        return (y - self.out_shift) / self.out_scale

    def denormalize(self, recon: torch.Tensor) -> torch.Tensor:
        """Raw-space outputs of a normalised recon (the output columns :meth:`forward` returns)."""
        if self.config.normalization == "none":
            return recon
        cols = self.d_out_slice
        if cols is None:
            return recon * self.out_scale + self.out_shift
        return recon * self.out_scale[:, cols[0] : cols[1]] + self.out_shift[:, cols[0] : cols[1]]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activations ``[L, N, F]`` of raw inputs ``x`` ``[N, L, d_model]``.

        In training mode with ``execution.compile_encode`` set, the normalisation and the batched encoder matmul
        run as one ``torch.compile``'d region (``fullgraph``, static shapes); evaluation stays eager (its batch
        shapes vary).
        """
        self._check_input(x)
        fn = _compiled_encode() if self.execution.compile_encode and self.training else _encode
        return fn(x, self.W_enc, self.b_enc, self.in_shift, self.in_scale, self.config.normalization != "none")

    @property
    def threshold(self) -> torch.Tensor | None:
        return None if self.log_threshold is None else self.log_threshold.exp()

    def activate(self, pre: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Apply the activation to ``pre`` ``[L, N, F]``.

        Returns:
            ``(dense, indices, values)``: dense activations (None when only the sparse form was built) and,
            for top-k activations, flat indices into ``[L, N, F]`` with their (ReLU'd) values.
        """
        cfg = self.config
        L, N, nf = pre.shape
        act = cfg.activation
        if act == "relu":
            return F.relu(pre), None, None
        if act == "jumprelu":
            return jumprelu(pre, self.threshold[:, None, :].to(pre.dtype), cfg.jumprelu_bandwidth), None, None
        assert cfg.k is not None  # validated in CLTConfig
        if act == "batchtopk_global" and self.topk_group is not None:
            # the k * N_total largest over every rank's [L, N, F] block (viewed as N rows of L * F: only the
            # total count matters), as flat indices into [L, N, F] like the local selections: sparse decode
            idx, vals = batch_topk_threshold_sparse(pre.reshape(N, L * nf), cfg.k, group=self.topk_group,
                                                    candidates_backend=cfg.topk_candidates_backend)
            return None, idx, F.relu(vals)
        paths = dict(select_backend=cfg.topk_select_backend, candidates_backend=cfg.topk_candidates_backend,
                     threshold_method=cfg.topk_threshold_method)
        if act == "topk":
            idx, vals = token_topk(pre, cfg.k)
        elif act == "batchtopk":
            idx, vals = batch_topk_rows(pre.reshape(L, N * nf), cfg.k * N, **paths)
        else:
            idx, vals = batch_topk_rows(pre.reshape(1, L * N * nf), cfg.k * N, **paths)
        return None, idx, F.relu(vals)

    # --------------------------------------------------------------- decoding
    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """Dense reference decode: ``acts`` ``[L, N, F]`` -> normalised reconstruction ``[N, L, d_out]``.

        With a decoder group (:class:`CLTShardSpec`), dense activations go through :meth:`decode_sparse`, so
        only the ``nnz`` gradient values cross ranks (``nonzero`` syncs with the host once).
        """
        if self.shard is not None and self.shard.collective:
            flat = acts.reshape(-1)
            idx = torch.nonzero(flat.detach()).squeeze(1)
            return self.decode_sparse(idx, flat[idx], acts.shape[1])
        L, N, nf = acts.shape
        d = self.d_out
        tying = self.config.decoder_tying
        if tying == "per_target":
            # target t reads the sum of the features of layers <= t
            cum = torch.cumsum(acts, dim=0)
            return torch.bmm(cum, self.W_dec_tgt.to(acts.dtype)).transpose(0, 1).float() + self.b_dec
        # unbind, not acts[s]: its backward stacks the L slice gradients once, where L selects would each
        # zero-fill an [L, N, F] gradient and autograd would add the L of them up
        ys = [a @ w.reshape(nf, -1).to(acts.dtype) for a, w in zip(acts.unbind(0), self.W_dec)]
        return _TriangularSum.apply(L, d, *ys) + self.b_dec

    def decode_sparse(self, indices: torch.Tensor, values: torch.Tensor, n_tokens: int,
                      layer_bounds: list[int] | None = None) -> torch.Tensor:
        """Decode sparse activations (flat indices into ``[L, n_tokens, F]``) -> ``[N, L, d_out]``.

        Indices must ascend (as :func:`~lightning_opt.ops.topk.batch_topk_rows` returns them) for the torch
        path; tied decoders fall back to the dense decode. ``layer_bounds`` (host ints, ``L + 1``): where each
        source layer's entries start in ``indices``, when the caller read them already (saves the decode's
        host sync).

        With a decoder group (:class:`CLTShardSpec`) the backward sums the gradient of ``values`` over the group
        (each rank decoded its own columns from the same entries), so the encoder gets its full gradient.
        """
        if self.shard is not None and self.shard.collective:
            values = sum_backward(values, self.shard.model_group)
        return self._decode_sparse_local(indices, values, n_tokens, layer_bounds)

    def _decode_sparse_local(self, indices: torch.Tensor, values: torch.Tensor, n_tokens: int,
                             layer_bounds: list[int] | None = None) -> torch.Tensor:
        """:meth:`decode_sparse` of this rank's columns, without collectives."""
        L, nf = self.config.n_layers, self.config.n_features
        if self.config.decoder_tying != "untied":
            dense = scatter_dense(indices, values, torch.empty(L, n_tokens, nf, device="meta"))
            return self.decode(dense)
        W = list(self.W_dec)
        return _sparse_decode_layers(indices, values, W, n_tokens, nf, self.execution.sparse_decode_impl,
                                     layer_bounds) + self.b_dec

    def forward(self, x: torch.Tensor, dense: bool | None = None) -> CLTOutput:
        """Encode, activate and decode raw inputs ``x`` ``[N, L, d_model]``.

        Args:
            x: MLP inputs of every layer.
            dense: decode from dense activations (True) or from the sparse ``(indices, values)`` (False).
                None picks dense; sparse decoding only applies to top-k activations. Feature-sharded encoders
                (:class:`CLTShardSpec` ``features``) always decode sparsely.
        """
        out = self._forward_shard(x, dense)
        spec = self.shard
        if spec is not None and spec.gather_output and spec.collective:
            out = out._replace(recon=gather_columns(out.recon, spec.model_group, spec.model_size, spec.model_rank))
        return out

    def _forward_shard(self, x: torch.Tensor, dense: bool | None) -> CLTOutput:
        if self.shard is not None and self.shard.features is not None:
            return self._forward_feature_sharded(x)
        pre = self.encode(x)
        acts, idx, vals = self.activate(pre)
        N = x.shape[0]
        if idx is not None and dense is False:
            recon = self.decode_sparse(idx, vals, N)
            return CLTOutput(recon, pre, None, idx, vals)
        if acts is None:
            acts = scatter_dense(idx, vals, pre)
        if (idx is not None and self.execution.dense_sparse_grad and self.config.decoder_tying == "untied"
                and (self.shard is None or not self.shard.collective)):
            # not with a decoder group: decode routes dense activations through the sparse path
            return CLTOutput(self._decode_dense_sparse_grad(acts, idx, vals), pre, acts, idx, vals)
        return CLTOutput(self.decode(acts), pre, acts, idx, vals)

    def _decode_dense_sparse_grad(self, acts: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of top-k activations (``acts`` = ``vals`` scattered at ``idx``, zeros elsewhere) whose
        backward computes the activation gradient at the kept entries only (see :class:`_DenseDecodeSparseGrad`)."""
        nf = acts.shape[2]
        ws = [w.reshape(nf, -1).to(acts.dtype) for w in self.W_dec]
        return _DenseDecodeSparseGrad.apply(vals, acts.detach(), idx, *ws) + self.b_dec

    def _forward_feature_sharded(self, x: torch.Tensor) -> CLTOutput:
        """Encode this rank's features, select exactly over the group's union, decode from the gathered entries.

        The returned ``pre`` is this rank's ``[L, N, F / M]``; ``indices`` (global flat indices into
        ``[L, N, F]``, ascending) and ``values`` are every kept entry of the decoder group.
        """
        spec = self.shard
        assert spec is not None and spec.features is not None
        mark = spec.phase_hook or _no_mark
        pre = self.encode(x)  # [L, N, F / M]: this rank's features of every layer
        n_layers, n_tokens, width = pre.shape
        n_features = self.config.n_features
        mark("encode")
        if self.topk_group is None and spec.selection != "general":
            return self._select_in_group(pre, mark, padded=spec.selection == "padded_pool")
        first = 0
        if self.topk_group is not None:
            # one budget over the mesh: every rank's tokens (data groups) and features (decoder groups)
            count = pre.new_tensor(float(n_tokens))
            dist.all_reduce(count, group=self.topk_group)
            mesh = spec.mesh_group if spec.mesh_group is not None else dist.group.WORLD
            group, tokens_total = mesh, int(count)
            first = spec.data_rank * spec.model_size  # this decoder group's ranks in the mesh
        else:
            group, tokens_total = spec.model_group, n_tokens
        assert self.config.k is not None
        idx, vals, counts = batch_topk_threshold_sparse(
            pre.reshape(n_tokens, n_layers * width),
            self.config.k,
            group=group,
            tokens_total=tokens_total,
            return_counts=True,
            # equal feature shards: every token has n_layers * n_features entries over the group, so the
            # selection needs no host sync to size itself
            numel_total=tokens_total * n_layers * n_features,
            candidates_backend=self.config.topk_candidates_backend,
        )
        mark("select")
        # Local flat index in [L, N, F/M] -> global flat index in [L, N, F].
        layer_token = torch.div(idx, width, rounding_mode="floor")
        feature = idx - layer_token * width + spec.features[0]
        all_idx, all_vals = gather_sparse(
            layer_token * n_features + feature,
            F.relu(vals),
            spec.model_group,
            spec.model_size,
            counts=counts[first : first + spec.model_size],
        )
        all_idx, order = torch.sort(all_idx)  # rank-order runs -> ascending (the decode's layout)
        all_vals = all_vals[order]
        mark("gather")
        # the gather's backward sums the values' gradient over the group: the local decode, no sum_backward
        recon = self._decode_sparse_local(all_idx, all_vals, n_tokens)
        mark("decode")
        return CLTOutput(recon, pre, None, all_idx, all_vals)

    def _select_in_group(self, pre: torch.Tensor, mark: Callable[[str], None], padded: bool) -> CLTOutput:
        """BatchTopK over one decoder group (same tokens, features split): gather candidates, select on every rank.

        One gather of every rank's candidates (about ``1.1 K`` entries over the group) replaces the value
        gather, tie-count gather and kept-entry gather of the general path; each rank then finds the same
        ``K`` entries in the pool (sort cut-off, fixed output size). ``padded``: fixed-size candidate buffers
        and no host sync before the decode's layer bounds, read together with the pool's exactness flag
        (false: the selection reruns with ``padded=False``, the synced candidate step).
        """
        spec = self.shard
        assert spec is not None and spec.features is not None and self.config.k is not None
        n_layers, n_tokens, width = pre.shape
        n_features, k = self.config.n_features, self.config.k
        group, world = spec.model_group, spec.model_size
        backend = self.config.topk_candidates_backend
        padded_out = shard_candidates_padded(pre, k, group, n_tokens, backend) if padded else None
        if padded_out is not None:
            # No host sync until the decode's layer bounds: candidates in fixed-size buffers (-1 past the count)
            idx, _, ok = padded_out
            valid = idx >= 0
            idx = idx.clamp(min=0)
            values, counts = take_masked(pre.reshape(-1), idx, valid), [idx.numel()] * world
        else:
            idx, counts = shard_candidates(pre, k, group, n_tokens, backend)
            values, ok = take_unique(pre.reshape(-1), idx), None
        mark("select")
        # Local flat index in [L, N, F / M] -> global flat index in [L, N, F] (int32 when it fits: fewer
        # bytes to gather and a 4-byte sort).
        layer_token = torch.div(idx, width, rounding_mode="floor")
        global_idx = idx + layer_token * (n_features - width) + spec.features[0]
        if n_layers * n_tokens * n_features < 2**31:
            global_idx = global_idx.to(torch.int32)
        if ok is not None:
            global_idx = torch.where(valid, global_idx, -1)  # padding: the receivers' valid mask
        pool_idx, pool_vals, pool_valid = gather_padded(global_idx, values, group, world, counts)
        big_k = k * n_tokens if ok is not None else min(k * n_tokens, sum(counts))
        pos = top_positions(pool_vals.detach(), pool_valid, big_k)
        # rank-major pool -> ascending global indices (grouped by layer, then token: the decode's layout)
        all_idx, order = torch.sort(pool_idx[pos])
        all_vals = F.relu(take_unique(pool_vals, pos[order]))
        all_idx = all_idx.long()
        layer_bounds = None
        if ok is not None:
            # the one host sync of the forward: the decode's layer bounds, and whether the padded pool held the
            # exact top-K (else, rarely, redo with the synced path)
            edges = torch.arange(n_layers + 1, device=all_idx.device) * (n_tokens * n_features)
            host = torch.cat([torch.searchsorted(all_idx, edges), ok.long().view(1)]).tolist()
            if not host[-1]:
                return self._select_in_group(pre, mark, padded=False)
            layer_bounds = host[:-1]
        mark("gather")
        # the pool gather's backward returns each rank its candidates' summed gradient: no sum_backward here
        recon = self._decode_sparse_local(all_idx, all_vals, n_tokens, layer_bounds=layer_bounds)
        mark("decode")
        return CLTOutput(recon, pre, None, all_idx, all_vals)

    # ----------------------------------------------------------- norms, misc
    def decoder_norms(self) -> torch.Tensor:
        """Norm of each feature's concatenated decoder vectors over all its targets, ``[L, F]`` (with a decoder
        group: over every shard's output columns)."""
        L = self.config.n_layers
        tying = self.config.decoder_tying
        if tying == "per_target":
            sq = self.W_dec_tgt.float().pow(2).sum(-1)  # [L_tgt, F]
            # source l writes to targets l..L-1 with the same per-target vectors
            return sq.flip(0).cumsum(0).flip(0).sqrt()
        spec = self.shard
        if spec is not None and spec.collective:
            # a decoder group: every shard's columns. The squares are summed over the group with the backward
            # scaled by its size: every rank computes the same penalty from these norms and the strategy averages
            # the ranks' losses, so each shard's columns get the whole gradient
            sq = torch.stack([w.float().pow(2).sum((1, 2)) for w in self.W_dec])
            return sum_forward(sq, spec.model_group, grad_scale=float(spec.model_size)).sqrt()
        rows = []
        for s, w in enumerate(self.W_dec):
            # one fused reduction, no squared copy of the decoder
            norm = torch.linalg.vector_norm(w, dim=(1, 2), dtype=torch.float32)
            rows.append(norm * math.sqrt(L - s) if tying == "per_source" else norm)
        return torch.stack(rows)

    def full_decoder(self, source: int) -> torch.Tensor:
        """``[F, L - source, d_out]`` decoder of one source layer, expanding tied decoders."""
        L = self.config.n_layers
        tying = self.config.decoder_tying
        if tying == "untied":
            return self.W_dec[source]
        if tying == "per_source":
            return self.W_dec[source].expand(-1, L - source, -1)
        return self.W_dec_tgt[source:].transpose(0, 1)

    # --------------------------------------------------- JumpReLU conversion
    @torch.no_grad()
    def calibrate_jumprelu_thresholds(self, batches: Iterable[torch.Tensor]) -> torch.Tensor:
        """Per-feature JumpReLU thresholds that keep a top-k CLT's firing counts (hence its L0).

        For each feature, with ``c`` firings under the current top-k activation over the calibration
        tokens, the threshold lies halfway between its ``c``-th and ``(c+1)``-th largest pre-activation
        there, so exactly ``c`` of those pre-activations are above it (ties aside). Features that never fired get the largest per-batch
        cut-off seen.

        Args:
            batches: raw input batches ``[N, L, d_model]``.

        Returns:
            thresholds ``[L, F]`` (normalised units, like the pre-activations).
        """
        if self.config.activation not in _TOPK_ACTIVATIONS:
            raise ValueError(f"calibration needs a top-k activation, this CLT uses {self.config.activation!r}")
        pres, counts, cutoff = [], None, None
        for x in batches:
            pre = self.encode(x).float()
            acts, idx, vals = self.activate(pre)
            if acts is None:
                acts = scatter_dense(idx, vals, pre)
            fired = acts > 0
            c = fired.sum(1)
            counts = c if counts is None else counts + c
            # the smallest kept pre-activation is this batch's cut-off (host sync: calibration only)
            kept_min = acts[fired].min() if bool(fired.any()) else pre.new_tensor(float("inf"))
            cutoff = kept_min if cutoff is None else torch.maximum(cutoff, kept_min)
            pres.append(pre)
        if counts is None:
            raise ValueError("calibrate_jumprelu_thresholds needs at least one batch")
        allpre = torch.cat(pres, dim=1)  # [L, N_total, F]; keep calibration to a few thousand tokens
        del pres
        total = allpre.shape[1]
        th = torch.empty_like(counts, dtype=allpre.dtype)
        # Feature chunks bound the memory of the partial sort (the c-th and (c+1)-th largest suffice).
        chunk = max(1, (1 << 26) // max(1, allpre.shape[0] * total))
        for f0 in range(0, allpre.shape[2], chunk):
            c = counts[:, f0 : f0 + chunk]
            depth = min(total, int(c.max()) + 1)  # host sync: calibration only
            top = torch.topk(allpre[:, :, f0 : f0 + chunk], depth, dim=1).values  # descending
            last_kept = top.gather(1, (c - 1).clamp(0, depth - 1)[:, None, :]).squeeze(1)
            first_dropped = top.gather(1, c.clamp_max(depth - 1)[:, None, :]).squeeze(1)
            # JumpReLU keeps pre > threshold: cut halfway between the c-th and the (c+1)-th largest
            th[:, f0 : f0 + chunk] = torch.where(c < total, 0.5 * (last_kept + first_dropped), last_kept - 1e-6)
        return torch.where(counts > 0, th, cutoff).clamp_min(1e-6)

    @torch.no_grad()
    def convert_to_jumprelu_(self, thresholds: torch.Tensor) -> CLT:
        """Switch this CLT to JumpReLU with the given ``[L, F]`` thresholds (from calibration)."""
        L, nf = self.config.n_layers, self.config.n_features
        if tuple(thresholds.shape) != (L, nf):
            raise ValueError(f"thresholds must be [{L}, {nf}], got {tuple(thresholds.shape)}")
        self.config = replace(self.config, activation="jumprelu", k=None)
        self.log_threshold = nn.Parameter(thresholds.float().clamp_min(1e-6).log().to(self.W_enc.device))
        return self

    # ----------------------------------------------------------- export
    @torch.no_grad()
    def folded_weights(self) -> dict[str, list[torch.Tensor]]:
        """Weights with the normalisation folded in, so raw activations in give raw outputs out.

        Returns lists over layers: ``W_enc`` ``[F, d]``, ``b_enc`` ``[F]``, ``threshold`` ``[F]``,
        ``b_dec`` ``[d]``, ``W_dec`` ``[F, L-l, d]`` (float32).
        """
        if self.shard is not None:
            raise RuntimeError("export a sharded CLT after gathering it (unshard_; the shard spec is set)")
        L, nf = self.config.n_layers, self.config.n_features
        out: dict[str, list[torch.Tensor]] = {k: [] for k in ("W_enc", "b_enc", "threshold", "b_dec", "W_dec")}
        th = self.threshold
        for layer in range(L):
            w = self.W_enc[layer].float()  # [d, F]
            scale, shift = self.in_scale[layer], self.in_shift[layer]
            w_f = w / scale[:, None]
            out["W_enc"].append(w_f.t().contiguous())
            out["b_enc"].append((self.b_enc[layer].float() - shift @ w_f).contiguous())
            out["threshold"].append(th[layer].float().clone() if th is not None else torch.zeros(nf))
            out["W_dec"].append((self.full_decoder(layer).float() * self.out_scale[layer:][None]).contiguous())
            out["b_dec"].append(self.b_dec[layer].float() * self.out_scale[layer] + self.out_shift[layer])
        return out


def _encode(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, in_shift: torch.Tensor,
            in_scale: torch.Tensor, normalize: bool) -> torch.Tensor:
    """:meth:`CLT.encode` as a function of tensors: ``[L, N, F]`` pre-activations of raw ``x`` ``[N, L, d]``."""
    xn = x.to(W_enc.dtype)
    if normalize:
        xn = (xn - in_shift) / in_scale
    return torch.baddbmm(b_enc[:, None, :], xn.transpose(0, 1), W_enc)


@functools.cache
def _compiled_encode() -> Callable[..., torch.Tensor]:
    """:func:`_encode` through ``torch.compile`` (one wrapper per process; dynamo keys its graphs on shapes,
    dtypes and the ambient autocast state)."""
    return torch.compile(_encode, fullgraph=True, dynamic=False)


class _DenseDecodeSparseGrad(torch.autograd.Function):
    """Dense decode (one ``[N, F] x [F, (L-l) d]`` matmul per source layer) of top-k activations.

    Forward and the decoder gradient are the plain dense matmuls. The activation gradient is needed only at
    the ``k N`` kept entries (the activations are zero elsewhere and only ``values`` carry gradients), so
    instead of the dense ``grad_out @ W^T`` (as many FLOPs as the forward) it is a gather-dot per kept entry
    (:func:`_grad_at_kept`): one Triton launch for every layer on CUDA (no host sync), chunked torch gathers
    elsewhere.

    Inputs: ``values`` (differentiable, at ``indices``), ``acts`` ``[L, N, F]`` (detached dense form),
    ``indices`` (flat into ``[L, N, F]``, grouped by layer), then the ``L`` decoders ``[F, (L - l) d]`` in the
    compute dtype. Output ``[N, L, d]`` float32.
    """

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, acts: torch.Tensor, indices: torch.Tensor,
                *weights: torch.Tensor) -> torch.Tensor:
        L, N, _ = acts.shape
        d = weights[0].shape[1] // L
        out = torch.zeros(N, L, d, dtype=torch.float32, device=acts.device)
        for s, w in enumerate(weights):
            out[:, s:] += (acts[s] @ w).view(N, L - s, d)
        ctx.save_for_backward(acts, indices, *weights)
        ctx.values_dtype = values.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        acts, indices, *weights = ctx.saved_tensors
        L, N, nf = acts.shape
        # one copy of the gradient in the matmuls' dtype; layer s's [N, (L - s) d] is a view of it (row stride L d)
        g = grad_out.to(acts.dtype).contiguous()
        grad_w: list[torch.Tensor | None] = [None] * L
        for s in range(L):
            if ctx.needs_input_grad[3 + s]:
                grad_w[s] = acts[s].t() @ g[:, s:].reshape(N, -1)
        grad_vals = None
        if ctx.needs_input_grad[0]:
            grad_vals = _grad_at_kept(indices, g, weights, N, nf).to(ctx.values_dtype)
        return (grad_vals, None, None, *grad_w)


def _grad_at_kept(indices: torch.Tensor, g: torch.Tensor, weights: list[torch.Tensor], n_tokens: int,
                  nf: int) -> torch.Tensor:
    """float32 ``[nnz]``: ``<g[tok, s:].flatten(), weights[s][feat]>`` at every kept entry ``(s, tok, feat)`` of
    ``indices`` (flat into ``[L, n_tokens, nf]``, grouped by layer). ``g``: ``[n_tokens, L, d]``.

    Where Triton runs (CUDA): every layer in one launch of ``ops._topk_triton.grad_kept``, no host sync. Else a
    chunked torch gather-dot per layer, whose slices need the layer bounds on the host (a sync on a GPU
    without Triton; free on the CPU)."""
    import lightning_opt.ops._topk_triton as _topk_triton

    if _topk_triton.available(g) and _grad_kept_works(g.device):
        return _topk_triton.grad_kept(indices, g, weights, n_tokens, nf)
    return _grad_at_kept_torch(indices, g, weights, n_tokens, nf)


def _grad_at_kept_torch(indices: torch.Tensor, g: torch.Tensor, weights: list[torch.Tensor], n_tokens: int,
                        nf: int) -> torch.Tensor:
    """:func:`_grad_at_kept` in torch: per layer, the slice its host-side bounds give."""
    L = len(weights)
    bounds = torch.searchsorted(indices, torch.arange(L + 1, device=indices.device) * (n_tokens * nf)).tolist()
    out = torch.zeros(indices.numel(), dtype=torch.float32, device=g.device)
    for s, w in enumerate(weights):
        lo, hi = bounds[s], bounds[s + 1]
        if hi > lo:
            local = indices[lo:hi] - s * n_tokens * nf
            tok = torch.div(local, nf, rounding_mode="floor")
            out[lo:hi] = _gather_dot(local - tok * nf, tok, g[:, s:].reshape(n_tokens, -1), w)
    return out


_GRAD_KEPT_CHECKED: dict[torch.device, bool] = {}


def _grad_kept_works(device: torch.device) -> bool:
    """Run ``ops._topk_triton.grad_kept`` once per device on a small problem (3 layers, unaligned rows) against
    the torch gather-dot; a failure costs a warning and the torch path, not a crash or a wrong gradient."""
    if device not in _GRAD_KEPT_CHECKED:
        import lightning_opt.ops._topk_triton as _topk_triton

        ok = False
        try:
            gen = torch.Generator().manual_seed(0)
            L, N, nf = 3, 5, 7
            for dtype, d in ((torch.bfloat16, 16), (torch.float32, 3)):
                ws = [torch.randn(nf, (L - s) * d, generator=gen).to(device, dtype) for s in range(L)]
                g = torch.randn(N, L, d, generator=gen).to(device, dtype)
                idx = torch.randperm(L * N * nf, generator=gen)[:40].sort().values.to(device)
                got = _topk_triton.grad_kept(idx, g, ws, N, nf)
                ref = _grad_at_kept_torch(idx, g, ws, N, nf)
                if not torch.allclose(got, ref, rtol=1e-3, atol=1e-3):
                    raise RuntimeError("grad_kept disagrees with the torch gather-dot on a check problem")
            ok = True
        except Exception as err:  # any failure means: use the torch path
            warnings.warn(f"CLT dense decode: Triton gradient at the kept entries unusable ({err}); using torch",
                          stacklevel=2)
        _GRAD_KEPT_CHECKED[device] = ok
    return _GRAD_KEPT_CHECKED[device]


def _gather_dot(feat: torch.Tensor, tok: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[e] = <g[tok[e]], w[feat[e]]>`` in float32 (``g``'s rows may be strided, columns contiguous)."""
    out = torch.empty(feat.numel(), dtype=torch.float32, device=w.device)
    step = max(1, (1 << 24) // max(1, w.shape[1]))  # bounds the [chunk, D] temporaries
    for i in range(0, feat.numel(), step):
        f, t = feat[i : i + step], tok[i : i + step]
        out[i : i + step] = (g[t].float() * w[f].float()).sum(-1)
    return out


def _no_mark(name: str) -> None:
    pass


class _TriangularSum(torch.autograd.Function):
    """``out[:, t] = sum_{s <= t} y_s[:, t - s]``: float32 ``[N, L, d]`` from per-source decoder outputs ``y_s``
    ``[N, (L - s) * d]`` (or ``[N, d]`` for a per-source tied decoder: one vector for every target).

    Autograd of ``out[:, s:] += y_s`` on a zero tensor clones and zero-fills the whole ``[N, L, d]`` gradient
    once per source layer; here the gradient of ``y_s`` is the slice ``grad[:, s:]`` itself."""

    @staticmethod
    def forward(ctx: Any, L: int, d: int, *ys: torch.Tensor) -> torch.Tensor:
        N = ys[0].shape[0]
        out = torch.zeros(N, L, d, dtype=torch.float32, device=ys[0].device)
        for s, y in enumerate(ys):
            out[:, s:] += y.view(N, -1, d)  # [N, 1, d] broadcasts over the targets
        ctx.meta = [(y.dtype, y.shape[1] == d and L - s > 1) for s, y in enumerate(ys)]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = []
        for s, (dtype, tied) in enumerate(ctx.meta):
            g = grad[:, s:]
            grads.append((g.sum(1) if tied else g.reshape(g.shape[0], -1)).to(dtype))
        return (None, None, *grads)


def _triangular_sum(ys: list[torch.Tensor | None], L: int, d: int, n_tokens: int,
                    device: torch.device) -> torch.Tensor:
    """:class:`_TriangularSum` where source layers without entries (``None``) contribute nothing."""
    if all(y is None for y in ys):
        return torch.zeros(n_tokens, L, d, dtype=torch.float32, device=device)
    if all(y is not None for y in ys):
        return _TriangularSum.apply(L, d, *ys)
    # a source layer with no kept entry: a zero block keeps the positions (rare; global BatchTopK only)
    like = next(y for y in ys if y is not None)
    filled = [y if y is not None else like.new_zeros(n_tokens, (L - s) * d) for s, y in enumerate(ys)]
    return _TriangularSum.apply(L, d, *filled)


def _triton_decode_ok(device: torch.device) -> bool:
    """Whether ``ops.sparse_decode``'s Triton kernels run on ``device``.

    Its one-time self-check per device needs autograd; a first call from a backward pass or a validation loop
    (no grad / inference mode) would cache a failure and silently switch every later decode to
    ``embedding_bag``. So the check runs here with grad enabled.
    """
    if device.type != "cuda":
        return False
    if not is_available("triton"):
        return False
    with torch.inference_mode(False), torch.enable_grad():
        return sparse_decode._triton_works(device)


def _sparse_decode_layers(
    indices: torch.Tensor,
    values: torch.Tensor,
    W_dec: list[torch.Tensor],
    n_tokens: int,
    nf: int,
    backend: str = "auto",
    layer_bounds: list[int] | None = None,
) -> torch.Tensor:
    """Sparse decode: per source layer, CSR rows (tokens) into ``W_dec[l]`` via
    :func:`lightning_opt.ops.sparse_decode.sparse_decode` (Triton on CUDA, else ``embedding_bag``)."""
    L = len(W_dec)
    d = W_dec[0].shape[-1]
    device = values.device
    if backend == "auto":
        _triton_decode_ok(device)  # settle sparse_decode's cached Triton self-check with grad enabled
    # Every layer's CSR views from one pass over the indices; one host sync (the layer boundaries) unless the
    # caller passed them.
    feature, token, row_ptr, bounds = sparse_decode.layer_segments(indices, L, n_tokens, nf, layer_bounds)
    on = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if on else W_dec[0].dtype
    values = values.to(dtype)
    ys: list[torch.Tensor | None] = []
    for s in range(L):
        lo, hi = bounds[s], bounds[s + 1]
        if hi == lo:
            ys.append(None)
            continue
        seg = row_ptr[s * n_tokens : (s + 1) * n_tokens + 1] - lo
        w = W_dec[s].reshape(nf, -1).to(dtype)
        ys.append(sparse_decode._decode_csr(feature[lo:hi], values[lo:hi], w, seg[:-1], backend, ends=seg[1:],
                              rows=token[lo:hi]))
    return _triangular_sum(ys, L, d, n_tokens, device)


# ------------------------------------------------------------------- AuxK loss
def auxk_loss(
    model: CLT,
    pre: torch.Tensor,
    residual: torch.Tensor,
    dead: torch.Tensor,
    k_aux: int,
    max_dead: int | None = None,
    staleness: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    sparse_decoder_grad: bool = False,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """AuxK (Gao et al., 2024): the top-``k_aux`` *dead* features per token and layer should predict the
    residual ``target - recon`` (normalised space, detached). Returns ``||e - e_hat||^2 / ||e||^2``;
    equals 1 with no gradient when no feature is dead.

    With ``max_dead`` only that many candidate features per layer are considered: the ``max_dead`` with the
    largest ``staleness`` (e.g. tokens since they last fired; default: the dead mask itself), of which the
    dead ones take part. The result equals the uncapped loss whenever a layer has at most ``max_dead`` dead
    features (ties in the per-token top-k aside). The capped form never touches ``[L, N, F]`` beyond one
    gather of ``[L, N, max_dead]`` and decodes with a dense ``[N, max_dead]`` matmul per layer, instead of a
    masked copy of ``pre``, a top-k over all features and a second sparse decode.

    A sharded model (:meth:`CLT.shard_`) computes its shard of the same loss: ``residual`` holds its output
    columns, and with feature-sharded encoders ``pre`` holds its features ``[L, N, F / M]`` while ``dead`` and
    ``staleness`` stay ``[L, F]`` (the same on every rank); each rank then picks its own top-``k_aux`` dead
    features, the decoder group's candidates are gathered, and every rank keeps the same top ``k_aux`` of the
    union (the top-k over all features). Pass ``reduce`` to sum the squared errors over the ranks, so the
    ratio is the one of the whole batch (``CLTModule`` sums over all ranks).

    Args:
        model: the CLT (its decoder is used without bias).
        pre: ``[L, N, F]`` pre-activations (``[L, N, F / M]`` with feature-sharded encoders).
        residual: ``[N, L, d_out]`` detached reconstruction error.
        dead: ``[L, F]`` bool mask of dead features.
        k_aux: dead features kept per token and layer.
        max_dead: candidate features per layer (``None`` = all ``F``).
        staleness: ``[L, F]`` scores that rank the candidates when ``max_dead`` is set.
        x: the raw inputs ``[N, L, d_model]`` that gave ``pre`` (optional, capped form only): the candidates'
            pre-activations are then recomputed from the encoder (``[N, d] x [d, max_dead]`` per layer), so the
            gradient goes straight to their encoder columns instead of a dense ``[L, N, F]`` gradient of
            ``pre``. Same loss and gradients up to matmul rounding.
        sparse_decoder_grad: capped untied form only: the decoder gradient of the candidates' rows is returned
            as a sparse tensor that autograd adds into the dense gradient of the main decode, instead of a
            zero-filled decoder-sized tensor. Only when the decoder also gets a dense gradient in the same
            backward (as in :class:`~lightning_opt.modules.clt.CLTModule`): otherwise ``.grad`` would be sparse,
            which AdamW refuses.
        reduce: differentiable sum of a scalar over ranks (e.g. all ranks of a data-parallel or sharded run),
            applied to the numerator and the denominator; ``None``: this process's ratio.
    """
    L, N, width = pre.shape
    nf = model.config.n_features
    spec = model.shard
    feats = spec.features if spec is not None else None  # this rank's features, when the encoder is sharded
    f0 = 0 if feats is None else feats[0]
    if max_dead is not None and max_dead <= 0:
        raise ValueError(f"max_dead={max_dead} must be positive (or None for all features)")
    if tuple(dead.shape) != (L, nf) or width != (nf if feats is None else feats[1] - feats[0]):
        raise ValueError(
            f"auxk_loss: dead {tuple(dead.shape)} must be [n_layers, n_features] = [{L}, {nf}] and pre "
            f"{tuple(pre.shape)} must hold this model's features ({feats or (0, nf)})"
        )
    capped = max_dead is not None and max_dead < nf
    if capped:
        score = (staleness if staleness is not None else dead).float().masked_fill(~dead, float("-inf"))
        cols = torch.topk(score, max_dead, dim=1).indices  # [L, D]: fixed size, so no host sync
        ok = dead.gather(1, cols)
        local = cols - f0  # the candidates' places in this rank's features
        if feats is not None:
            ok = ok & (local >= 0) & (local < width)  # another rank's features take part through the gather
            local = local.clamp(0, width - 1)
        if x is not None:
            # the candidates' pre-activations from their encoder columns: no dense [L, N, F] gradient of pre
            model._check_input(x)
            xn = model.normalize_inputs(x.to(model.W_enc.dtype)).transpose(0, 1)
            w = model.W_enc.gather(2, local[:, None, :].expand(L, model.config.d_model, max_dead))
            sub = torch.baddbmm(model.b_enc.gather(1, local)[:, None, :], xn, w).to(pre.dtype)
        else:
            sub = pre.gather(2, local[:, None, :].expand(L, N, max_dead))
    else:
        cols, ok, sub = None, dead[:, f0 : f0 + width], pre
    kk = min(k_aux, max_dead if capped else nf)
    masked = sub.masked_fill(~ok[:, None, :], float("-inf"))
    top = torch.topk(masked, min(kk, sub.shape[2]), dim=2, sorted=False)
    chosen = top.values
    if feats is not None:
        # every rank's top candidates (k each per token and layer), then the top kk of their union
        feat = top.indices + f0 if cols is None else cols[:, None, :].expand(L, N, max_dead).gather(2, top.indices)
        world = spec.model_size
        pool = gather_stacked(chosen, spec.model_group, world).permute(1, 2, 0, 3).reshape(L, N, -1)
        pool_feat = gather_stacked(feat, spec.model_group, world).permute(1, 2, 0, 3).reshape(L, N, -1)
        best = torch.topk(pool, kk, dim=2, sorted=False)
        chosen, feat = best.values, pool_feat.gather(2, best.indices)
    vals = torch.where(torch.isfinite(chosen), F.relu(chosen), torch.zeros_like(chosen))
    e = residual.float()
    # a decoder group: decode_sparse sums the values' gradient over the group, so go through it (the gather of
    # feature-sharded candidates sums it already: the local decode then)
    grouped = spec is not None and spec.collective
    if capped and not grouped and model.config.decoder_tying == "untied":
        e_hat = _decode_columns(model, cols, top.indices, vals, sparse_decoder_grad)
    else:
        if feats is None:
            feat = top.indices if cols is None else cols[:, None, :].expand(L, N, max_dead).gather(2, top.indices)
        rows = torch.arange(L * N, device=pre.device).view(L, N, 1)
        flat = (rows * nf + feat).reshape(-1)  # grouped by layer, then token (the decode_sparse contract)
        decode = model._decode_sparse_local if feats is not None else model.decode_sparse
        e_hat = decode(flat, vals.reshape(-1), N) - model.b_dec
    sse, sst = (e - e_hat).pow(2).sum(), e.pow(2).sum()
    if reduce is not None:
        sse, sst = reduce(sse), reduce(sst)
    return sse / sst.clamp_min(1e-12)


def _decode_columns(model: CLT, cols: torch.Tensor, local: torch.Tensor, vals: torch.Tensor,
                    sparse_grad: bool = False) -> torch.Tensor:
    """Decode (no bias) activations that live on ``cols`` ``[L, D]`` features per layer: ``vals`` at positions
    ``local`` ``[L, N, k]`` of a ``[L, N, D]`` block. One dense ``[N, D] x [D, (L - l) * d]`` matmul per layer.
    With ``sparse_grad`` the decoder gradient is a sparse tensor over the ``D`` rows (see :func:`auxk_loss`)."""
    L, N, _ = local.shape
    D = cols.shape[1]
    acts = torch.zeros(L, N, D, dtype=vals.dtype, device=vals.device).scatter(2, local, vals)
    on = torch.is_autocast_enabled(vals.device.type)
    dtype = torch.get_autocast_dtype(vals.device.type) if on else model.W_dec[0].dtype
    if sparse_grad:
        return _ColumnDecodeSparseGrad.apply(acts, cols, dtype, *model.W_dec)
    ys = []
    for s, a in enumerate(acts.unbind(0)):  # unbind: see CLT.decode
        w = model.W_dec[s].index_select(0, cols[s]).reshape(D, -1)  # [D, (L - s) * d]
        ys.append(a.to(dtype) @ w.to(dtype))
    return _TriangularSum.apply(L, model.d_out, *ys)


class _ColumnDecodeSparseGrad(torch.autograd.Function):
    """:func:`_decode_columns` whose decoder gradient is a sparse COO tensor over the ``D`` selected rows of each
    ``W_dec[l]`` ``[F, L - l, d]``. Autograd sums it into the dense gradient of the main decode, so no
    zero-filled decoder-sized gradient is built. Inputs: ``acts`` ``[L, N, D]``, ``cols`` ``[L, D]``, the matmul
    dtype, then the ``L`` decoders. Output ``[N, L, d]`` float32."""

    @staticmethod
    def forward(ctx: Any, acts: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype,
                *weights: torch.Tensor) -> torch.Tensor:
        L, N, D = acts.shape
        d = weights[0].shape[-1]
        a = acts.to(dtype)
        out = torch.zeros(N, L, d, dtype=torch.float32, device=acts.device)
        rows = []
        for s, w in enumerate(weights):
            ws = w.index_select(0, cols[s]).reshape(D, -1).to(dtype)  # [D, (L - s) d]
            out[:, s:] += (a[s] @ ws).view(N, L - s, d)
            rows.append(ws)
        ctx.save_for_backward(a, cols, *rows)
        ctx.meta = (acts.dtype, [(w.shape, w.dtype) for w in weights])
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, cols, *rows = ctx.saved_tensors
        acts_dtype, wmeta = ctx.meta
        L, N, D = a.shape
        grad_out = grad_out.contiguous()
        grad_acts = torch.empty(L, N, D, dtype=a.dtype, device=a.device) if ctx.needs_input_grad[0] else None
        grads_w: list[torch.Tensor | None] = []
        for s, ws in enumerate(rows):
            g = grad_out[:, s:].reshape(N, -1).to(a.dtype)
            if grad_acts is not None:
                grad_acts[s] = g @ ws.t()
            if ctx.needs_input_grad[3 + s]:
                shape, wdtype = wmeta[s]
                gw = (a[s].t() @ g).view(D, *shape[1:]).to(wdtype)
                grads_w.append(torch.sparse_coo_tensor(cols[s][None], gw, shape, check_invariants=False))
            else:
                grads_w.append(None)
        return (None if grad_acts is None else grad_acts.to(acts_dtype), None, None, *grads_w)


# ------------------------------------------------------- circuit-tracer format
def save_circuit_tracer(model: CLT, directory: str | Any, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write ``model`` in circuit-tracer's CLT layout (normalisation folded into the weights).

    Per layer ``l``: ``W_enc_{l}.safetensors`` with ``W_enc_{l}`` ``[F, d]``, ``b_enc_{l}`` ``[F]``,
    ``b_dec_{l}`` ``[d]``, ``threshold_{l}`` ``[F]`` (zeros for ReLU; convert top-k CLTs to JumpReLU first
    with :meth:`CLT.calibrate_jumprelu_thresholds`), and ``W_dec_{l}.safetensors`` with ``W_dec_{l}``
    ``[F, L - l, d]``. Returns the written paths.
    """
    if model.config.activation not in ("relu", "jumprelu"):
        raise ValueError(
            f"circuit-tracer CLTs use ReLU or JumpReLU; this CLT uses {model.config.activation!r}. Convert it "
            "first: model.convert_to_jumprelu_(model.calibrate_jumprelu_thresholds(batches))."
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    w = model.folded_weights()
    paths = []
    for layer in range(model.config.n_layers):
        enc = {
            f"W_enc_{layer}": w["W_enc"][layer],
            f"b_enc_{layer}": w["b_enc"][layer],
            f"b_dec_{layer}": w["b_dec"][layer],
            f"threshold_{layer}": w["threshold"][layer],
        }
        dec = {f"W_dec_{layer}": w["W_dec"][layer]}
        for name, tensors in ((f"W_enc_{layer}", enc), (f"W_dec_{layer}", dec)):
            p = out / f"{name}.safetensors"
            save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}, str(p))
            paths.append(str(p))
    return paths


def load_circuit_tracer(directory: str | Any, device: str | torch.device = "cpu") -> CLT:
    """Read a circuit-tracer CLT directory into an untied :class:`CLT` (normalisation ``none``).

    The activation is JumpReLU when any ``threshold_{l}`` is positive, else ReLU.
    """
    d = Path(directory)
    n_layers = 0
    while (d / f"W_enc_{n_layers}.safetensors").exists():
        n_layers += 1
    if n_layers == 0:
        raise FileNotFoundError(f"no W_enc_0.safetensors in {d}; is this a circuit-tracer CLT directory?")
    enc = [load_file(str(d / f"W_enc_{i}.safetensors")) for i in range(n_layers)]
    dec = [load_file(str(d / f"W_dec_{i}.safetensors"))[f"W_dec_{i}"] for i in range(n_layers)]
    nf, dm = enc[0]["W_enc_0"].shape
    for i, w in enumerate(dec):
        if tuple(w.shape) != (nf, n_layers - i, dm):
            raise ValueError(f"W_dec_{i} has shape {tuple(w.shape)}, expected {(nf, n_layers - i, dm)}")
    ths = [e.get(f"threshold_{i}", torch.zeros(nf)).float() for i, e in enumerate(enc)]
    jump = any(bool((t > 0).any()) for t in ths)
    cfg = CLTConfig(n_layers=n_layers, d_model=dm, n_features=nf, activation="jumprelu" if jump else "relu", k=None)
    model = CLT(cfg)
    with torch.no_grad():
        for i in range(n_layers):
            model.W_enc[i].copy_(enc[i][f"W_enc_{i}"].float().t())
            model.b_enc[i].copy_(enc[i][f"b_enc_{i}"].float())
            model.b_dec[i].copy_(enc[i][f"b_dec_{i}"].float())
            model.W_dec[i].copy_(dec[i].float())
        if jump:
            model.log_threshold.copy_(torch.stack(ths).clamp_min(1e-12).log())
    return model.to(device)
