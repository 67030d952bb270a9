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


@pytest.mark.parametrize("backend, available, says", [
    ("flash", "flash_available", r"lightning-opt\[gpu\]"),
    ("flash4", "flash4_available", r"flash-attn-4: pip install 'lightning-opt\[gpu\]'"),
])
def test_flash_backends_error_cleanly_when_missing(backend, available, says):
    import lightning_opt.ops.attention as attn

    if getattr(attn, available)():
        pytest.skip(f"the package of backend {backend!r} is installed")
    q, k, v = _qkv()
    with pytest.raises(ImportError, match=says):
        attention(q, k, v, backend=backend)


def test_flash4_takes_plain_causal_calls_on_cuda_only():
    from lightning_opt.ops.attention import flash4_takes

    q, _, _ = _qkv()
    doc = torch.zeros(q.shape[0], q.shape[2], dtype=torch.long)
    assert not flash4_takes(q, None, None)  # a CPU tensor: SDPA
    if torch.cuda.is_available():
        g = q.cuda()
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert flash4_takes(g, None, None) == hopper and flash4_takes(g, 64, None) == hopper
        assert not flash4_takes(g, None, doc.cuda()) and not flash4_takes(g, torch.tensor(64, device="cuda"), None)


def test_unknown_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown"):
        attention(q, k, v, backend="nope")


def _docs(t, cuts, batch=2):
    ids = torch.zeros(batch, t, dtype=torch.long)
    for c in cuts:
        ids[0, c:] += 1  # the first row: several documents; the second: one
    return ids


@pytest.mark.parametrize("window", [None, 200, torch.tensor(300)])
def test_flex_block_mask_classifies_blocks_like_the_dense_mask(window):
    """Skipped blocks attend nothing, full blocks everything; the per-token mask decides the rest."""
    from lightning_opt.ops.attention import FLEX_BLOCK, doc_window_block_mask

    t = 8 * FLEX_BLOCK
    doc = _docs(t, [100, 300, 301, 700])
    bm = doc_window_block_mask(t, doc.device, window, doc)
    dense = build_mask(t, doc.device, window, doc)[:, 0]  # [B, T, T]
    n = t // FLEX_BLOCK
    blocks = dense.view(2, n, FLEX_BLOCK, n, FLEX_BLOCK)
    anyb, allb = blocks.any(dim=(2, 4)), blocks.all(dim=(2, 4))
    for b in range(2):
        for qb in range(n):
            part = set(bm.kv_indices[b, 0, qb, : bm.kv_num_blocks[b, 0, qb]].tolist())
            full = set(bm.full_kv_indices[b, 0, qb, : bm.full_kv_num_blocks[b, 0, qb]].tolist())
            assert not part & full
            for kb in range(n):
                if kb in full:
                    assert allb[b, qb, kb], (b, qb, kb)
                elif kb not in part:
                    assert not anyb[b, qb, kb], (b, qb, kb)
            # every block that attends is listed (partial or full)
            assert {kb for kb in range(n) if anyb[b, qb, kb]} == part | full
    # the one-document row has full blocks below the diagonal when no window cuts them
    if window is None:
        assert bm.full_kv_num_blocks[1, 0, n - 1] == n - 1


@pytest.mark.parametrize("window", [None, 200])
def test_flex_attention_forward_matches_math(window):
    """FlexAttention itself (CPU forward, no gradient there) against the dense reference."""
    from lightning_opt.ops.attention import FLEX_BLOCK, doc_window_block_mask

    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    t = 4 * FLEX_BLOCK
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, t, 16, generator=g) for _ in range(3))
    doc = _docs(t, [70, 260])
    ref = math_attention(q, k, v, build_mask(t, q.device, window, doc))
    out = flex_attention(q, k, v, block_mask=doc_window_block_mask(t, q.device, window, doc))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_flex_backend_on_cpu_trains_and_equals_sdpa():
    q, k, v = (x.requires_grad_() for x in _qkv(t=256))
    doc = _docs(256, [50])
    window = torch.tensor(64)
    out = attention(q, k, v, window=window, doc_ids=doc, backend="flex")
    ref = attention(q, k, v, window=64, doc_ids=doc, backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="divisible by 128"):
        from lightning_opt.ops.attention import doc_window_block_mask

        doc_window_block_mask(100, q.device)


def test_flex_block_mask_compiles_in_one_graph_and_a_new_window_recompiles_nothing():
    """What the model does on a GPU, compiled on the CPU (forward: CPU FlexAttention has no backward): the
    block mask is built inside the graph, and moving the window tensor reuses the compiled graph."""
    import torch._dynamo

    from lightning_opt.ops.attention import FLEX_BLOCK, doc_window_block_mask

    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    t = 4 * FLEX_BLOCK
    doc = _docs(t, [200], batch=1)
    win = torch.tensor(160)

    def f(q, k, v, doc, win):
        return flex_attention(q, k, v, block_mask=doc_window_block_mask(t, q.device, win, doc))

    torch._dynamo.reset()
    try:
        cf = torch.compile(f, dynamic=False, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, t, 32, generator=g) for _ in range(3))
        with torch.no_grad():
            out = cf(q, k, v, doc, win)
            torch.testing.assert_close(out, math_attention(q, k, v, build_mask(t, q.device, 160, doc)),
                                       atol=1e-4, rtol=1e-4)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            win.fill_(320)
            out = cf(q, k, v, doc, win)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
            torch.testing.assert_close(out, math_attention(q, k, v, build_mask(t, q.device, 320, doc)),
                                       atol=1e-4, rtol=1e-4)
    finally:
        torch._dynamo.reset()


def _grads(backend, window=None, compiled=False):
    q, k, v = (x.clone().requires_grad_() for x in _qkv(hkv=2))
    fn = torch.compile(attention, backend="aot_eager", fullgraph=True) if compiled else attention
    out = fn(q, k, v, window=window, backend=backend)
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("compiled", [False, True])
def test_cudnn_backend_falls_back_on_cpu_to_the_same_result(window, compiled):
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
             torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    ref = _grads("math", window)
    got = _grads("cudnn", window, compiled)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the kernel preference is scoped to the call: SDPA's global switches are as they were
    assert flags == (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                     torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_backend_on_cuda_matches_sdpa_in_bf16():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 12, 1024, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    outs = []
    for backend in ("sdpa", "cudnn"):
        for x in (q, k, v):
            x.grad = None
        out = attention(q, k, v, backend=backend)
        out.float().square().sum().backward()
        outs.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
