from __future__ import annotations

import pytest
import torch

from lightning_opt.ops.attention import attention, build_mask, math_attention


def _qkv(h=4, hkv=4, t=12, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, h, t, d, generator=g, dtype=dtype)
    k = torch.randn(2, hkv, t, d, generator=g, dtype=dtype)
    v = torch.randn(2, hkv, t, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_matches_math(hkv, window):
    q, k, v = _qkv(hkv=hkv)
    ref = math_attention(q, k, v, build_mask(q.shape[2], q.device, window))
    out = attention(q, k, v, window=window, backend="sdpa")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_doc_mask_matches_math():
    q, k, v = _qkv()
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    ref = math_attention(q, k, v, build_mask(12, q.device, None, doc))
    torch.testing.assert_close(attention(q, k, v, doc_ids=doc), ref, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32():
    q, k, v = _qkv()
    ref = attention(q, k, v, backend="math")
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    assert (out - ref).norm() / ref.norm() < 2e-2


def test_flash_backend_errors_cleanly_when_missing():
    from lightning_opt.ops.attention import flash_available

    if flash_available():
        pytest.skip("flash-attn is installed")
    q, k, v = _qkv()
    with pytest.raises(ImportError, match=r"lightning-opt\[gpu\]"):
        attention(q, k, v, backend="flash")


def test_unknown_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown"):
        attention(q, k, v, backend="nope")
