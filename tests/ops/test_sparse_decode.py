"""sparse_decode against a dense matmul; gradcheck of the torch path; GPU parity of the Triton path."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_opt._optional import is_available
from lightning_opt.ops.global_topk import batch_topk_threshold_sparse, global_batch_topk
from lightning_opt.ops.sparse_decode import clt_sparse_decode, flat_to_csr, sparse_decode, to_csr


def _sparse_acts(tokens: int, features: int, density: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    acts = torch.rand(tokens, features, generator=gen, dtype=dtype)
    acts = acts * (torch.rand(tokens, features, generator=gen) < density)
    acts[1] = 0  # a token with no active feature
    return acts


def test_csr_matches_dense_matmul_and_its_gradients() -> None:
    acts = _sparse_acts(9, 40, 0.15, seed=0).requires_grad_(True)
    weight = torch.randn(40, 24, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    idx, vals, offsets = to_csr(acts)
    out = sparse_decode(idx, vals, weight, offsets=offsets, bias=bias)
    dense = acts @ weight + bias
    torch.testing.assert_close(out, dense)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [acts, weight, bias])
    dense_grads = torch.autograd.grad((dense * g).sum(), [acts, weight, bias])
    active = acts.detach() != 0  # the sparse path only knows the active entries
    torch.testing.assert_close(grads[0], dense_grads[0] * active)
    torch.testing.assert_close(grads[1], dense_grads[1])
    torch.testing.assert_close(grads[2], dense_grads[2])


def test_gradcheck_float64_padded_and_csr() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(12, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.randint(0, 12, (4, 3), generator=gen)
    vals = torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, w: sparse_decode(idx, v, w, backend="torch"), (vals, weight))
    offsets = torch.tensor([0, 2, 2, 7])  # token 1 is empty
    flat_idx = torch.randint(0, 12, (9,), generator=gen)
    flat_vals = torch.randn(9, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda v, w: sparse_decode(flat_idx, v, w, offsets=offsets, backend="torch"), (flat_vals, weight)
    )


def test_decodes_global_batch_topk_output_without_densifying() -> None:
    x = torch.randn(16, 64)
    weight = torch.randn(64, 8)
    flat_idx, vals = batch_topk_threshold_sparse(x, k=4)
    idx, vals, offsets = flat_to_csr(flat_idx, vals, 16, 64)
    out = sparse_decode(idx, vals, weight, offsets=offsets)
    torch.testing.assert_close(out, global_batch_topk(x, 4) @ weight)


def test_bad_shapes_raise() -> None:
    w = torch.randn(5, 3)
    with pytest.raises(ValueError, match="offsets"):
        sparse_decode(torch.zeros(4, dtype=torch.long), torch.zeros(4), w)
    with pytest.raises(ValueError, match="1-D"):
        sparse_decode(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), w, offsets=torch.zeros(2))
    with pytest.raises(ValueError, match="backend"):
        sparse_decode(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), w, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not is_available("triton"), reason="needs CUDA + Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_on_gpu(dtype: torch.dtype) -> None:
    acts = _sparse_acts(256, 2048, 0.02, seed=2).cuda().to(dtype)
    weight = (torch.randn(2048, 768, device="cuda") / 40).to(dtype)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        a = acts.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        idx, vals, offsets = to_csr(a)
        out = sparse_decode(idx, vals, w, offsets=offsets, backend=backend)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append((a.grad.float(), w.grad.float()))
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(grads[1][0], grads[0][0], **tol)
    torch.testing.assert_close(grads[1][1], grads[0][1], **tol)


def test_clt_sparse_decode_matches_dense_cross_layer_sum() -> None:
    n_layers, tokens, features, d_out = 3, 5, 16, 4
    gen = torch.Generator().manual_seed(3)
    acts = _sparse_acts(n_layers * tokens, features, 0.2, seed=4).view(n_layers, tokens, features)
    acts.requires_grad_(True)
    w_dec = [
        torch.randn(features, n_layers - layer, d_out, generator=gen, requires_grad=True)
        for layer in range(n_layers)
    ]
    flat_idx = torch.nonzero(acts.detach().reshape(-1)).squeeze(1)
    out = clt_sparse_decode(flat_idx, acts.reshape(-1)[flat_idx], w_dec, tokens)
    expected = torch.zeros(tokens, n_layers, d_out)
    for src in range(n_layers):
        for tgt in range(src, n_layers):
            expected[:, tgt] += acts[src] @ w_dec[src][:, tgt - src]
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [acts, *w_dec])
    dense_grads = torch.autograd.grad((expected * g).sum(), [acts, *w_dec])
    torch.testing.assert_close(grads[0], dense_grads[0] * (acts.detach() != 0))
    for a, b in zip(grads[1:], dense_grads[1:]):
        torch.testing.assert_close(a, b)


def test_decode_self_check_runs_with_autograd_under_inference_mode() -> None:
    # The Triton self-check compares against the torch decode with gradients; a first call from inference mode
    # or a backward pass must still be able to take them (else it would cache "unusable").
    from lightning_opt.ops.sparse_decode import _agrees_with_torch, _torch_decode

    def wrong(idx, v, offsets, w):
        return _torch_decode(idx, v * 2, offsets, w)

    with torch.inference_mode():
        assert _agrees_with_torch(_torch_decode, torch.device("cpu"))
        assert not _agrees_with_torch(wrong, torch.device("cpu"))
    with torch.no_grad():
        assert _agrees_with_torch(_torch_decode, torch.device("cpu"))


@pytest.mark.skipif(not is_available("triton") or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
def test_layer_segments_feed_the_triton_decode_like_the_torch_one() -> None:
    # the CLT decode passes each layer's token ends and entry tokens as views of tensors computed once
    # (layer_segments); the Triton kernels must then give the torch path's output and gradients
    from lightning_opt.models.clt import _sparse_decode_layers
    from lightning_opt.ops.sparse_decode import layer_segments

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    L, N, F, d = 3, 5, 16, 8
    W = [torch.randn(F, L - s, d, device=dev, requires_grad=True) for s in range(L)]
    flat = torch.randperm(L * N * F, device=dev)[:40].sort().values
    vals = torch.rand(40, device=dev, requires_grad=True)
    feature, token, row_ptr, bounds = layer_segments(flat, L, N, F)
    assert bounds == [int((flat < s * N * F).sum()) for s in range(L + 1)]
    assert torch.equal(feature, flat % F) and torch.equal(token, (flat // F) % N)
    results = {}
    for backend in ("torch", "triton"):
        for name, fn in (("op", lambda b=backend: clt_sparse_decode(flat, vals, W, N, backend=b)),
                         ("clt", lambda b=backend: _sparse_decode_layers(flat, vals, W, N, F, b))):
            out = fn()
            results[backend, name] = (out, torch.autograd.grad(out.square().sum(), [vals, *W]))
    for name in ("op", "clt"):
        (a, ga), (b, gb) = results["torch", name], results["triton", name]
        assert torch.allclose(a, b, atol=1e-5)
        assert all(torch.allclose(x, y, atol=1e-4) for x, y in zip(ga, gb))
