"""Decode sparse activations without densifying them: ``out[n] = sum_e values[e] * weight[indices[e]]``.

The activations of a row ``n`` are the entries ``offsets[n] : offsets[n + 1]`` of ``indices``/``values``
(CSR, as ``F.embedding_bag`` takes them), or, with ``indices`` and ``values`` of shape ``[N, m]``, the ``m``
entries of that row (entries with value 0 are padding). The work is ``nnz * D`` multiply-adds instead of
``N * F * D`` for a dense ``acts @ weight``.

Backends:

- ``"triton"`` (CUDA default when Triton is installed): a gather-accumulate kernel per (row, column block);
  backward computes ``grad_values`` with a gather-dot kernel and ``grad_weight`` with float32 atomics
  (so ``grad_weight`` is not bitwise deterministic).
- ``"torch"`` (CPU default, and whenever Triton is missing): ``F.embedding_bag(mode="sum",
  per_sample_weights=values)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_opt._optional import is_available

__all__ = ["sparse_decode", "clt_sparse_decode", "layer_segments", "to_csr", "flat_to_csr"]

_BACKENDS = ("auto", "torch", "triton")


def to_csr(acts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, values, offsets)`` of the nonzero entries of a dense ``[N, F]`` activation tensor.

    ``values`` carry gradients to ``acts``. Syncs with the host once (the nonzero count).
    """
    if acts.dim() != 2:
        raise ValueError(f"to_csr expects [tokens, features] activations, got shape {tuple(acts.shape)}")
    flat_idx = torch.nonzero(acts.detach().reshape(-1)).squeeze(1)
    return flat_to_csr(flat_idx, acts.reshape(-1)[flat_idx], acts.shape[0], acts.shape[1])


def flat_to_csr(
    flat_indices: torch.Tensor, values: torch.Tensor, tokens: int, features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR ``(indices, values, offsets)`` from ascending row-major flat indices into ``[tokens, features]``.

    This is the form :func:`lightning_opt.ops.global_topk.batch_topk_threshold_sparse` returns. No host
    sync.
    """
    rows = torch.div(flat_indices, features, rounding_mode="floor")
    offsets = torch.searchsorted(rows, torch.arange(tokens, device=rows.device, dtype=rows.dtype))
    return flat_indices - rows * features, values, offsets


def _normalise(
    indices: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Flatten the padded form to CSR; check shapes. Returns ``(indices, values, offsets, rows)``."""
    if offsets is None:
        if indices.dim() != 2 or values.shape != indices.shape:
            raise ValueError(
                "without offsets, indices and values must both be [tokens, entries_per_token]; got "
                f"{tuple(indices.shape)} and {tuple(values.shape)}. Pass offsets for the flat (CSR) form."
            )
        rows, per_row = indices.shape
        offsets = torch.arange(rows, device=indices.device, dtype=torch.long) * per_row
        return indices.reshape(-1), values.reshape(-1), offsets, rows
    if indices.dim() != 1 or values.shape != indices.shape or offsets.dim() != 1:
        raise ValueError(
            "with offsets, indices and values must be 1-D of equal length and offsets 1-D (one start per "
            f"token); got {tuple(indices.shape)}, {tuple(values.shape)}, {tuple(offsets.shape)}"
        )
    return indices, values, offsets, offsets.numel()


def _torch_decode(
    indices: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    # embedding_bag wants a float dtype shared by weight and per_sample_weights; its CUDA backward for
    # per_sample_weights has no bf16/fp16 kernel, so half-precision inputs run in float32 there.
    if weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
        out = F.embedding_bag(indices, weight.float(), offsets.to(indices.dtype), mode="sum",
                              per_sample_weights=values.float())
        return out.to(weight.dtype)
    return F.embedding_bag(
        indices, weight, offsets.to(indices.dtype), mode="sum", per_sample_weights=values.to(weight.dtype)
    )


def sparse_decode(
    indices: torch.Tensor,
    values: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sum of decoder rows weighted by sparse activation values, per token.

    Args:
        indices: feature ids, ``[N, m]`` (padded form) or ``[nnz]`` with ``offsets`` (CSR form).
        values: activation values, same shape as ``indices``.
        weight: decoder ``[features, D]``.
        offsets: ``[N]`` start of each token's entries in the CSR form (ascending).
        bias: optional ``[D]`` added to every row.
        backend: ``"auto"`` (Triton on CUDA when installed, else torch), ``"torch"`` or ``"triton"``.

    Returns:
        ``[N, D]`` in ``weight``'s dtype.

    Example:
        >>> w = torch.eye(4)
        >>> sparse_decode(torch.tensor([[1, 3]]), torch.tensor([[2.0, 0.5]]), w)
        tensor([[0.0000, 2.0000, 0.0000, 0.5000]])
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [features, D], got shape {tuple(weight.shape)}")
    indices, values, offsets, rows = _normalise(indices, values, offsets)
    out = _decode_csr(indices, values, weight, offsets, backend)
    return out if bias is None else out + bias


def _decode_csr(indices: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                backend: str, ends: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The CSR decode on the chosen backend. ``ends`` / ``rows`` (Triton only): each token's end and each
    entry's token, when the caller has them (else derived)."""
    if backend == "auto":
        backend = (
            "triton"
            if weight.is_cuda and is_available("triton") and _triton_works(weight.device)
            else "torch"
        )
    if backend == "triton":
        return _TritonDecode.apply(indices, values, offsets, weight, ends, rows)
    return _torch_decode(indices, values, offsets, weight)


def layer_segments(indices: torch.Tensor, n_layers: int, n_tokens: int, features: int,
                   bounds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Per-source-layer CSR views of ascending flat indices into a layer-major ``[L, N, F]`` tensor, computed
    once for all layers (a handful of launches instead of a handful per layer).

    Returns ``(feature, token, row_ptr, bounds)``: every entry's feature id and token, the CSR start of every
    ``(layer, token)`` row (``L * N + 1`` entries) and the layer boundaries as a host list (one host sync,
    unless the caller passes ``bounds``: then they are trusted). Layer ``l``'s entries are
    ``bounds[l]:bounds[l + 1]``; its token offsets are ``row_ptr[l * N : (l + 1) * N + 1] - bounds[l]``.
    """
    row = torch.div(indices, features, rounding_mode="floor")  # layer * N + token
    feature = indices - row * features
    token = torch.remainder(row, n_tokens)
    row_ptr = torch.searchsorted(row, torch.arange(n_layers * n_tokens + 1, device=row.device, dtype=row.dtype))
    return feature, token, row_ptr, bounds if bounds is not None else row_ptr[::n_tokens].tolist()


def clt_sparse_decode(
    indices: torch.Tensor,
    values: torch.Tensor,
    W_dec: Sequence[torch.Tensor],
    n_tokens: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode a cross-layer transcoder's sparse activations to every target layer, without bias.

    Args:
        indices: ascending flat indices into the layer-major ``[L, N, F]`` activation tensor.
        values: the activations at ``indices`` (differentiable).
        W_dec: per source layer ``l`` a decoder ``[F, L - l, d_out]`` (targets ``l .. L-1``).
        n_tokens: ``N``.
        backend: as in :func:`sparse_decode`.

    Returns:
        ``[N, L, d_out]`` in the decoders' dtype: ``out[n, j] = sum_{l <= j} sum_f a[l, n, f] W_dec[l][f, j - l]``.
    """
    n_layers = len(W_dec)
    if n_layers == 0:
        raise ValueError("W_dec is empty: a CLT needs at least one source layer")
    features, _, d_out = W_dec[0].shape
    for layer, w in enumerate(W_dec):
        if w.shape != (features, n_layers - layer, d_out):
            raise ValueError(
                f"W_dec[{layer}] has shape {tuple(w.shape)}, expected {(features, n_layers - layer, d_out)}"
            )
    feature, token, row_ptr, bounds = layer_segments(indices, n_layers, n_tokens, features)  # one host sync
    out = torch.zeros(n_tokens, n_layers, d_out, dtype=W_dec[0].dtype, device=W_dec[0].device)
    for layer, w in enumerate(W_dec):
        lo, hi = bounds[layer], bounds[layer + 1]
        seg = row_ptr[layer * n_tokens : (layer + 1) * n_tokens + 1] - lo
        dec = _decode_csr(feature[lo:hi], values[lo:hi], w.reshape(features, -1), seg[:-1], backend,
                          ends=seg[1:], rows=token[lo:hi])
        out[:, layer:] += dec.view(n_tokens, n_layers - layer, d_out)
    return out


_TRITON_CHECKED: dict[torch.device, bool] = {}


def _agrees_with_torch(fn: Callable[..., torch.Tensor], device: torch.device) -> bool:
    """Whether ``fn`` (a decode like ``_torch_decode``) matches ``_torch_decode`` in output and both gradients
    on a tiny problem. Raises if ``fn`` fails.

    Runs with autograd on even when called from a backward pass, ``no_grad`` or ``inference_mode`` (a first
    decode in a validation loop): without that the check itself would fail and be cached as "unusable".
    """
    with torch.inference_mode(False), torch.enable_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(16, 40, generator=gen).to(device).requires_grad_(True)
        v = torch.rand(3, 4, generator=gen).to(device).requires_grad_(True)
        idx = torch.randint(0, 16, (3, 4), generator=gen).to(device)
        flat_idx, flat_v, offsets, _ = _normalise(idx, v, None)
        outs = []
        for impl in (fn, _torch_decode):
            out = impl(flat_idx, flat_v, offsets, w)
            grads = torch.autograd.grad(out.square().sum(), [v, w])
            outs.append([out, *grads])
        return all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(*outs))


def _triton_works(device: torch.device) -> bool:
    """Compile and check the three kernels once per device on a tiny problem; fall back to torch if not.

    A Triton/driver mismatch then costs a warning instead of a crash in the middle of training.
    """
    if device not in _TRITON_CHECKED:
        try:
            ok = _agrees_with_torch(_TritonDecode.apply, device)
            if not ok:
                raise RuntimeError("Triton sparse decode disagrees with embedding_bag on a check problem")
        except Exception as err:  # any failure means: use the torch path
            import warnings

            warnings.warn(
                f"sparse_decode: Triton kernels unusable ({err}); using F.embedding_bag", stacklevel=3
            )
            ok = False
        _TRITON_CHECKED[device] = ok
    return _TRITON_CHECKED[device]


class _TritonDecode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, indices: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
        ends: torch.Tensor | None = None, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``ends`` (each token's end) and ``rows`` (each entry's token) are derived when not given; a caller
        that decodes many segments of one index array (the CLT's source layers) passes views of tensors it
        computed once for all segments, which saves launches per segment."""
        import lightning_opt.ops._sparse_decode_triton as kernels

        indices = indices.contiguous()
        values = values.contiguous()
        weight = weight.contiguous()
        if ends is None:
            ends = torch.cat([offsets[1:], offsets.new_full((1,), indices.numel())])
        ends = ends.contiguous()
        ctx.save_for_backward(indices, values, offsets, ends, weight, rows)
        return kernels.forward(indices, values, offsets.contiguous(), ends, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        import lightning_opt.ops._sparse_decode_triton as kernels

        indices, values, offsets, ends, weight, rows = ctx.saved_tensors
        if rows is None:  # the token of each entry; output_size avoids a host sync
            rows = torch.repeat_interleave(
                torch.arange(offsets.numel(), device=offsets.device), ends - offsets, output_size=indices.numel()
            )
        grad_out = grad_out.contiguous()
        grad_values = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_values = kernels.grad_values(indices, rows.contiguous(), grad_out, weight).to(values.dtype)
        if ctx.needs_input_grad[3]:
            grad_weight = kernels.grad_weight(indices, rows.contiguous(), values, grad_out, weight.shape).to(weight.dtype)
        return None, grad_values, None, grad_weight, None, None
