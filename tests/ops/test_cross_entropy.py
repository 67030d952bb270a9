from __future__ import annotations

import pytest
import torch

from lightning_opt.ops.cross_entropy import linear_cross_entropy, softcap_cross_entropy


def _inputs(n=37, c=16, v=50, dtype=torch.float64, ignore=True):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, c, generator=g, dtype=dtype, requires_grad=True)
    w = (0.5 * torch.randn(v, c, generator=g, dtype=dtype)).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    if ignore:
        y[::5] = -100
    return h, w, y


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_matches_reference_loss_and_grads(softcap, chunk):
    h, w, y = _inputs()
    ref = softcap_cross_entropy(h @ w.t(), y, softcap)
    gh_ref, gw_ref = torch.autograd.grad(ref * 2.5, (h, w))  # a non-unit upstream gradient
    out = linear_cross_entropy(h, w, y, softcap, chunk_size=chunk)
    gh, gw = torch.autograd.grad(out * 2.5, (h, w))
    # the chunked path computes logits in float32 by design: tolerances of float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, gh_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, gw_ref, atol=1e-5, rtol=1e-4)


def test_reference_softcap_is_the_plain_formula():
    h, w, y = _inputs(ignore=False)
    z = h @ w.t()
    expected = torch.nn.functional.cross_entropy(4.0 * torch.tanh(z / 4.0), y)
    torch.testing.assert_close(softcap_cross_entropy(z, y, 4.0), expected.float())


def test_batched_shape_and_all_ignored():
    h, w, y = _inputs(n=12)
    loss = linear_cross_entropy(h.view(3, 4, -1), w, y.view(3, 4), 5.0, chunk_size=5)
    torch.testing.assert_close(loss, softcap_cross_entropy(h @ w.t(), y, 5.0), atol=1e-5, rtol=1e-5)
    none = linear_cross_entropy(h, w, torch.full_like(y, -100))
    assert none.item() == 0.0  # no NaN from 0 / 0
    none.backward()
    assert torch.all(h.grad == 0)


def test_bf16_autocast_close_to_fp32():
    h, w, y = _inputs(n=64, c=32, v=100, dtype=torch.float32, ignore=False)
    ref = softcap_cross_entropy(h @ w.t(), y, 30.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, y, 30.0, chunk_size=16)
    out.backward()
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) < 2e-2
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_bad_arguments():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="width"):
        linear_cross_entropy(h, w[:, :3], y)
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy(h, w, y[:-1])


def _fp8_supported() -> bool:
    try:
        one = torch.ones(())
        a = torch.zeros(16, 16).to(torch.float8_e5m2)
        b = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _fp8_supported(), reason="torch._scaled_mm (fp8) not available on this device")
@pytest.mark.parametrize("softcap", [None, 15.0])
def test_fp8_close_to_reference(softcap):
    # fp8 keeps 3 (e4m3) and 2 (e5m2) mantissa bits: compare loosely, but well below a broken-scale error
    h, w, y = _inputs(n=96, c=64, v=128, dtype=torch.float32)
    ref = softcap_cross_entropy(h @ w.t(), y, softcap)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    out = linear_cross_entropy(h, w, y, softcap, chunk_size=32, fp8=True)
    gh, gw = torch.autograd.grad(out, (h, w))
    assert abs(out.item() - ref.item()) / ref.item() < 0.03
    cos = torch.nn.functional.cosine_similarity
    assert cos(gh.flatten(), gh_ref.flatten(), dim=0) > 0.98
    assert cos(gw.flatten(), gw_ref.flatten(), dim=0) > 0.98
    # a zero head (zero-initialised, as in the speedrun config) must not produce NaN
    zero = torch.zeros_like(w, requires_grad=True)
    loss = linear_cross_entropy(h, zero, y, softcap, chunk_size=32, fp8=True)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(zero.grad).all()
    torch.testing.assert_close(loss, torch.log(torch.tensor(128.0)), atol=1e-4, rtol=0)


def test_fp8_needs_multiples_of_16():
    h, w, y = _inputs(c=16, v=50, dtype=torch.float32)
    with pytest.raises(ValueError, match="divisible by 16"):
        linear_cross_entropy(h, w, y, fp8=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_gpt2_head_shape(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need an Ada/Hopper GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4096, 768, device="cuda", generator=g).requires_grad_()
    w = (0.02 * torch.randn(50304, 768, device="cuda", generator=g)).requires_grad_()
    y = torch.randint(0, 50257, (4096,), device="cuda", generator=g)
    ref = softcap_cross_entropy(h @ w.t(), y, 30.0)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, w))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, y, 30.0, chunk_size=1024, fp8=fp8)
    gh, gw = torch.autograd.grad(out, (h, w))
    assert abs(out.item() - ref.item()) / ref.item() < (0.03 if fp8 else 0.01)
    cos = torch.nn.functional.cosine_similarity
    assert cos(gh.flatten(), gh_ref.flatten(), dim=0) > 0.98
    assert cos(gw.flatten(), gw_ref.flatten(), dim=0) > 0.98
