"""FP8 linear layer (``torch._scaled_mm``) with static per-tensor scales, for H100-class GPUs.

Forward: ``x`` and ``w`` are cast to ``float8_e4m3fn`` after dividing by fixed scales, multiplied with
FP32 accumulation and returned in bfloat16. Backward: the output gradient is cast to ``float8_e5m2``
(more range, less precision: gradients need range) and both input gradients are FP8 matmuls too.

Static scales cost nothing at run time (no amax reduction, no host sync) but must bound the values:
``e4m3fn`` holds magnitudes up to 448 and has no infinity, so a value above ``448 * scale`` would turn
into NaN; the casts clamp first, so such a value saturates instead (a scale that is too small costs accuracy,
never a broken run). The defaults fit the output head of a pre-norm transformer: the head's input is RMS-normalised,
so no entry exceeds ``sqrt(width)`` (``x_scale = sqrt(width) / 448`` cannot overflow); head weights stay
far below 24 (``w_scale = 24 / 448``). The output gradient's scale must follow the loss's reduction:
the gradient of a cross-entropy *summed* over tokens is below 1 per logit (``grad_scale = 1 / 448``,
the default), of a *mean* over N tokens below 1/N (pass ``grad_scale = 1 / (448 N)``): with too large a
scale the small gradients underflow ``e5m2`` (smallest subnormal 2^-16) and training degrades.

The function is an ``autograd.Function`` made of plain aten ops, so ``torch.compile`` traces through it
and fuses the casts into the neighbouring kernels.
"""

from __future__ import annotations

import math

import torch

from lightning_opt._internals import scaled_mm

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2


def fp8_supported(device: torch.device | str) -> bool:
    """True where ``torch._scaled_mm`` runs: CUDA devices of compute capability 8.9+ (Ada, Hopper, ...), or CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def _scale(like: torch.Tensor, value: float) -> torch.Tensor:
    # a device-side fill, not a host-to-device copy of a Python number (that would synchronise)
    return torch.full((), value, dtype=torch.float32, device=like.device)


HEAD_W_SCALE = 24.0 / 448.0  # default weight scale: weights up to 24 in magnitude stay representable


def to_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # saturate: e4m3fn has no infinity, an out-of-range cast would be NaN
    return (t / scale).clamp(-448.0, 448.0).to(_E4M3)


def norm_input_scale(width: int) -> float:
    """e4m3 scale of a normalised input (RMS 1, unit gain): no entry of such a row exceeds ``sqrt(width)``."""
    return math.sqrt(width) / 448.0


def mean_loss_grad_scale(rows: int) -> float:
    """e5m2 scale for the output gradient of a matmul feeding a loss averaged over ``rows`` tokens: its
    entries are then of order ``1 / rows``; a larger scale would let most of them underflow to zero."""
    return 1.0 / (448.0 * rows)


def _device_has_fp8(x: torch.Tensor) -> bool:
    return x.is_cuda and fp8_supported(x.device)


def fp8_wanted(mode: bool | str, x: torch.Tensor, training: bool, applicable: bool = True,
               compiled_only: bool = False) -> bool:
    """Whether a training matmul on ``x`` runs in FP8 under a model option ``mode``: ``True`` insists
    (``torch._scaled_mm`` then raises where it cannot run), ``"auto"`` only where the GPU has FP8 and
    ``applicable`` says the model allows it - and, with ``compiled_only``, only inside ``torch.compile``
    (eager, the casts and transposed copies around a small matmul are kernels of their own and cost more than
    FP8 saves; docs/gpt2.md has the measurement). Never in evaluation or with a row count off 16."""
    if not mode or not training or math.prod(x.shape[:-1]) % 16:
        return False
    if mode is True:
        return True
    if compiled_only and not torch.compiler.is_compiling():
        return False
    return applicable and _device_has_fp8(x)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, x_scale, w_scale, grad_scale, backward_fast_accum):  # type: ignore[override]
        xs, ws = _scale(x, x_scale), _scale(x, w_scale)
        x8, w8 = to_e4m3(x, xs), to_e4m3(w, ws)
        # _scaled_mm: first operand row-major, second column-major (w8.t() of a row-major w8 is)
        out = scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=True)
        ctx.save_for_backward(x8, w8)
        ctx.scales = (x_scale, w_scale, grad_scale)
        ctx.backward_fast_accum = backward_fast_accum
        ctx.w_dtype = w.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x8, w8 = ctx.saved_tensors
        x_scale, w_scale, grad_scale = ctx.scales
        xs, ws, gs = _scale(x8, x_scale), _scale(x8, w_scale), _scale(x8, grad_scale)
        g8 = (grad_out / gs).clamp(-57344.0, 57344.0).to(_E5M2)
        # grad_x [N, K] = g [N, M] @ w [M, K]; w8 must be column-major as the second operand
        fast = ctx.backward_fast_accum
        grad_x = scaled_mm(g8, w8.t().contiguous().t(), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16,
                           use_fast_accum=fast)
        # grad_w^T [K, M] = x^T [K, N] @ g [N, M], returned as a transposed view (the faster of the two layouts,
        # docs/gpt2.md).
        grad_wt = scaled_mm(x8.t().contiguous(), g8.t().contiguous().t(), scale_a=xs, scale_b=gs,
                            out_dtype=torch.float32, use_fast_accum=fast)
        return grad_x, grad_wt.t().to(ctx.w_dtype), None, None, None, None


def check_fp8_shapes(rows: int, k: int, out: int, device: torch.device) -> None:
    """Raise a clear error where ``torch._scaled_mm`` cannot take a ``[rows, k] x [k, out]`` product."""
    if k % 16 or out % 16 or rows % 16:
        raise ValueError(
            f"FP8 matmul: torch._scaled_mm needs rows ({rows}), in ({k}) and out ({out}) to be "
            "multiples of 16; pad the vocabulary (GPTConfig.vocab_multiple) or change the batch shape."
        )
    if not fp8_supported(device):
        raise RuntimeError(
            f"FP8 matmul: FP8 matmuls need a GPU of compute capability 8.9 or newer (H100, L40S, RTX 4090); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}. "
            "Turn the FP8 option off (e.g. GPTExecution.head_fp8=False) or use head_fp8='auto'."
        )


def fp8_matmul_t(x: torch.Tensor, w: torch.Tensor, x_scale: float | torch.Tensor | None = None,
                 w_scale: float | torch.Tensor = HEAD_W_SCALE, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ w.T`` for ``x [N, K]`` and ``w [M, K]`` through FP8 (``e4m3``) with static scales, no autograd.

    Values beyond ``448 * scale`` saturate to the largest FP8 number instead of becoming NaN (``e4m3fn`` has
    no infinity), so a scale that is too small costs accuracy, not a broken run. ``x_scale`` defaults to
    ``sqrt(K) / 448``, the bound of an RMS-normalised row with unit gain. ``w`` may already be ``e4m3``
    (cast by :func:`to_e4m3` with ``w_scale``, a tensor then), to be reused by the caller; so may ``x`` (with
    ``x_scale`` the tensor it was cast with).
    """
    k = x.shape[-1]
    if isinstance(x_scale, torch.Tensor):
        xs = x_scale
    else:
        xs = _scale(x, norm_input_scale(k) if x_scale is None else x_scale)
    if x.dtype == _E4M3 and not isinstance(x_scale, torch.Tensor):
        raise ValueError("fp8_matmul_t: an e4m3 x needs the scale tensor it was cast with (x_scale)")
    ws = w_scale if isinstance(w_scale, torch.Tensor) else _scale(x, w_scale)
    x8 = x if x.dtype == _E4M3 else to_e4m3(x, xs)
    w8 = w if w.dtype == _E4M3 else to_e4m3(w, ws)
    return scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype, use_fast_accum=True)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_scale: float | None = None,
    w_scale: float = HEAD_W_SCALE,
    grad_scale: float = 1.0 / 448.0,
    *,
    backward_fast_accum: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` in FP8 with static scales; returns bfloat16 of shape ``[*x.shape[:-1], out]``.

    Args:
        x: ``[..., in]`` activations (any float dtype); ``prod(x.shape[:-1])`` and ``in`` must be
            multiples of 16, as must ``out`` (``torch._scaled_mm``'s constraint).
        weight: ``[out, in]`` weight (an ``nn.Linear``'s).
        x_scale: FP8 scale of ``x``; default ``sqrt(in) / 448`` (exact bound for RMS-normalised inputs).
        w_scale: FP8 scale of the weight (values up to ``448 * w_scale`` are representable).
        grad_scale: FP8 scale of the output gradient (see the module docstring: ``1 / (448 N)`` for a
            mean loss over N rows).
        backward_fast_accum: ``torch._scaled_mm``'s ``use_fast_accum`` for the two backward matmuls. Hopper's
            FP8 tensor cores accumulate in reduced precision unless partial sums are promoted to float32 at
            intervals; fast accumulation skips the promotion (docs/gpt2.md gives its measured effect). The forward
            matmul always accumulates fast.
    """
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8_linear: weight must be [out, {k}], got {tuple(weight.shape)}")
    rows = math.prod(x.shape[:-1])
    check_fp8_shapes(rows, k, weight.shape[0], x.device)
    scale_x = norm_input_scale(k) if x_scale is None else x_scale
    out = _FP8Linear.apply(x.reshape(rows, k), weight, scale_x, w_scale, grad_scale, backward_fast_accum)
    return out.reshape(*x.shape[:-1], weight.shape[0])
