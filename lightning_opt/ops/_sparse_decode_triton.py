"""Triton kernels behind :func:`lightning_opt.ops.sparse_decode.sparse_decode`. Imported only when used."""

from __future__ import annotations

import torch

from lightning_opt._optional import require

triton = require("triton", purpose="the sparse decode kernel", fallback="F.embedding_bag")
import triton.language as tl  # noqa: E402

_BLOCK_D = 128
_BLOCK_E = 16


@triton.jit
def _forward_kernel(
    idx_ptr,
    val_ptr,
    start_ptr,
    end_ptr,
    w_ptr,
    out_ptr,
    D,
    stride_w,
    stride_out,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # One program per (token, column block): gather that token's decoder rows and accumulate in fp32.
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: row * stride_out may exceed 2**31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    start = tl.load(start_ptr + row)
    end = tl.load(end_ptr + row)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < end
        ids = tl.load(idx_ptr + e, mask=e_mask, other=0).to(tl.int64)  # int32 ids: ids * stride_w may exceed 2**31
        vals = tl.load(val_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + ids[:, None] * stride_w + cols[None, :],
            mask=e_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * vals[:, None], axis=0)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _grad_values_kernel(
    idx_ptr,
    row_ptr,
    gout_ptr,
    w_ptr,
    gval_ptr,
    nnz,
    D,
    stride_w,
    stride_g,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # grad_values[e] = <grad_out[row(e)], weight[idx(e)]>
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < nnz
    # int64 offsets even for int32 ids / rows: ids * stride_w and rows * stride_g may exceed 2**31
    ids = tl.load(idx_ptr + e, mask=e_mask, other=0).to(tl.int64)
    rows = tl.load(row_ptr + e, mask=e_mask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = e_mask[:, None] & (cols < D)[None, :]
        w = tl.load(w_ptr + ids[:, None] * stride_w + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(gout_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(w * g, axis=1)
    tl.store(gval_ptr + e, acc, mask=e_mask)


@triton.jit
def _grad_weight_kernel(
    idx_ptr,
    row_ptr,
    val_ptr,
    gout_ptr,
    gw_ptr,
    nnz,
    D,
    stride_g,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # grad_weight[idx(e)] += values[e] * grad_out[row(e)], float32 atomics.
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    e_mask = e < nnz
    m = e_mask[:, None] & (cols < D)[None, :]
    # int64 offsets even for int32 ids / rows: ids * stride_w and rows * stride_g may exceed 2**31
    ids = tl.load(idx_ptr + e, mask=e_mask, other=0).to(tl.int64)
    rows = tl.load(row_ptr + e, mask=e_mask, other=0).to(tl.int64)
    vals = tl.load(val_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
    g = tl.load(gout_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.atomic_add(gw_ptr + ids[:, None] * D + cols[None, :], vals[:, None] * g, mask=m)


def forward(
    indices: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    rows, d = starts.numel(), weight.shape[1]
    out = torch.empty(rows, d, dtype=weight.dtype, device=weight.device)
    if rows == 0 or d == 0:
        return out
    grid = (rows, triton.cdiv(d, _BLOCK_D))
    _forward_kernel[grid](
        indices, values, starts, ends, weight, out, d, weight.stride(0), out.stride(0),
        BLOCK_D=_BLOCK_D, BLOCK_E=_BLOCK_E,
    )  # fmt: skip
    return out


def grad_values(
    indices: torch.Tensor, rows: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    nnz, d = indices.numel(), weight.shape[1]
    out = torch.empty(nnz, dtype=torch.float32, device=weight.device)
    if nnz == 0:
        return out
    grid = (triton.cdiv(nnz, _BLOCK_E),)
    _grad_values_kernel[grid](
        indices, rows, grad_out, weight, out, nnz, d, weight.stride(0), grad_out.stride(0),
        BLOCK_D=_BLOCK_D, BLOCK_E=_BLOCK_E,
    )  # fmt: skip
    return out


def grad_weight(
    indices: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, grad_out: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    nnz, d = indices.numel(), shape[1]
    out = torch.zeros(shape, dtype=torch.float32, device=grad_out.device)
    if nnz == 0:
        return out
    grid = (triton.cdiv(nnz, _BLOCK_E), triton.cdiv(d, _BLOCK_D))
    _grad_weight_kernel[grid](
        indices, rows, values, grad_out, out, nnz, d, grad_out.stride(0),
        BLOCK_D=_BLOCK_D, BLOCK_E=_BLOCK_E,
    )  # fmt: skip
    return out
