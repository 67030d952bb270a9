"""GPT-2, classic and speedrun variants, in one file that reads top to bottom.

The classic model is GPT-2 exactly (learned positions, LayerNorm with bias, tanh-GELU, tied embeddings,
biases), so :meth:`GPT.from_hf` loads a ``transformers`` ``GPT2LMHeadModel`` and gives the same logits.
Every speedrun idea is one :class:`GPTConfig` field (the architecture: what the weights mean) or one
:class:`GPTExecution` field (how the same model is computed), so an ablation is a config change.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_opt.ops.attention import (
    BACKENDS,
    FLEX_BLOCK,
    attention,
    build_mask,
    flash4_available,
    flash_available,
    resolve_backend,
)
from lightning_opt.ops.cross_entropy import linear_cross_entropy
from lightning_opt.ops.fp8 import fp8_linear, fp8_wanted, mean_loss_grad_scale
from lightning_opt.ops.softcap_ce import linear_softcap_cross_entropy

_MLPS = ("gelu", "relu2", "swiglu")
_NORMS = ("layernorm", "rmsnorm")
_POS = ("learned", "rope")
_ATTENTIONS = ("mha", "mla")
_LOSS_IMPLS = ("torch", "chunked", "chunked_fp8", "fused")


@dataclass
class GPTConfig:
    """Model shape and architecture switches.

    Args:
        vocab_size: number of real tokens.
        vocab_multiple: pad the embedding/head rows up to a multiple of this (128 is fast on GPUs).
        n_layer, n_head, n_embd, block_size: the usual shape; ``block_size`` is the longest sequence.
        n_kv_head: key/value heads for grouped-query attention (``None`` = ``n_head``).
        attention: ``mha`` (multi-head attention, grouped-query with ``n_kv_head``) or ``mla`` (multi-latent
            attention, as in DeepSeek-V2, :class:`MultiLatentAttention`: keys and values are up-projected from a
            per-token latent of ``mla_kv_rank`` dims, and a KV cache holds only that latent and a rope key of
            ``mla_rope_dim`` dims per token and layer).
        mla_kv_rank: the width of MLA's key/value latent ``c_kv``.
        mla_q_rank: MLA's query compression (a down-projection to this width, RMS-normalised, then up to the
            heads); ``None`` projects the queries directly.
        mla_rope_dim: the decoupled RoPE part of each MLA query/key head (even, below ``head_dim``): the key's
            part is one rope key per token shared by all heads, rotated by position, the other
            ``head_dim - mla_rope_dim`` dimensions come from the latent and carry no position. The rope part is
            rotated with either ``pos_emb`` (``learned`` adds absolute positions too); ``0`` (only with
            ``pos_emb="learned"``) has no rope part.
        pos_emb: ``learned`` (GPT-2) or ``rope`` (rotary, ``rope_base``).
        rope_truncate: rotate only the first half of each head's frequency pairs, with frequencies from 1 down
            to ``1 / rope_base`` (the other half of the dimensions carries no position; the speedrun's
            "half-truncated" RoPE, used there with ``rope_base=1024``).
        norm: ``layernorm`` (GPT-2) or ``rmsnorm``.
        norm_weight: learned gains in the norms: ``True`` in every norm (block norms, final norm, QK-norm);
            ``False`` in none (the speedrun record's choice: no per-norm weight gradient to reduce over the
            tokens, and a normalised row never exceeds ``sqrt(width)``, the bound the FP8 input scales assume);
            ``"qk"`` only in QK-norm (where a gain sets the attention's temperature); ``"blocks"`` only in the
            block and final norms.
        bias: biases in linear layers and LayerNorm (GPT-2 has them).
        qk_norm: RMS-normalise queries and keys per head.
        mlp: ``gelu`` (tanh approximation, GPT-2), ``relu2`` (ReLU squared) or ``swiglu``.
        mlp_ratio: hidden width over ``n_embd`` (SwiGLU uses 2/3 of it so the parameter count matches).
        tie_embeddings: share the token embedding with the output head.
        zero_init_proj: initialise output projections (attention and MLP) at zero.
        logit_softcap: ``cap * tanh(logits / cap)`` when set.
        n_value_embeds: value-embedding tables mixed into the values of the first and last layers.
        unet_skips: skip connections from the first half of the layers to the mirrored second half.
        x0_mix: every block starts with ``x = a * x + b * x0`` (learned ``a = 1, b = 0`` at init), ``x0``
            being the block stack's input (the embedding).
        embed_norm: RMS-normalise the token embedding before the first block (no learned weight).
        skip_attn_layers: layers that have no attention, only the MLP (the speedrun drops layer 7's).
        window_size: sliding-window attention span in tokens (``None`` = full causal).
        window_schedule: ``(start, end)``: a sliding window that grows linearly with training progress from
            ``start`` to ``end`` tokens in steps of 128 (the 2025-01-04 speedrun record: 128 -> 1856, i.e. up to
            1792; the shipped recipe: 128 -> 1024); the LightningModule (or a loop calling
            :meth:`GPT.set_train_progress`) moves it. Takes precedence over ``window_size``; use it with
            ``attn_backend="flex"`` for long sequences.
        doc_causal: attend only within documents delimited by ``eot_token``.
        eot_token: the document separator for ``doc_causal``.
        init_std: standard deviation of the normal initialisation.

    How the model is computed (attention kernel, FP8 matmuls, loss kernel, recomputation) and regularised in
    training (dropout, LayerDrop) is :class:`GPTExecution`: the same weights under other settings.
    """

    vocab_size: int = 50257
    vocab_multiple: int = 1
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    n_kv_head: int | None = None
    attention: Literal["mha", "mla"] = "mha"
    mla_kv_rank: int = 256
    mla_q_rank: int | None = None
    mla_rope_dim: int = 32
    pos_emb: str = "learned"
    rope_base: float = 10000.0
    rope_truncate: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_weight: bool | str = True
    bias: bool = True
    qk_norm: bool = False
    mlp: str = "gelu"
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True
    zero_init_proj: bool = False
    logit_softcap: float | None = None
    n_value_embeds: int = 0
    unet_skips: bool = False
    x0_mix: bool = False
    embed_norm: bool = False
    skip_attn_layers: tuple[int, ...] = ()
    window_size: int | None = None
    window_schedule: tuple[int, int] | None = None
    doc_causal: bool = False
    eot_token: int = 50256
    init_std: float = 0.02

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, want: str) -> ValueError:
            return ValueError(f"GPTConfig.{field}={value!r} is invalid: {want}")

        for name in ("vocab_size", "vocab_multiple", "n_layer", "n_head", "n_embd", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise bad(name, getattr(self, name), "must be a positive integer")
        if self.n_embd % self.n_head:
            raise bad("n_embd", self.n_embd, f"must be divisible by n_head={self.n_head}")
        if self.n_kv_head is not None and (self.n_kv_head <= 0 or self.n_head % self.n_kv_head):
            raise bad("n_kv_head", self.n_kv_head, f"must divide n_head={self.n_head}")
        if self.attention not in _ATTENTIONS:
            raise bad("attention", self.attention, f"choose one of {_ATTENTIONS}")
        if self.attention == "mla":
            self._check_mla(bad)
        if self.pos_emb not in _POS:
            raise bad("pos_emb", self.pos_emb, f"choose one of {_POS}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise bad("n_embd", self.n_embd, "rotary embeddings need an even head dimension")
        if self.norm not in _NORMS:
            raise bad("norm", self.norm, f"choose one of {_NORMS}")
        if self.mlp not in _MLPS:
            raise bad("mlp", self.mlp, f"choose one of {_MLPS}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise bad("logit_softcap", self.logit_softcap, "must be positive or None")
        if self.window_size is not None and self.window_size <= 0:
            raise bad("window_size", self.window_size, "must be positive or None")
        if self.window_schedule is not None:
            self.window_schedule = tuple(int(w) for w in self.window_schedule)  # YAML gives lists
            if len(self.window_schedule) != 2 or not 0 < self.window_schedule[0] <= self.window_schedule[1]:
                raise bad("window_schedule", self.window_schedule, "must be (start, end) with 0 < start <= end")
        if not 0 <= self.n_value_embeds <= self.n_layer // 2:
            raise bad("n_value_embeds", self.n_value_embeds, f"must be in [0, n_layer // 2 = {self.n_layer // 2}]")
        if self.norm_weight not in (True, False, "qk", "blocks"):
            raise bad("norm_weight", self.norm_weight, "choose true, false, 'qk' (gains in QK-norm only) or 'blocks' "
                      "(gains in the block and final norms only)")
        if self.norm_weight == "qk" and not self.qk_norm:
            raise bad("norm_weight", self.norm_weight, "'qk' puts gains in QK-norm, which needs qk_norm=True")
        self.skip_attn_layers = tuple(int(i) for i in self.skip_attn_layers)  # YAML gives lists
        bad_layers = [i for i in self.skip_attn_layers if not 0 <= i < self.n_layer]
        if bad_layers:
            raise bad("skip_attn_layers", self.skip_attn_layers, f"layers must be in [0, n_layer={self.n_layer})")
        for i in range(self.n_value_embeds):  # value embedding i feeds layers i and n_layer - n_value_embeds + i
            pair = {i, self.n_layer - self.n_value_embeds + i}
            if pair <= set(self.skip_attn_layers):
                raise bad("skip_attn_layers", self.skip_attn_layers,
                          f"drops the attention of both layers {sorted(pair)} that value embedding {i} feeds; the "
                          "table would get no gradient (plain DDP fails): keep one of them or lower n_value_embeds")
        if self.rope_truncate and self.head_dim % 4:
            raise bad("rope_truncate", self.rope_truncate, f"needs a head dimension divisible by 4, got {self.head_dim}")
        if self.doc_causal and not 0 <= self.eot_token < self.vocab_size:
            raise bad("eot_token", self.eot_token, f"must be a token id below vocab_size={self.vocab_size}")

    def _check_mla(self, bad: Any) -> None:
        """The ``attention="mla"`` fields, and the options multi-latent attention does not take."""
        if self.n_kv_head not in (None, self.n_head):
            raise bad("n_kv_head", self.n_kv_head, "is for attention='mha' (grouped-query attention); MLA shares "
                      "keys and values through its latent (mla_kv_rank): leave n_kv_head unset")
        if self.mla_kv_rank <= 0:
            raise bad("mla_kv_rank", self.mla_kv_rank, "must be a positive integer")
        if self.mla_q_rank is not None and self.mla_q_rank <= 0:
            raise bad("mla_q_rank", self.mla_q_rank, "must be a positive integer, or None for uncompressed queries")
        if not 0 <= self.mla_rope_dim < self.head_dim or self.mla_rope_dim % 2:
            raise bad("mla_rope_dim", self.mla_rope_dim, f"must be even and in [0, head_dim={self.head_dim})")
        if self.mla_rope_dim == 0 and self.pos_emb == "rope":
            raise bad("mla_rope_dim", self.mla_rope_dim, "MLA rotates only its rope part: pos_emb='rope' needs "
                      "mla_rope_dim > 0 (or use pos_emb='learned')")
        if self.rope_truncate and self.mla_rope_dim % 4:
            raise bad("rope_truncate", self.rope_truncate, f"needs mla_rope_dim divisible by 4, got {self.mla_rope_dim}")
        if self.n_value_embeds:
            raise bad("n_value_embeds", self.n_value_embeds, "is not supported with attention='mla' (value "
                      "embeddings would have to be cached beside the latent)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> GPTConfig:
        """The config that :meth:`to_dict` (or a checkpoint's hyperparameters) describes.

        Accepts a ``GPTConfig``, a dict or a jsonargparse ``Namespace``: LightningCLI saves a model's
        hyperparameters as the parsed config (lists where the dataclass holds tuples), so
        ``GPTConfig.from_dict(checkpoint["hyper_parameters"]["model_config"]) == config`` for the config that
        made it. Fields the dict lacks take their defaults; keys that are not fields are refused, and
        :class:`GPTExecution` settings are refused naming where they belong (``model.execution``).
        """
        if isinstance(values, cls):
            return values
        if hasattr(values, "as_dict"):  # jsonargparse Namespace
            values = values.as_dict()
        values = dict(values)
        execution = sorted(k for k in values if k in GPTExecution.__dataclass_fields__)
        if execution:
            raise ValueError(f"model_config holds execution settings {execution}: they are GPTExecution fields; "
                             "move them under model.execution (GPT2SpeedrunModule(execution=...))")
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in values if k not in names)
        if unknown:
            raise ValueError(f"GPTConfig has no field(s) {unknown}; the config comes from another version or model")
        return cls(**values)


@dataclass
class GPTExecution:
    """How a :class:`GPT` is computed, and regularised in training: settings under which the same weights mean
    the same model, so a checkpoint resumes with other values (a recipe's ``model.execution``).

    Args:
        attn_backend: ``auto``, ``flash``, ``flash4`` (flash-attn-4 on Hopper and newer GPUs, the ``gpu`` extra),
            ``sdpa``, ``cudnn`` (SDPA with cuDNN's fused attention first), ``math`` or ``flex`` (see
            :mod:`lightning_opt.ops.attention`).
        dropout: dropout probability in training, as in nanoGPT: on the embedding, on the attention weights
            and on the attention and MLP outputs before they join the residual stream (``0.0``: none, the
            pretraining default; ``0.1`` is common for fine-tuning). Training with dropout attends through
            PyTorch SDPA (``attn_backend`` ``auto``, ``sdpa``, ``cudnn`` or ``math``).
        loss_impl: ``torch`` (logits, then ``F.cross_entropy``) or ``chunked``
            (:func:`~lightning_opt.ops.cross_entropy.linear_cross_entropy`: never holds all float32 logits)
            or ``chunked_fp8`` (the same with the head matmuls in FP8 via ``torch._scaled_mm``; H100-class
            GPUs, training loss only: ``model(idx)`` logits stay in the autocast dtype) or ``fused`` (the head
            matmul, then one Triton kernel for the soft-capped loss and its logit gradient,
            :func:`~lightning_opt.ops.softcap_ce.linear_softcap_cross_entropy`; outside the compiled graph).
        loss_chunk_size: tokens per chunk for ``chunked``.
        grad_checkpoint: recompute blocks in the backward pass (activation checkpointing) to save memory:
            ``True`` every block, ``False`` (or ``0``) none, an integer ``N`` the first ``N`` blocks (those whose
            saved activations live longest; the memory saved grows with ``N``, and so does the recompute).
        layer_drop: stochastic depth (LayerDrop): in training, block ``i`` (0-based) is skipped with probability
            ``layer_drop * (i + 1) / n_layer`` (rising linearly with depth to ``layer_drop`` for the last block),
            and a block that runs has its change to the residual stream scaled by ``1 / (1 - p_i)``, so that
            evaluation, which runs every block unscaled, sees the same expected stream. The draw is one per
            forward pass from a CPU generator (``GPT.layer_drop_generator``, default torch's global one): no
            device sync, and a skipped block costs nothing. Skipped blocks get no gradient: with DDP, set
            ``find_unused_parameters=True``. ``0.0`` (default) changes nothing.
        head_fp8: in training, run the output head's matmul in FP8 with static scales (GPUs of compute
            capability 8.9+): with ``loss_impl="torch"`` the forward and both backward matmuls
            (:func:`~lightning_opt.ops.fp8.fp8_linear`), with ``loss_impl="fused"`` the forward matmul and
            both gradient matmuls (from the e5m2 gradient copy the loss kernel writes). ``True`` insists (an error on
            other devices, and it needs an untied head and one of those two losses); ``"auto"`` uses FP8
            where the GPU has it and the model allows it, the compute dtype elsewhere (CPUs only emulate
            FP8, slowly). Evaluation and ``model(idx)`` keep the autocast dtype.
        mlp_fp8: in training, run both MLP matmuls (forward and backward) in FP8 with static scales
            (:func:`~lightning_opt.ops.fp8.fp8_linear`): the input of ``c_fc`` is RMS/layer-normalised
            (scale ``sqrt(n_embd) / 448``), the input of ``c_proj`` is the activation (scale 1: values up to
            448, larger ones saturate), output gradients are scaled for a mean loss over the rows. ``True``
            insists, ``"auto"`` uses FP8 where the GPU has it and the model runs under ``torch.compile``
            (eager, FP8 costs more than it saves). Widths must be multiples of 16.
        attn_fp8: the same for the attention projections ``c_attn`` (input normalised, scale
            ``sqrt(n_embd) / 448``) and ``c_proj`` (input the attention output, a convex mix of value rows:
            scale 1). The attention itself (softmax(QK^T)V) stays in the compute dtype.
        fp8_backward_fast_accum: fast accumulation (``torch._scaled_mm(use_fast_accum=True)``) in the backward
            FP8 matmuls of ``head_fp8`` / ``mlp_fp8`` / ``attn_fp8`` (the forward ones always accumulate fast);
            ``False`` promotes partial sums to float32 (docs/gpt2.md gives the measured effect).
    """

    attn_backend: str = "auto"
    dropout: float = 0.0
    layer_drop: float = 0.0
    loss_impl: str = "torch"
    loss_chunk_size: int = 4096
    grad_checkpoint: bool | int = False
    head_fp8: bool | str = False
    mlp_fp8: bool | str = False
    attn_fp8: bool | str = False
    fp8_backward_fast_accum: bool = False

    def __post_init__(self) -> None:
        bad = _bad("GPTExecution")
        if self.attn_backend not in BACKENDS:
            raise bad("attn_backend", self.attn_backend, f"choose one of {BACKENDS}")
        if self.loss_impl not in _LOSS_IMPLS:
            raise bad("loss_impl", self.loss_impl, f"choose one of {_LOSS_IMPLS}")
        for name in ("head_fp8", "mlp_fp8", "attn_fp8"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value == "auto"):
                raise bad(name, value, "choose true, false or 'auto' (FP8 where the GPU supports it)")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", self.dropout, "must be in [0, 1)")
        if self.dropout and self.attn_backend in ("flash", "flash4", "flex"):
            raise bad("dropout", self.dropout, f"needs attn_backend 'auto', 'sdpa', 'cudnn' or 'math' (not "
                      f"{self.attn_backend!r}: its kernel here takes no attention dropout)")
        if self.loss_chunk_size <= 0:
            raise bad("loss_chunk_size", self.loss_chunk_size, "must be a positive integer")
        if not isinstance(self.grad_checkpoint, bool) and self.grad_checkpoint < 0:
            raise bad("grad_checkpoint", self.grad_checkpoint, "must be true, false or a number of leading blocks")
        if not 0.0 <= self.layer_drop < 1.0:
            raise bad("layer_drop", self.layer_drop, "must be in [0, 1)")

    def check(self, config: GPTConfig) -> None:
        """Refuse the settings that ``config``'s architecture cannot run with (what :class:`GPT` checks)."""
        bad = _bad("GPTExecution")
        if config.window_schedule is not None and self.attn_backend in ("flash", "flash4"):
            raise bad("attn_backend", self.attn_backend, "cannot move the window of GPTConfig.window_schedule "
                      "(flash-attn takes a fixed window): use 'flex', 'sdpa', 'cudnn', 'math' or 'auto'")
        hidden = int(config.mlp_ratio * config.n_embd)
        if self.mlp_fp8 and (config.n_embd % 16 or hidden % 16):
            raise bad("mlp_fp8", self.mlp_fp8, f"needs n_embd ({config.n_embd}) and the MLP width ({hidden}) "
                      "divisible by 16")
        if self.mlp_fp8 and config.mlp == "swiglu":
            raise bad("mlp_fp8", self.mlp_fp8, "is for the gelu and relu2 MLPs (not swiglu)")
        qkv = (config.n_head + 2 * config.kv_heads) * config.head_dim
        if self.attn_fp8 and (qkv % 16 or config.n_embd % 16):
            raise bad("attn_fp8", self.attn_fp8, f"needs n_embd ({config.n_embd}) and the q/k/v width ({qkv}) "
                      "divisible by 16")
        if self.attn_fp8 is True and config.attention == "mla":
            raise bad("attn_fp8", self.attn_fp8, "is not supported with attention='mla' (its projections run in the "
                      "compute dtype; 'auto' leaves them there)")
        # True insists; "auto" is off wherever it cannot apply (a tied head, another loss, odd sizes)
        if self.head_fp8 is True and not self.fp8_head_applicable(config):
            raise bad("head_fp8", self.head_fp8, "needs tie_embeddings=False, loss_impl 'torch' or 'fused', and n_embd "
                      f"and the padded vocabulary divisible by 16 (got {config.n_embd} and "
                      f"{config.padded_vocab_size}; set vocab_multiple to 128)")
        if not isinstance(self.grad_checkpoint, bool) and self.grad_checkpoint > config.n_layer:
            raise bad("grad_checkpoint", self.grad_checkpoint,
                      f"must be true, false or a number of leading blocks in [0, n_layer={config.n_layer}]")

    def checkpointed_blocks(self, n_layer: int) -> int:
        """How many leading blocks of ``n_layer`` ``grad_checkpoint`` recomputes in the backward pass."""
        if isinstance(self.grad_checkpoint, bool):
            return n_layer if self.grad_checkpoint else 0
        return int(self.grad_checkpoint)

    def layer_drop_prob(self, layer: int, n_layer: int) -> float:
        """The probability that training skips block ``layer`` of ``n_layer`` (see ``layer_drop``)."""
        return self.layer_drop * (layer + 1) / n_layer

    def fp8_head_applicable(self, config: GPTConfig) -> bool:
        """Whether ``config``'s head can run in FP8 under this loss (what ``head_fp8="auto"`` checks first)."""
        return (not config.tie_embeddings and self.loss_impl in ("torch", "fused") and config.n_embd % 16 == 0
                and config.padded_vocab_size % 16 == 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> GPTExecution:
        """The settings a dict, a jsonargparse ``Namespace`` or a checkpoint's hyperparameters describe (keys
        this version does not know are refused)."""
        if isinstance(values, cls):
            return values
        if hasattr(values, "as_dict"):  # jsonargparse Namespace
            values = values.as_dict()
        values = dict(values)
        unknown = sorted(k for k in values if k not in {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"GPTExecution has no field(s) {unknown}; the config comes from another version")
        return cls(**values)


def _bad(owner: str) -> Any:
    def bad(field: str, value: Any, want: str) -> ValueError:
        return ValueError(f"{owner}.{field}={value!r} is invalid: {want}")

    return bad

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_weight in (True, "blocks"))
    return nn.LayerNorm(dim, eps=cfg.norm_eps, elementwise_affine=cfg.norm_weight in (True, "blocks"), bias=cfg.bias)


def linear_maybe_fp8(lin: nn.Linear, x: torch.Tensor, fp8: bool, x_scale: float | None = None,
                     backward_fast_accum: bool = False) -> torch.Tensor:
    """``lin(x)``, through :func:`~lightning_opt.ops.fp8.fp8_linear` when ``fp8`` (inputs bounded by
    ``448 * x_scale``, by default ``sqrt(width)``: a normalised row of unit gain; the output gradient scaled
    for a loss averaged over the rows)."""
    if not fp8:
        return lin(x)
    y = fp8_linear(x, lin.weight, x_scale=x_scale, grad_scale=mean_loss_grad_scale(math.prod(x.shape[:-1])),
                   backward_fast_accum=backward_fast_accum)
    # the dtype lin(x) would give: bfloat16 under bf16 autocast (no copy), x's dtype without autocast (so q/k
    # meet a float32 v, or a float32 residual, in float32)
    dev = x.device.type
    want = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    y = y.to(want)
    return y if lin.bias is None else y + lin.bias


class Rotary(nn.Module):
    """Rotary position embedding; the tables are buffers so they follow ``.to(device)``."""

    def __init__(self, head_dim: int, max_len: int, base: float, truncate: bool = False) -> None:
        super().__init__()
        if truncate:  # half the pairs rotate (frequencies 1 .. 1/base), the other half are position-free
            quarter = head_dim // 4
            inv_freq = torch.cat([(1.0 / base) ** torch.linspace(0, 1, quarter), torch.zeros(quarter)])
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:  # x: [B, H, T, D] at positions start..
        t = x.shape[2]
        cos, sin = self.cos[start : start + t].to(x.dtype), self.sin[start : start + t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ex: GPTExecution) -> None:
        super().__init__()
        self.cfg, self.ex = cfg, ex
        self.layer = layer
        self.n_head, self.n_kv, self.hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv) * self.hd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Muon orthogonalises the query, key and value rows of the fused projection separately
        self.c_attn.weight.muon_row_splits = (self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd)
        self.rotary = (Rotary(self.hd, cfg.block_size, cfg.rope_base, cfg.rope_truncate)
                       if cfg.pos_emb == "rope" else None)
        qk_gain = cfg.norm_weight in (True, "qk")
        self.q_norm = RMSNorm(self.hd, weight=qk_gain) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, weight=qk_gain) if cfg.qk_norm else None
        # learned mix of the value embedding into the values (modded-nanogpt style)
        # only in the layers that get one (the first and last n_value_embeds): a parameter no loss reaches
        # would make plain DDP fail after the first backward
        has_ve = layer < cfg.n_value_embeds or layer >= cfg.n_layer - cfg.n_value_embeds
        self.ve_lambda = nn.Parameter(torch.tensor(0.5)) if cfg.n_value_embeds and has_ve else None
        # decide flash-attn vs SDPA now: inside torch.compile the import probe would break the graph
        resolve_backend(ex.attn_backend)

    def forward(
        self,
        x: torch.Tensor,
        ve: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        fp8 = fp8_wanted(self.ex.attn_fp8, x, self.training, compiled_only=True)
        fast = self.ex.fp8_backward_fast_accum
        qkv = linear_maybe_fp8(self.c_attn, x, fp8, backward_fast_accum=fast)  # x normalised: default FP8 scale
        q, k, v = qkv.split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        if ve is not None and self.ve_lambda is not None:
            v = v + self.ve_lambda * ve.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            start = 0 if kv_cache is None else kv_cache.length
            q, k = self.rotary(q, start), self.rotary(k, start)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)
        y = _attend(self.cfg, self.ex, q, k, v, self.training, window, doc_ids, kv_cache)
        return linear_maybe_fp8(self.c_proj, y.transpose(1, 2).reshape(b, t, -1), fp8, x_scale=1.0,
                                backward_fast_accum=fast)


def _attend(cfg: GPTConfig, ex: GPTExecution, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, training: bool,
            window: int | torch.Tensor | None, doc_ids: torch.Tensor | None, kv_cache: KVCache | None) -> torch.Tensor:
    """Causal attention of ``q`` ``[B, H, T, D]`` over ``k, v`` ``[B, H_kv, S, D]``: with ``kv_cache``, under its
    mask (``k, v`` hold the cached positions too); in training with dropout, through SDPA; else through the
    configured kernel (:func:`~lightning_opt.ops.attention.attention`), within the window and documents."""
    window = cfg.window_size if window is None else window
    gqa = k.shape[1] != q.shape[1]
    if kv_cache is not None:  # these positions attend to everything cached before them, and to themselves
        return F.scaled_dot_product_attention(q, k, v, attn_mask=kv_cache.mask, enable_gqa=gqa)
    if training and ex.dropout:
        mask = None if window is None and doc_ids is None else build_mask(q.shape[2], q.device, window, doc_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=ex.dropout,
                                              is_causal=mask is None, enable_gqa=gqa)
    return attention(q, k, v, window=window, doc_ids=doc_ids, backend=ex.attn_backend)


def _norm_in_dtype(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with its gain cast to ``x``'s dtype: a projection's bfloat16 output under autocast stays on
    the fused kernel (a float32 gain beside a bfloat16 input falls back to the unfused one)."""
    weight = None if norm.weight is None else norm.weight.to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, norm.eps)


class MultiLatentAttention(nn.Module):
    """Multi-latent attention (DeepSeek-V2, arXiv:2405.04434) with decoupled RoPE.

    Each token's input is projected down to a key/value latent ``c_kv`` (``mla_kv_rank`` dims, RMS-normalised)
    and a rope key (``mla_rope_dim`` dims) shared by all heads. Per head, the keys' first ``head_dim -
    mla_rope_dim`` dimensions and the values (``head_dim``) are up-projected from ``c_kv``; the keys' last
    ``mla_rope_dim`` dimensions are the rope key rotated by position. Queries split the same way (their rope
    part rotated), directly from the input or through a ``mla_q_rank`` latent. Query/key heads keep ``head_dim``
    dimensions, so the attention itself costs what multi-head attention costs, on the same kernels (windows,
    documents, flash/SDPA/flex). A :class:`KVCache` holds only ``c_kv`` and the (unrotated) rope key per token:
    ``mla_kv_rank + mla_rope_dim`` numbers per layer, against ``2 * n_kv_head * head_dim`` for MHA/GQA. A call
    on the cache with few new positions (decoding) attends in latent space, the up-projections absorbed into the
    query and the output (no per-head keys or values are formed); a longer one (a prompt), or a model with
    QK-norm, up-projects the cached latents into keys and values as the full forward pass does.
    """

    def __init__(self, cfg: GPTConfig, layer: int, ex: GPTExecution) -> None:
        super().__init__()
        self.cfg, self.ex = cfg, ex
        self.layer = layer
        self.n_head, self.hd, self.rope_dim = cfg.n_head, cfg.head_dim, cfg.mla_rope_dim
        self.nope_dim, self.kv_rank = self.hd - self.rope_dim, cfg.mla_kv_rank
        latent_gain = cfg.norm_weight in (True, "blocks")  # the latent norms are weighted like the block norms
        if cfg.mla_q_rank is None:
            self.q_down, self.q_latent_norm = None, None
            self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        else:
            self.q_down = nn.Linear(cfg.n_embd, cfg.mla_q_rank, bias=cfg.bias)
            self.q_latent_norm = RMSNorm(cfg.mla_q_rank, cfg.norm_eps, weight=latent_gain)
            self.q_proj = nn.Linear(cfg.mla_q_rank, cfg.n_embd, bias=cfg.bias)
        self.kv_down = nn.Linear(cfg.n_embd, self.kv_rank + self.rope_dim, bias=cfg.bias)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps, weight=latent_gain)
        self.kv_up = nn.Linear(self.kv_rank, self.n_head * (self.nope_dim + self.hd), bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Muon orthogonalises the latent and rope rows, and the key and value rows, separately
        if self.rope_dim:
            self.kv_down.weight.muon_row_splits = (self.kv_rank, self.rope_dim)
        self.kv_up.weight.muon_row_splits = (self.n_head * self.nope_dim, self.n_head * self.hd)
        self.rotary = (Rotary(self.rope_dim, cfg.block_size, cfg.rope_base, cfg.rope_truncate)
                       if self.rope_dim else None)
        qk_gain = cfg.norm_weight in (True, "qk")
        self.q_norm = RMSNorm(self.hd, weight=qk_gain) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, weight=qk_gain) if cfg.qk_norm else None
        resolve_backend(ex.attn_backend)

    def _rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """``x`` ``[B, H, T, head_dim]`` at positions ``start..`` with its rope part rotated."""
        if self.rotary is None:
            return x
        return torch.cat([x[..., : self.nope_dim], self.rotary(x[..., self.nope_dim :], start)], dim=-1)

    def keys_values(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, S, head_dim]`` of positions ``0..S-1`` from their latents ``c_kv`` ``[B, S,
        mla_kv_rank]`` (normalised) and rope keys ``k_rope`` ``[B, S, mla_rope_dim]`` (unrotated)."""
        b, s, _ = c_kv.shape
        kv = self.kv_up(c_kv).view(b, s, self.n_head, self.nope_dim + self.hd).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.hd], dim=-1)
        k_rope = k_rope[:, None]  # [B, 1, S, mla_rope_dim]: one rope key for every head
        if self.k_norm is None:  # rotating the shared key before broadcasting it is cheaper, and the same
            if self.rotary is not None:
                k_rope = self.rotary(k_rope, 0)
            return torch.cat([k_nope, k_rope.expand(b, self.n_head, s, self.rope_dim)], dim=-1), v
        k = self.k_norm(torch.cat([k_nope, k_rope.expand(b, self.n_head, s, self.rope_dim)], dim=-1))
        return self._rotate(k, 0), v

    def forward(
        self,
        x: torch.Tensor,
        ve: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x if self.q_down is None else _norm_in_dtype(self.q_latent_norm, self.q_down(x)))
        q = q.view(b, t, self.n_head, self.hd).transpose(1, 2)
        c_kv, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c_kv = _norm_in_dtype(self.kv_norm, c_kv)
        start = 0
        if kv_cache is not None:  # the cache holds latents
            start = kv_cache.length
            c_kv, k_rope = kv_cache.update_latent(self.layer, c_kv, k_rope)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self._rotate(q, start)
        if kv_cache is not None and self._absorb(t):
            y = self._latent_attention(q, c_kv, k_rope, kv_cache.mask)
        else:  # every (cached) position's keys and values, up-projected from its latent
            k, v = self.keys_values(c_kv, k_rope)
            y = _attend(self.cfg, self.ex, q, k, v, self.training, window, doc_ids, kv_cache)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))

    def _absorb(self, t: int) -> bool:
        """Whether ``t`` new positions attend in latent space (:meth:`_latent_attention`): without QK-norm, and when
        that costs less than up-projecting every cached latent (few new positions: decoding)."""
        latent_cost = 2 * t * (self.kv_rank + self.rope_dim)  # per cached position and head: scores + mix
        rebuild_cost = self.kv_rank * (self.nope_dim + self.hd) + 2 * t * self.hd
        return self.k_norm is None and latent_cost <= rebuild_cost

    def _latent_attention(self, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
        """Attention with the up-projections absorbed (DeepSeek-V2's decoding): each head's query is mapped into
        the latent space, scored against the cached latents (plus the rope part against the rope keys), the
        latents mixed by the softmax weights and only then up-projected to values. ``q`` ``[B, H, T, head_dim]``
        (rotated), ``c_kv`` / ``k_rope`` ``[B, S, .]`` cached, ``mask`` the cache's; ``[B, H, T, head_dim]``.
        Equal to attending over the up-projected keys and values: a key bias adds the same score to every key
        of a query, and a value bias passes through the weights' unit sum."""
        w = self.kv_up.weight.view(self.n_head, self.nope_dim + self.hd, self.kv_rank)
        w_k, w_v = w.split([self.nope_dim, self.hd], dim=1)  # [H, nope, r], [H, head_dim, r]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        scores = (q_nope @ w_k) @ c_kv[:, None].transpose(-2, -1)  # [B, H, T, S]
        if self.rotary is not None:
            scores = scores + q_rope @ self.rotary(k_rope[:, None], 0).transpose(-2, -1)
        scores = scores.float() * (1.0 / math.sqrt(self.hd))
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(c_kv.dtype)
        y = (probs @ c_kv[:, None]) @ w_v.transpose(-2, -1)  # [B, H, T, head_dim]
        if self.kv_up.bias is not None:
            y = y + self.kv_up.bias.view(self.n_head, 1, self.nope_dim + self.hd)[..., self.nope_dim :]
        return y


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ex: GPTExecution) -> None:
        super().__init__()
        self.kind = cfg.mlp
        self.fp8 = ex.mlp_fp8
        self.fp8_fast_accum = ex.fp8_backward_fast_accum
        hidden = int(cfg.mlp_ratio * cfg.n_embd)
        if cfg.mlp == "swiglu":
            hidden = int(2 * hidden / 3)
            self.c_fc = nn.Linear(cfg.n_embd, 2 * hidden, bias=cfg.bias)
        else:
            self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = fp8_wanted(self.fp8, x, self.training, compiled_only=True)
        fast = self.fp8_fast_accum
        h = linear_maybe_fp8(self.c_fc, x, fp8, backward_fast_accum=fast)  # x normalised: default FP8 scale
        if self.kind == "gelu":
            h = F.gelu(h, approximate="tanh")
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            a, g = h.chunk(2, dim=-1)
            h = F.silu(g) * a
        return linear_maybe_fp8(self.c_proj, h, fp8, x_scale=1.0, backward_fast_accum=fast)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ex: GPTExecution) -> None:
        super().__init__()
        has_attn = layer not in cfg.skip_attn_layers
        self.ln_1 = make_norm(cfg, cfg.n_embd) if has_attn else None
        attn_cls = MultiLatentAttention if cfg.attention == "mla" else CausalSelfAttention
        self.attn = attn_cls(cfg, layer, ex) if has_attn else None
        self.ln_2 = make_norm(cfg, cfg.n_embd)
        self.mlp = MLP(cfg, ex)
        self.x0_lambdas = nn.Parameter(torch.tensor([1.0, 0.0])) if cfg.x0_mix else None
        self.dropout = ex.dropout

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(
        self,
        x: torch.Tensor,
        ve: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        x0: torch.Tensor | None = None,
        window: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        if self.x0_lambdas is not None and x0 is not None:
            x = self.x0_lambdas[0] * x + self.x0_lambdas[1] * x0
        if self.attn is not None:
            x = x + self._drop(self.attn(self.ln_1(x), ve, doc_ids, window, kv_cache))
        return x + self._drop(self.mlp(self.ln_2(x)))


class KVCache:
    """The keys and values of every attention layer for a batch of sequences, preallocated to ``max_len``.

    ``model(idx, kv_cache=cache)`` gives ``idx`` the next ``idx.shape[1]`` positions of each sequence: they
    attend to the cached keys and values (and to each other, causally, within the model's sliding window and
    documents) and are appended. Computed this way the logits equal those of the full forward pass over the
    whole sequence, to float rounding: every other part of the model (positions, value embeddings, U-net
    skips, ``x0`` mixing, normalisation, MLPs) is per token. :meth:`GPT.generate` uses it. Multi-latent
    attention layers (``attention="mla"``) store their per-token latent and rope key instead of keys and values
    (:meth:`update_latent`); :meth:`nbytes` is what the cache holds.

    Args:
        model: the :class:`GPT` whose layers are cached (layers in ``skip_attn_layers`` need no cache).
        batch_size: sequences decoded together.
        max_len: positions to hold, at most ``block_size`` (positions and RoPE tables end there).
    """

    def __init__(self, model: GPT, batch_size: int, max_len: int) -> None:
        cfg = model.config
        if not 0 < max_len <= cfg.block_size:
            raise ValueError(f"KVCache max_len={max_len} must be in [1, block_size={cfg.block_size}]")
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0  # positions filled
        self.layers = [i for i, blk in enumerate(model.blocks) if blk.attn is not None]
        self.keys: dict[int, torch.Tensor] = {}  # allocated at the first update, in the keys' dtype and device
        self.values: dict[int, torch.Tensor] = {}
        self.latents: dict[int, torch.Tensor] = {}  # MLA layers: c_kv [B, max_len, mla_kv_rank]
        self.rope_keys: dict[int, torch.Tensor] = {}  # MLA layers: unrotated [B, max_len, mla_rope_dim]
        self.doc_ids: torch.Tensor | None = None  # [B, max_len] with doc_causal
        self.mask: torch.Tensor | None = None  # the current call's [T, S] or [B, 1, T, S] attention mask

    def reset(self) -> None:
        """Forget the cached positions (the buffers are kept for the next sequences)."""
        self.length = 0

    def begin(self, idx: torch.Tensor, window: int | torch.Tensor | None, doc_ids: torch.Tensor | None) -> None:
        """Prepare a call on ``idx`` ``[B, T]``: check the room left, and build its attention mask."""
        b, t = idx.shape
        start, end = self.length, self.length + t
        if b != self.batch_size:
            raise ValueError(f"the KVCache holds {self.batch_size} sequences, the input has {b}")
        if end > self.max_len:
            raise ValueError(f"the KVCache holds {start} of at most {self.max_len} positions: {t} more do not fit; "
                             "start a new cache (or reset() it) with the last block_size tokens")
        q_pos = torch.arange(start, end, device=idx.device)
        k_pos = torch.arange(end, device=idx.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
        if doc_ids is not None:  # documents continue across calls: ids count separators from position 0
            if self.doc_ids is None:
                self.doc_ids = torch.zeros(b, self.max_len, dtype=doc_ids.dtype, device=idx.device)
            before = self.doc_ids[:, start - 1 : start] if start else 0
            self.doc_ids[:, start:end] = doc_ids + before
            same_doc = self.doc_ids[:, start:end, None] == self.doc_ids[:, None, :end]
            mask = (mask[None] & same_doc)[:, None]
        self.mask = mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``layer``'s keys and values ``[B, H_kv, T, D]`` of the current call; all of its cached ones."""
        if layer not in self.keys:
            shape = (self.batch_size, k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def update_latent(self, layer: int, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store an MLA ``layer``'s latents ``[B, T, mla_kv_rank]`` and rope keys ``[B, T, mla_rope_dim]`` of the
        current call; all of its cached ones."""
        if layer not in self.latents:
            self.latents[layer] = c_kv.new_zeros(self.batch_size, self.max_len, c_kv.shape[-1])
            self.rope_keys[layer] = k_rope.new_zeros(self.batch_size, self.max_len, k_rope.shape[-1])
        start, end = self.length, self.length + c_kv.shape[1]
        self.latents[layer][:, start:end] = c_kv
        self.rope_keys[layer][:, start:end] = k_rope
        return self.latents[layer][:, :end], self.rope_keys[layer][:, :end]

    def nbytes(self) -> int:
        """Bytes of the cached keys and values (or latents and rope keys) allocated so far, all layers."""
        tensors = (*self.keys.values(), *self.values.values(), *self.latents.values(), *self.rope_keys.values())
        return sum(x.numel() * x.element_size() for x in tensors)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token ``[B]`` from ``logits`` ``[B, V]``.

    ``greedy`` (or ``temperature=0``) takes the argmax. Otherwise the logits are divided by ``temperature``,
    cut to the ``top_k`` largest (ties with the k-th kept) and then to the smallest set of most likely tokens
    whose probability reaches ``top_p`` (nucleus sampling; the most likely token always stays), and a token
    is drawn from what is left with ``generator``.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no cut)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no cut)")
    if greedy or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before these already reach top_p
        logits = logits.masked_fill(beyond.scatter(-1, order, beyond), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


class GPT(nn.Module):
    """GPT-2 language model.

    ``model(idx)`` returns logits ``[B, T, vocab_size]``; ``model(idx, targets)`` returns the mean
    cross-entropy loss. ``config`` is the architecture (what the weights mean); ``execution`` how it is
    computed and regularised in training (:class:`GPTExecution`, defaults when ``None``).

    Subclasses extend it through :meth:`hidden_states` (the final-norm hidden states) and :meth:`hidden_loss`
    (the loss of hidden states against targets), e.g. for multi-token prediction or mixture-of-experts
    MLPs (docs/gpt2.md).

    Example:
        >>> model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64))
        >>> logits = model(torch.zeros(1, 8, dtype=torch.long))
    """

    def __init__(self, config: GPTConfig, execution: GPTExecution | None = None) -> None:
        super().__init__()
        self.config = cfg = config
        self.execution = ex = execution if execution is not None else GPTExecution()
        ex.check(cfg)
        if ex.attn_backend == "flash":
            if not flash_available():  # say so now, not at the first training step
                raise ImportError(
                    "GPTExecution.attn_backend='flash' needs flash-attn 2, a source build (pip install flash-attn "
                    "--no-build-isolation); or set attn_backend='flash4' after pip install 'lightning-opt[gpu]', "
                    "or 'auto' to fall back to PyTorch SDPA"
                )
        if ex.attn_backend == "flash4" and not flash4_available():
            raise ImportError(
                "GPTExecution.attn_backend='flash4' needs flash-attn-4: pip install 'lightning-opt[gpu]' "
                "(or set attn_backend='sdpa')"
            )
        v = cfg.padded_vocab_size
        self.wte = nn.Embedding(v, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_emb == "learned" else None
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.value_embeds = nn.ModuleList(nn.Embedding(v, kv_dim) for _ in range(cfg.n_value_embeds))
        self.blocks = nn.ModuleList(Block(cfg, i, ex) for i in range(cfg.n_layer))
        self.skip_weights = nn.Parameter(torch.ones(cfg.n_layer // 2)) if cfg.unet_skips else None
        self.ln_f = make_norm(cfg, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, v, bias=False)
        # the CPU generator that draws which blocks layer_drop skips (None: torch's global generator)
        self.layer_drop_generator: torch.Generator | None = None
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if cfg.zero_init_proj:
                    nn.init.zeros_(p)
                else:  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
                    nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        if cfg.window_schedule is not None:  # a device scalar: moving the window recompiles nothing
            # persistent: a model restored from a checkpoint evaluates with the window it was trained to
            self.register_buffer("attn_window", torch.tensor(cfg.window_schedule[0]))
        else:
            self.attn_window = None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        elif cfg.zero_init_proj:
            nn.init.zeros_(self.lm_head.weight)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    # ----------------------------------------------------------------------------------------------
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (shared tensors once); without position/token embeddings by default."""
        n = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if non_embedding:
            n -= self.wte.weight.numel()
            n -= sum(e.weight.numel() for e in self.value_embeds)
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if self.config.tie_embeddings:  # the tied head does the work of a matrix: count it once
                n += self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 x matmul parameters + 12 x layers x width x attended length."""
        cfg = self.config
        t = seq_len or cfg.block_size
        window = self.window_at(1.0) if cfg.window_schedule else cfg.window_size
        span = min(t, window) if window else t
        n = self.num_params(non_embedding=True)
        # causal attention touches on average about half the span; keep the standard (PaLM) count
        # (MLA's projections are matmul parameters like any other; its query/key heads keep head_dim dimensions)
        return 6.0 * n + 12.0 * (cfg.n_layer - len(cfg.skip_attn_layers)) * cfg.n_embd * span

    def kv_cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes a :class:`KVCache` holds per token of one sequence, all layers, in ``dtype``.

        Per attention layer: ``2 * kv_heads * head_dim`` numbers (keys and values) for MHA/GQA;
        ``mla_kv_rank + mla_rope_dim`` (the latent and the shared rope key) for MLA.
        """
        cfg = self.config
        per_layer = cfg.mla_kv_rank + cfg.mla_rope_dim if cfg.attention == "mla" else 2 * cfg.kv_heads * cfg.head_dim
        n_attn = sum(blk.attn is not None for blk in self.blocks)
        return n_attn * per_layer * torch.empty((), dtype=dtype).element_size()

    def window_at(self, progress: float) -> int | None:
        """The scheduled attention window (tokens) at ``progress`` in [0, 1] of training, or ``None``."""
        if self.config.window_schedule is None:
            return None
        start, end = self.config.window_schedule
        p = min(max(progress, 0.0), 1.0)
        step = min(FLEX_BLOCK, start)
        return max(step, int(((1 - p) * start + p * end) // step) * step)

    def set_train_progress(self, progress: float) -> None:
        """Move the scheduled attention window (a device-side fill: no host sync, no recompile)."""
        if self.attn_window is not None:
            self.attn_window.fill_(self.window_at(progress))

    def hidden_matrices(self) -> list[nn.Parameter]:
        """2-D weights inside the blocks: what Muon optimises in the speedrun split."""
        return [p for p in self.blocks.parameters() if p.ndim >= 2]

    # ----------------------------------------------------------------------------------------------
    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]``, or the loss with ``targets``.

        With ``kv_cache`` (a :class:`KVCache`), ``idx`` continues the sequences the cache holds: its tokens
        take the next positions, attend to the cached keys and values, and are appended to the cache.
        """
        cfg = self.config
        if kv_cache is not None and targets is not None:
            raise ValueError("kv_cache is for inference: call the model with targets and no kv_cache to get a loss")
        h = self.hidden_states(idx, kv_cache)
        if targets is None:  # logits for the caller: never FP8 (its gradient scale assumes a mean loss)
            return self._logits(h, fp8=False)[..., : cfg.vocab_size]
        return self.hidden_loss(h, targets)

    def hidden_states(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """The final-norm hidden states ``[B, T, n_embd]`` of ``idx`` (continuing ``kv_cache``'s sequences)."""
        cfg, ex = self.config, self.execution
        b, t = idx.shape
        if t > cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={cfg.block_size}; shorten the input")
        start = 0
        doc_ids = (idx == cfg.eot_token).cumsum(dim=1) if cfg.doc_causal else None
        if kv_cache is not None:
            start = kv_cache.length
            window = self.attn_window if self.attn_window is not None else cfg.window_size
            kv_cache.begin(idx, window, doc_ids)
            doc_ids = None  # the cache's mask holds the documents
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + t, device=idx.device))
        if cfg.embed_norm:
            x = F.rms_norm(x, (x.shape[-1],))
        if ex.dropout:
            x = F.dropout(x, ex.dropout, self.training)
        x0 = x if cfg.x0_mix else None

        ves: list[torch.Tensor | None] = [None] * cfg.n_layer
        for i, emb in enumerate(self.value_embeds):
            ve = emb(idx)
            ves[i] = ve
            ves[cfg.n_layer - len(self.value_embeds) + i] = ve

        half = cfg.n_layer // 2
        skips: list[torch.Tensor] = []
        n_ckpt = ex.checkpointed_blocks(cfg.n_layer) if self.training and torch.is_grad_enabled() else 0
        drop = ex.layer_drop and self.training
        # one host-side draw per pass: which blocks to skip is known before any kernel runs (no device sync)
        draws = torch.rand(cfg.n_layer, generator=self.layer_drop_generator).tolist() if drop else None
        for i, block in enumerate(self.blocks):
            if self.skip_weights is not None and i >= cfg.n_layer - half:
                x = x + self.skip_weights[cfg.n_layer - 1 - i] * skips.pop()
            p_drop = ex.layer_drop_prob(i, cfg.n_layer) if draws is not None else 0.0
            if not (p_drop and draws[i] < p_drop):  # stochastic depth: a skipped block lets x pass through
                if i < n_ckpt:
                    y = checkpoint(block, x, ves[i], doc_ids, x0, self.attn_window, use_reentrant=False)
                else:
                    y = block(x, ves[i], doc_ids, x0, self.attn_window, kv_cache)
                # a block that runs in training adds its change scaled by 1 / (1 - p): the expected stream of eval
                x = x + (y - x) * (1.0 / (1.0 - p_drop)) if p_drop else y
            if self.skip_weights is not None and i < half:
                skips.append(x)
        if kv_cache is not None:
            kv_cache.length += t
        return self.ln_f(x)

    def _head_fp8(self, h: torch.Tensor) -> bool:
        """Whether this training call's head matmul runs in FP8 (see ``GPTExecution.head_fp8``)."""
        ex = self.execution
        return fp8_wanted(ex.head_fp8, h, self.training, ex.fp8_head_applicable(self.config))

    def _logits(self, h: torch.Tensor, fp8: bool) -> torch.Tensor:
        logits = linear_maybe_fp8(self.lm_head, h, fp8, backward_fast_accum=self.execution.fp8_backward_fast_accum)
        cap = self.config.logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def hidden_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of hidden states ``h`` ``[B, T, n_embd]`` (from
        :meth:`hidden_states`) against ``targets`` ``[B, T]`` (``-100`` ignored), through the head and the
        loss of ``execution.loss_impl``."""
        cfg, ex = self.config, self.execution
        if ex.loss_impl == "fused":
            return linear_softcap_cross_entropy(h, self.lm_head.weight, targets, cfg.logit_softcap,
                                                fp8=self._head_fp8(h),
                                                backward_fast_accum=ex.fp8_backward_fast_accum)
        if ex.loss_impl != "torch":
            return linear_cross_entropy(h, self.lm_head.weight, targets, cfg.logit_softcap, ex.loss_chunk_size,
                                        fp8=ex.loss_impl == "chunked_fp8")
        logits = self._logits(h, fp8=self._head_fp8(h))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        greedy: bool = False,
        eos_token: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Continue the token sequences ``idx`` ``[B, T]`` by up to ``max_new_tokens``; returns ``[B, T + n]``.

        The model runs in eval mode (no dropout) and returns to its mode afterwards. With ``use_cache`` the
        prompt is run once into a :class:`KVCache` (``T + max_new_tokens`` positions, at most ``block_size``)
        and each step runs only the newest token. A sequence longer than ``block_size`` is cut to its last
        ``block_size`` tokens, as the model was trained; once the cache is full, each step recomputes that
        window from scratch, exactly as ``use_cache=False`` (the full forward pass every step) does.

        Args:
            idx: prompt token ids (at least one per sequence).
            max_new_tokens: tokens to append.
            temperature, top_k, top_p, greedy, generator: how each token is picked, see :func:`sample_next`.
            eos_token: a sequence that produces it stops (it is padded with ``eos_token`` while others go on);
                generation ends early when every sequence has stopped.
            use_cache: ``False`` recomputes the whole context each step (the reference the cache must match).
        """
        cfg = self.config
        if idx.ndim != 2 or idx.shape[1] == 0:
            raise ValueError(f"generate needs prompt token ids [batch, length >= 1], got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        was_training = self.training
        self.eval()
        try:
            out, cache = idx, None
            done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
            for step in range(max_new_tokens):
                if not use_cache:
                    h = self.hidden_states(out[:, -cfg.block_size :])
                elif cache is not None and cache.length < cache.max_len:
                    h = self.hidden_states(out[:, -1:], cache)
                else:  # the first step, or a full cache: run the last block_size tokens into an empty one
                    context = out[:, -cfg.block_size :]
                    if cache is None:
                        room = min(context.shape[1] + max_new_tokens - step, cfg.block_size)
                        cache = KVCache(self, idx.shape[0], room)
                    cache.reset()
                    h = self.hidden_states(context, cache)
                logits = self._logits(h[:, -1], fp8=False)[:, : cfg.vocab_size]
                nxt = sample_next(logits, temperature, top_k, top_p, greedy, generator)
                if eos_token is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_token), nxt)
                    done = done | (nxt == eos_token)
                out = torch.cat([out, nxt[:, None]], dim=1)
                if eos_token is not None and bool(done.all()):
                    break
        finally:
            self.train(was_training)
        return out

    @classmethod
    def from_hf(cls, model_or_state_dict: Any, config: GPTConfig | None = None,
                execution: GPTExecution | None = None) -> GPT:
        """Build a classic GPT-2 from a ``transformers`` ``GPT2LMHeadModel`` or its state dict.

        HF's ``Conv1D`` stores weights as ``[in, out]``; they are transposed into ``nn.Linear`` layout.

        Args:
            model_or_state_dict: a ``GPT2LMHeadModel`` (any size) or its ``state_dict()``.
            config: required with a bare state dict whose shape cannot be read off the model.
            execution: how the model is computed (:class:`GPTExecution`; defaults when ``None``).
        """
        if isinstance(model_or_state_dict, dict):
            sd = model_or_state_dict
            if config is None:
                config = _config_from_state_dict(sd)
        else:
            hf_cfg = model_or_state_dict.config
            act = getattr(hf_cfg, "activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ValueError(f"HF GPT-2 uses activation {act!r}; only tanh-GELU (gelu_new) maps onto GPT")
            config = config or GPTConfig(
                vocab_size=hf_cfg.vocab_size, n_layer=hf_cfg.n_layer, n_head=hf_cfg.n_head,
                n_embd=hf_cfg.n_embd, block_size=hf_cfg.n_positions, norm_eps=hf_cfg.layer_norm_epsilon,
            )
            sd = model_or_state_dict.state_dict()
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
        if "wte.weight" not in sd:
            raise ValueError("not a GPT-2 state dict: no 'transformer.wte.weight' key")
        model = cls(config, execution)
        ours: dict[str, torch.Tensor] = {
            "wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"],
            "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"],
        }
        for i in range(config.n_layer):
            for name in ("ln_1", "ln_2"):
                for part in ("weight", "bias"):
                    ours[f"blocks.{i}.{name}.{part}"] = sd[f"h.{i}.{name}.{part}"]
            for ours_name, hf_name in (("attn.c_attn", "attn.c_attn"), ("attn.c_proj", "attn.c_proj"),
                                       ("mlp.c_fc", "mlp.c_fc"), ("mlp.c_proj", "mlp.c_proj")):
                ours[f"blocks.{i}.{ours_name}.weight"] = sd[f"h.{i}.{hf_name}.weight"].t()
                ours[f"blocks.{i}.{ours_name}.bias"] = sd[f"h.{i}.{hf_name}.bias"]
        ours["lm_head.weight"] = sd.get("lm_head.weight", sd["wte.weight"])
        expected = model.state_dict()
        for k, v in ours.items():
            if expected[k].shape != v.shape:
                raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}")
        missing, _ = model.load_state_dict(ours, strict=False)
        missing = [k for k in missing if not k.endswith(("rotary.cos", "rotary.sin")) and k != "attn_window"]
        if missing:
            raise ValueError(f"GPT-2 state dict is missing {missing[:5]}")
        return model

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, config: GPTConfig | None = None,
                        execution: GPTExecution | None = None) -> GPT:
        """A classic GPT-2 with Hugging Face GPT-2 weights, for fine-tuning or sampling.

        Args:
            source: a local directory with ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``,
                read with ``torch.load(weights_only=True)``), as ``save_pretrained`` writes it; or a hub id
                (``gpt2``, ``gpt2-medium``, ``openai-community/gpt2-large``, ...), downloaded with
                ``huggingface_hub`` (``pip install 'lightning-opt[hf]'``) into its cache.
            config: the architecture to build: its shape must be the files' and its architecture the classic
                one; ``block_size`` may be below the files' ``n_positions`` (the first positions are kept).
                Default: the classic config of the files' shape.
            execution: how the model is computed and regularised (``dropout``, ``loss_impl``, ...: free, they
                do not change what the weights mean); defaults when ``None``.
        """
        directory, weights_file = _hf_gpt2_files(source)
        hf = json.loads((directory / "config.json").read_text())
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh") or hf.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError(f"{source}: this GPT-2 variant (activation {act!r}, scale_attn_by_inverse_layer_idx="
                             f"{hf.get('scale_attn_by_inverse_layer_idx')}) does not map onto GPT's classic blocks")
        if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
            raise ValueError(f"{source}: MLP width n_inner={hf['n_inner']} is not 4 x n_embd, which GPT's classic MLP has")
        shape = {"vocab_size": hf["vocab_size"], "n_layer": hf["n_layer"], "n_head": hf["n_head"],
                 "n_embd": hf["n_embd"], "norm_eps": hf.get("layer_norm_epsilon", 1e-5)}
        if config is None:
            config = GPTConfig(**shape, block_size=hf["n_positions"])
        wrong = {k: (v, getattr(config, k)) for k, v in shape.items() if getattr(config, k) != v}
        wrong.update({k: (v, getattr(config, k)) for k, v in _HF_GPT2_ARCH.items() if getattr(config, k) != v})
        if config.block_size > hf["n_positions"]:
            wrong["block_size"] = (f"<= {hf['n_positions']}", config.block_size)
        if config.kv_heads != config.n_head:
            wrong["n_kv_head"] = (None, config.n_kv_head)
        if config.padded_vocab_size != config.vocab_size:  # extra head rows would start at logit 0 in the loss
            wrong["vocab_multiple"] = (1, config.vocab_multiple)
        if wrong:
            raise ValueError(
                f"the model config does not match the Hugging Face GPT-2 in {source}: set "
                + ", ".join(f"{k}: {v[0]!r} (not {v[1]!r})" for k, v in wrong.items())
            )
        if weights_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(weights_file))
        else:
            sd = torch.load(weights_file, map_location="cpu", weights_only=True)
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
        if "wpe.weight" in sd:
            sd["wpe.weight"] = sd["wpe.weight"][: config.block_size]
        return cls.from_hf(sd, config, execution)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write the model as a Hugging Face GPT-2: ``config.json`` and ``model.safetensors`` in ``directory``.

        ``transformers.GPT2LMHeadModel.from_pretrained(directory)`` loads it and computes the same logits;
        :meth:`from_pretrained` reads it back. Only the classic architecture (``gpt2/gpt2-124m-classic``) has
        a Hugging Face GPT-2 equivalent; other configs are refused with the fields that differ. From a
        ``lightning-opt-gpt2`` checkpoint::

            python -c "from lightning_opt.modules.gpt2 import GPT2SpeedrunModule as M; M.load_from_checkpoint(
                'last.ckpt', map_location='cpu', weights_only=True).model.save_pretrained('gpt2-hf')"

        Returns:
            ``directory`` as a ``Path``.
        """
        from safetensors.torch import save_file

        cfg = self.config
        wrong = {k: (v, getattr(cfg, k)) for k, v in _HF_GPT2_ARCH.items() if getattr(cfg, k) != v}
        wrong.update({k: (None, getattr(cfg, k)) for k in ("window_size", "window_schedule", "n_kv_head")
                      if getattr(cfg, k) not in (None, cfg.n_head if k == "n_kv_head" else None)})
        if cfg.doc_causal:
            wrong["doc_causal"] = (False, True)
        if wrong:
            raise ValueError(
                "save_pretrained writes a Hugging Face GPT2LMHeadModel, which cannot represent this architecture: "
                + ", ".join(f"{k}={v[1]!r} (GPT-2: {v[0]!r})" for k, v in wrong.items())
                + "; only the classic config (gpt2/gpt2-124m-classic) exports; keep the checkpoint for this model"
            )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        v = cfg.vocab_size  # padded rows (vocab_multiple) never reach the logits
        sd = {"wte.weight": self.wte.weight[:v], "wpe.weight": self.wpe.weight,
              "ln_f.weight": self.ln_f.weight, "ln_f.bias": self.ln_f.bias}
        for i, block in enumerate(self.blocks):
            for name in ("ln_1", "ln_2"):
                sd[f"h.{i}.{name}.weight"] = getattr(block, name).weight
                sd[f"h.{i}.{name}.bias"] = getattr(block, name).bias
            for name, lin in (("attn.c_attn", block.attn.c_attn), ("attn.c_proj", block.attn.c_proj),
                              ("mlp.c_fc", block.mlp.c_fc), ("mlp.c_proj", block.mlp.c_proj)):
                sd[f"h.{i}.{name}.weight"] = lin.weight.t()  # HF's Conv1D stores [in, out]
                sd[f"h.{i}.{name}.bias"] = lin.bias
        # the head is the token embedding (tie_word_embeddings): stored once, as Hugging Face does
        save_file({f"transformer.{k}": t.detach().to("cpu").contiguous() for k, t in sd.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        eot = cfg.eot_token if 0 <= cfg.eot_token < v else None
        dropout = float(self.execution.dropout)
        hf = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": v, "n_positions": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
            "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "bos_token_id": eot, "eos_token_id": eot, "use_cache": True,
        }
        (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        return out


# the GPTConfig values under which GPT computes what Hugging Face's GPT-2 does with the same weights
_HF_GPT2_ARCH: dict[str, Any] = {
    "pos_emb": "learned", "norm": "layernorm", "norm_weight": True, "bias": True, "qk_norm": False, "mlp": "gelu",
    "mlp_ratio": 4.0, "tie_embeddings": True, "n_value_embeds": 0, "unet_skips": False, "x0_mix": False,
    "embed_norm": False, "skip_attn_layers": (), "logit_softcap": None, "attention": "mha",
}


def _hf_gpt2_files(source: str | os.PathLike) -> tuple[Path, Path]:
    """The directory holding ``config.json`` and the weights file of a local or hub Hugging Face GPT-2."""
    names = ("model.safetensors", "pytorch_model.bin")
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"'{path}' has no config.json: pass a directory that save_pretrained wrote")
        for name in names:
            if (path / name).is_file():
                return path, path / name
        raise FileNotFoundError(f"'{path}' has neither {names[0]} nor {names[1]}; a single-file GPT-2 checkpoint is "
                                "needed (merge sharded weights with save_pretrained(max_shard_size='100GB'))")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:
        raise FileNotFoundError(
            f"'{source}' is not a local directory, and hub ids need huggingface_hub: pip install 'lightning-opt[hf]' "
            "(or pass a directory with config.json and model.safetensors)"
        ) from err
    try:
        directory = Path(hf_hub_download(str(source), "config.json")).parent
        try:
            weights = hf_hub_download(str(source), names[0])
        except Exception:  # a repository with only the older format
            weights = hf_hub_download(str(source), names[1])
    except Exception as err:  # network and hub errors come in many types
        raise RuntimeError(
            f"could not download the GPT-2 '{source}' from the Hugging Face hub ({type(err).__name__}: {err}); "
            "check the id and the network, or pass a local directory with config.json and model.safetensors"
        ) from err
    return directory, Path(weights)


def _config_from_state_dict(sd: dict[str, torch.Tensor]) -> GPTConfig:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
    vocab, n_embd = sd["wte.weight"].shape
    n_head = max(1, n_embd // 64)
    return GPTConfig(vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=sd["wpe.weight"].shape[0])
