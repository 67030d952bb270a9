"""Output head + soft-capped cross-entropy with the loss and the logit gradient from one Triton kernel.

``linear_softcap_cross_entropy(h, W, y, cap)`` equals ``F.cross_entropy(cap * tanh((h @ W.T) / cap), y)``
(mean over the targets that are not ``ignore_index``). What torch.compile makes of that expression is two
reductions over the ``[tokens, vocab]`` logits, one in the forward pass and one in the backward pass, each
evaluating ``tanh`` and ``exp`` for every logit. Here one kernel (one program per token) reads a row of
logits twice: the first sweep sums ``exp`` for the log-sum-exp, the second writes the row's gradient
``(softmax - onehot) * (1 - tanh^2)`` over the logits it read, in place, in bfloat16. The row is still in
L2 for the second sweep. The backward pass is then the two head matmuls, with the ``grad_output / count``
factor applied to their small outputs instead of the big gradient.

The kernel is bound by its special-function instructions (``exp``, ``tanh``, reciprocals), so it spends few:
with a cap up to ``FIXED_MAX_CAP`` no capped logit exceeds the cap, which then serves as the row maximum (one
``exp`` per logit in the first sweep, no running maximum); without a cap, ``online_max="block"`` keeps one
running maximum per row, updated from each block's maximum (one ``exp`` per logit in the first sweep instead of
the two of a running maximum per lane, ``"lane"``, for a reduction across the program's lanes per block); and
the training sweep takes ``tanh`` from the GPU's ``tanh.approx.f32``: its relative error (about 2^-11) keeps a
capped logit within about 1e-2 at cap 15, below the bfloat16 rounding of a logit that size, while the cap's
derivative ``1 - tanh^2`` is off by up to about 1e-3 absolute - a few percent of it only for logits beyond twice
the cap, where the gradient through the cap is small anyway. Evaluation (no gradient) keeps the exact formula.
With ``fp8=True`` the logits come from an FP8 matmul, and so do the head's input and weight gradients: the
kernel then writes the gradient as an e5m2 copy (times ``G8_MULT``) instead of over the logits, and a tiled
Triton copy transposes it for the weight gradient (measured effect: docs/gpt2.md).

The kernel runs on CUDA (or anywhere under ``TRITON_INTERPRET=1``); elsewhere the same function computes
the same thing with torch ops. The call is kept out of ``torch.compile`` graphs (a graph break at the
loss): the compiled model produces the final hidden states, this function does the rest eagerly.
"""

from __future__ import annotations

import math

import torch

from lightning_opt._internals import scaled_mm
from lightning_opt._optional import triton_runs_on
from lightning_opt.ops import fp8 as _fp8
from lightning_opt.ops.fp8 import HEAD_W_SCALE, check_fp8_shapes, fp8_matmul_t, norm_input_scale, to_e4m3

try:  # optional dependency (the CUDA wheels of torch ship it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# default launch shape (softcap_ce_rows_'s ``block_v`` / ``num_warps`` / ``tile_m`` / ``tile_v`` arguments):
# vocabulary entries per sweep step of the loss kernel, warps per program
BLOCK_V = 4096
NUM_WARPS = 8
# the transposing copy's tile: rows x vocabulary columns per step
TILE_M = 32
TILE_V = 256
# the running maximum of the log-sum-exp without a fixed one (no cap, or a cap above FIXED_MAX_CAP),
# softcap_ce_rows_'s ``online_max``: "lane" (one per lane, two exps per logit) or "block" (one per row, taken
# block by block: one exp per logit and a reduction across the lanes per block). "block" is the default, the
# faster of the two (docs/gpt2.md links the kernel's measurements)
ONLINE_MAX = "block"
ONLINE_MAX_CHOICES = ("lane", "block")


def kernel_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on ``x``'s device."""
    return triton is not None and triton_runs_on(x)


if triton is not None:

    @triton.jit
    def _capped(x, cap, FAST_TANH: tl.constexpr):
        # cap * tanh(x / cap) and tanh(x / cap). FAST_TANH: the GPU's one-instruction tanh (relative error
        # about 2^-11; see the module docstring for what that means for the loss and its gradient); else
        # tanh(u) = 1 - 2 / (exp(2u) + 1), which has the exact limits +-1 for large |u|
        if FAST_TANH:
            th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x / cap], dtype=tl.float32,
                                           is_pure=True, pack=1)
        else:
            th = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
        return cap * th, th

    @triton.jit
    def _softcap_ce_kernel(logits_ptr, targets_ptr, loss_ptr, g8_ptr, V, stride, cap, ignore_index, g8_mult,
                           HAS_CAP: tl.constexpr, FIXED_MAX: tl.constexpr, FAST_TANH: tl.constexpr,
                           WRITE_GRAD: tl.constexpr, WRITE_G8: tl.constexpr, WRITE_DENSE: tl.constexpr,
                           BLOCK_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(targets_ptr + row)
        offs = tl.arange(0, BLOCK)
        # sweep 1: the log-sum-exp of the capped logits. With FIXED_MAX (a cap small enough that
        # exp(-2 cap) stays a normal float) no logit exceeds `cap`, so `cap` serves as the maximum: one exp
        # per logit and no rescaling. Otherwise a running maximum: with BLOCK_MAX one for the whole row, taken
        # over each block of logits (a reduction across the program's lanes per block, one scalar exp to rescale
        # the per-lane sums, one exp per logit); else one per lane (two exps per logit, no reduction per
        # block), combined at the end.
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        if BLOCK_MAX:
            m_row = tl.max(m, axis=0)  # the running maximum of the row: a scalar
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            if HAS_CAP:
                z, _ = _capped(x, cap, FAST_TANH)
            else:
                z = x
            z = tl.where(cols < V, z, float("-inf"))
            if FIXED_MAX:
                s += tl.exp(z - cap)
            elif BLOCK_MAX:
                m_new = tl.maximum(m_row, tl.max(z, axis=0))
                # while every logit so far is -inf (masked lanes; -inf logits) the sums stay 0: subtract 0, not
                # -inf, so that no exp sees -inf - -inf
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                s = s * tl.exp(m_row - m_ref) + tl.exp(z - m_ref)
                m_row = m_new
            else:
                m_new = tl.maximum(m, z)
                s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
                s = tl.where(m_new == float("-inf"), 0.0, s)
                m = m_new
        if FIXED_MAX:
            lse = cap + tl.log(tl.sum(s, axis=0))
        elif BLOCK_MAX:
            lse = m_row + tl.log(tl.sum(s, axis=0))
        else:
            m_all = tl.max(m, axis=0)
            s_all = tl.sum(s * tl.exp(m - m_all), axis=0)
            lse = m_all + tl.log(s_all)
        valid = target != ignore_index
        in_range = (target >= 0) & (target < V)
        t = tl.where(valid & in_range, target, 0)  # never read outside the row
        xt = tl.load(base + t).to(tl.float32)
        if HAS_CAP:
            zt, _ = _capped(xt, cap, FAST_TANH)
        else:
            zt = xt
        # a target outside [0, V) that is not ignore_index gives NaN (visible, no sync), not a wrong number
        loss = tl.where(valid, tl.where(in_range, lse - zt, float("nan")), 0.0)
        tl.store(loss_ptr + row, loss)
        # sweep 2: the gradient of this row's loss w.r.t. the raw logits, written over them
        if WRITE_GRAD:
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
                if HAS_CAP:
                    z, th = _capped(x, cap, FAST_TANH)
                    dz = 1.0 - th * th
                else:
                    z = x
                    dz = 1.0
                p = tl.exp(z - lse)
                g = (p - tl.where(cols == t, 1.0, 0.0)) * dz
                g = tl.where(valid, tl.where(in_range, g, float("nan")), 0.0)
                if WRITE_DENSE:
                    tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)
                if WRITE_G8:  # the same gradient, scaled, as float8 e5m2 (for the FP8 input-gradient matmul)
                    tl.store(g8_ptr + row * V + cols, (g * g8_mult).to(g8_ptr.dtype.element_ty), mask=cols < V)


    @triton.jit
    def _transpose_bytes_kernel(src_ptr, dst_ptr, N, V, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
        # dst [V, N] = src [N, V]^T for one-byte elements: BLOCK_M rows per program, so each column's BLOCK_M
        # bytes are written together (a plain strided copy writes them one byte at a time)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < N
        offs = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            cols = start + offs
            mask = rmask[:, None] & (cols[None, :] < V)
            x = tl.load(src_ptr + rows[:, None] * V + cols[None, :], mask=mask)
            # int64: V * N exceeds 2^31 at speedrun sizes (50304 x 65536)
            tl.store(dst_ptr + cols.to(tl.int64)[None, :] * N + rows[:, None], x, mask=mask)


def fast_tanh_available(x: torch.Tensor) -> bool:
    """Whether the training sweep on ``x`` may use the approximate tanh instruction (PTX ``tanh.approx.f32``,
    NVIDIA GPUs of compute capability 7.5+): not in Triton's interpreter (decided when the kernel was
    defined, ``TRITON_INTERPRET``), which cannot run inline PTX, nor on ROCm. Evaluation (no gradient)
    always takes the exact formula, so reported validation losses do not depend on it."""
    if triton is None or not x.is_cuda or torch.version.hip is not None:
        return False
    if type(_softcap_ce_kernel).__name__ == "InterpretedFunction":
        return False
    return torch.cuda.get_device_capability(x.device) >= (7, 5)


# a cap up to this uses itself as the row maximum: exp(z - cap) >= exp(-2 * cap) stays a normal float32
# (about 9e-27 for 30), so the sum keeps its precision even when every logit sits at -cap
FIXED_MAX_CAP = 30.0


# the FP8 copy of the logit gradient holds ``g * G8_MULT`` in float8 e5m2: |g| <= 1 (a softmax minus a one-hot,
# times the cap's derivative), so the largest entry stays below e5m2's 57344 and entries down to 2^-30 (the
# smallest subnormal, 2^-16, divided by 2^14) keep a value instead of flushing to zero
G8_MULT = 2.0**14


def softcap_ce_rows_(logits: torch.Tensor, targets: torch.Tensor, cap: float | None,
                     ignore_index: int = -100, write_grad: bool = True,
                     g8: torch.Tensor | None = None, g8t: torch.Tensor | None = None, *,
                     block_v: int = BLOCK_V, num_warps: int = NUM_WARPS, tile_m: int = TILE_M,
                     tile_v: int = TILE_V, online_max: str = ONLINE_MAX) -> torch.Tensor:
    """Per-row losses; with ``write_grad`` overwrites ``logits`` ``[N, V]`` with the per-row gradient (not
    divided by a count), and, given ``g8`` (a contiguous ``[N, V]`` ``float8_e5m2`` tensor), also writes that
    gradient times ``G8_MULT`` into it. Given ``g8t`` too (contiguous ``[V, N]`` ``float8_e5m2``), the scaled
    gradient is also written transposed there, and *instead of* the dense gradient: ``logits`` keep their
    values. A target outside ``[0, V)`` other than ``ignore_index`` gives a NaN
    loss (and NaN gradient row) rather than an error: checking on the host would synchronise.

    The kernels' launch shape (powers of two; the result does not depend on them): ``block_v`` vocabulary
    entries per sweep step and ``num_warps`` warps per program; the transposing copy's tiles of ``tile_m``
    rows x ``tile_v`` columns. ``online_max``: how the log-sum-exp keeps its running maximum when the cap
    cannot serve as the row maximum (no cap, or one above ``FIXED_MAX_CAP``): ``"lane"``, per lane (two exps
    per logit) or ``"block"``, per row, updated from each block's maximum (one exp per logit, a reduction
    across the program's lanes per block); the result is the same up to float32 rounding."""
    if online_max not in ONLINE_MAX_CHOICES:
        raise ValueError(f"softcap_ce_rows_: online_max={online_max!r}, expected one of {ONLINE_MAX_CHOICES}")
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("softcap_ce_rows_: logits must be contiguous along the vocabulary")
    if g8 is not None and (not write_grad or g8.shape != logits.shape or not g8.is_contiguous()
                           or g8.dtype != torch.float8_e5m2):
        raise ValueError("softcap_ce_rows_: g8 must be a contiguous float8_e5m2 tensor shaped like the logits, "
                         "and needs write_grad=True")
    if g8t is not None and (g8 is None or g8t.shape != (v, n) or not g8t.is_contiguous()
                            or g8t.dtype != torch.float8_e5m2):
        raise ValueError(f"softcap_ce_rows_: g8t must be a contiguous float8_e5m2 tensor of shape [V, N] = "
                         f"[{v}, {n}], passed with g8")
    targets = targets.contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    fixed_max = cap is not None and cap <= FIXED_MAX_CAP
    if kernel_available(logits):
        _softcap_ce_kernel[(n,)](logits, targets, loss, loss if g8 is None else g8, v, logits.stride(0),
                                 float(cap or 1.0), ignore_index, G8_MULT,
                                 HAS_CAP=cap is not None, FIXED_MAX=fixed_max,
                                 FAST_TANH=write_grad and fast_tanh_available(logits), WRITE_GRAD=write_grad,
                                 WRITE_G8=g8 is not None, WRITE_DENSE=g8t is None,
                                 BLOCK_MAX=online_max == "block" and not fixed_max, BLOCK=block_v,
                                 num_warps=num_warps)
        if g8t is not None:
            _transpose_bytes_kernel[(triton.cdiv(n, tile_m),)](g8.view(torch.uint8), g8t.view(torch.uint8), n, v,
                                                                BLOCK_M=tile_m, BLOCK=tile_v, num_warps=num_warps)
        return loss
    # torch reference of the same computation (CPU, or no Triton)
    x = logits.float()
    z = cap * torch.tanh(x / cap) if cap is not None else x
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    in_range = (targets >= 0) & (targets < v)
    t = torch.where(valid & in_range, targets, torch.zeros_like(targets))
    nan = torch.full_like(lse, float("nan"))
    loss = torch.where(valid, torch.where(in_range, lse - z.gather(1, t[:, None]).squeeze(1), nan),
                       torch.zeros_like(lse))
    if not write_grad:
        return loss
    g = torch.exp(z - lse[:, None])
    g[torch.arange(n, device=logits.device), t] -= 1.0
    if cap is not None:
        g = g * (1.0 - (z / cap) ** 2)
    g = torch.where((valid & ~in_range)[:, None], float("nan"), g)
    g = torch.where(valid[:, None], g, 0.0)
    if g8t is None:
        logits.copy_(g)
    if g8 is not None:
        g8.copy_((g * G8_MULT).to(torch.float8_e5m2))
    if g8t is not None:
        g8t.copy_(g8.t())
    return loss


def _times(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x.float() * scale`` (``scale`` a 0-dim float32 tensor) in one pass over ``x``: the same numbers.

    A 0-dim tensor does not take part in type promotion (``bf16 * scale`` would round the products to
    bfloat16); as a 1-element tensor it does, so the product is float32 and each element is cast exactly
    on load and multiplied once, without a float32 copy of ``x`` in between. Other dtypes take the plain
    expression (one pass already for float32).
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.mul(x, scale.reshape(1))
    return x.float() * scale


class _LinearSoftcapCE(torch.autograd.Function):
    # With fp8, both head gradients come from FP8 operands: grad_h = g @ W from the kernel's e5m2 copy of g and
    # W's e4m3 copy; grad_w = g^T h from the e5m2 copy transposed by a tiled Triton copy (_scaled_mm contracts
    # along contiguous rows; the tiled copy avoids torch's strided .t().contiguous() of the [N, V] copy) and
    # the forward's e4m3 copy of h. The kernel then writes no gradient in the compute dtype,
    # and the logits buffer is freed after the forward.
    @staticmethod
    def forward(ctx, h, weight, targets, cap, ignore_index, need_grad, fp8, backward_fast_accum):  # type: ignore[override]
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        g8 = w8t = h8 = g8t = None
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), weight.to(dtype)
            if fp8:
                w_scale = _fp8._scale(h, HEAD_W_SCALE)
                w8 = to_e4m3(wc, w_scale)
                h_scale = _fp8._scale(h, norm_input_scale(h.shape[-1]))
                h8 = to_e4m3(hc, h_scale)
                logits = fp8_matmul_t(h8, w8, x_scale=h_scale, w_scale=w_scale, out_dtype=dtype)
                if need_grad:  # the gradient matmuls in FP8 too: the kernel writes the gradient as e5m2
                    g8 = torch.empty(logits.shape, dtype=torch.float8_e5m2, device=h.device)
                    w8t = w8.t().contiguous()  # [d, V]: the column-major second operand _scaled_mm needs
                    # and transposed, for the weight gradient's; no dense gradient then
                    g8t = torch.empty(logits.shape[::-1], dtype=torch.float8_e5m2, device=h.device)
            else:
                logits = hc @ wc.t()  # [N, V] in the compute dtype; becomes the gradient below
            rows = softcap_ce_rows_(logits, targets, cap, ignore_index, write_grad=need_grad, g8=g8, g8t=g8t)
            count = (targets != ignore_index).sum().clamp(min=1).to(torch.float32)  # a tensor: no sync
            loss = rows.sum() / count
        if g8 is None:
            ctx.save_for_backward(hc, wc, logits, count, None, None, None, None)
        else:  # the gradients come from the FP8 copies: neither the dense gradient nor hc is kept
            ctx.save_for_backward(None, None, None, count, g8, w8t, h8, g8t)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.compute_dtype = dtype
        ctx.backward_fast_accum = backward_fast_accum
        return loss

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hc, wc, grad_logits, count, g8, w8t, h8, g8t = ctx.saved_tensors
        scale = grad_out.float() / count
        dtype = ctx.compute_dtype
        with torch.autocast(grad_out.device.type, enabled=False):
            if g8 is not None:  # from the FP8 copies (the scales undo G8_MULT, W's and h's)
                fast = ctx.backward_fast_accum
                gs, ws = _fp8._scale(g8, 1.0 / G8_MULT), _fp8._scale(g8, HEAD_W_SCALE)
                hs = _fp8._scale(g8, norm_input_scale(h8.shape[-1]))
                # grad_h = g [N, V] @ W [V, d]
                grad_h = _times(scaled_mm(g8, w8t.t(), scale_a=gs, scale_b=ws, out_dtype=dtype,
                                          use_fast_accum=fast), scale)
                # grad_w [V, d] = g^T [V, N] @ h [N, d], contracted along the N tokens
                grad_w = scaled_mm(g8t, h8.t().contiguous().t(), scale_a=gs, scale_b=hs,
                                   out_dtype=torch.float32, use_fast_accum=fast) * scale
            else:
                grad_h = _times(grad_logits @ wc, scale)
                grad_w = _times(grad_logits.t() @ hc, scale)
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None, None, None, None


@torch.compiler.disable
def linear_softcap_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 softcap: float | None = None, ignore_index: int = -100,
                                 fp8: bool = False, *, backward_fast_accum: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``softcap * tanh((h @ weight.T) / softcap)`` against ``targets``.

    Args:
        h: ``[..., d]`` final hidden states.
        weight: ``[V, d]`` output head.
        targets: ``[...]`` token ids; ``ignore_index`` entries do not count.
        softcap: the cap, or ``None`` for plain logits.
        fp8: compute the logits with an FP8 matmul (:func:`~lightning_opt.ops.fp8.fp8_matmul_t`, static
            scales; GPUs of compute capability 8.9+), the input gradient ``grad_h = g @ W`` from FP8 copies
            of the logit gradient (e5m2, written by the loss kernel) and of ``W``, and the weight gradient
            ``g^T @ h`` from the transposed e5m2 copy and the forward's e4m3 copy of ``h``.
            Needs the row count, the width and the vocabulary to be multiples of 16.
        backward_fast_accum: with ``fp8``, ``use_fast_accum`` for the two gradient matmuls (see
            :func:`~lightning_opt.ops.fp8.fp8_linear`).

    The matmuls run in the autocast dtype when autocast is on (bfloat16 in training), else in ``h``'s dtype.
    """
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap={softcap} must be positive or None")
    d = h.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [vocab, {d}], got {tuple(weight.shape)}")
    # without autograd (evaluation) the kernel skips its gradient sweep
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if fp8:
        check_fp8_shapes(math.prod(h.shape[:-1]), d, weight.shape[0], h.device)
    return _LinearSoftcapCE.apply(h.reshape(-1, d), weight, targets.reshape(-1).contiguous(), softcap,
                                  ignore_index, need_grad, fp8, backward_fast_accum)
