"""FP8 linear (static scales) against the float matmul, and the GPT head option."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution
from lightning_opt.ops.fp8 import fp8_linear, fp8_matmul_t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_forward_and_grads_match_float_matmul():
    torch.manual_seed(0)
    n, k, m = 64, 128, 96
    # RMS-normalised rows, as the head sees them; small weights, as a head has
    x = torch.nn.functional.rms_norm(torch.randn(n, k), (k,)).requires_grad_()
    w = (0.05 * torch.randn(m, k)).requires_grad_()
    g = torch.randn(n, m) / n  # the size of a mean cross-entropy's logit gradient
    out = fp8_linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (n, m)
    out.backward(g.to(out.dtype))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = x2 @ w2.t()
    ref.backward(g)
    # e4m3 keeps 3 mantissa bits (~6% per element); errors average out over the dot products
    assert _rel(out, ref) < 0.08
    assert _rel(x.grad, x2.grad) < 0.15  # e5m2 gradients: 2 mantissa bits
    assert _rel(w.grad, w2.grad) < 0.15
    assert w.grad.dtype == w.dtype


def test_default_input_scale_cannot_overflow():
    # all of a row's RMS mass in one entry: |x| = sqrt(k), the bound the default scale is built on
    k = 256
    x = torch.zeros(16, k)
    x[:, 0] = math.sqrt(k)
    w = torch.ones(16, k) * 0.01
    out = fp8_linear(x, w)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), (x @ w.t()), rtol=0.07, atol=0.0)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(10, 32), torch.randn(32, 32))
    with pytest.raises(ValueError, match="weight must be"):
        fp8_linear(torch.randn(16, 32), torch.randn(32, 48))


def _gpt(**kw) -> GPT:
    """``GPT`` of the architecture and execution settings in ``kw``."""
    ex = {k: kw.pop(k) for k in list(kw) if k in GPTExecution.__dataclass_fields__}
    return GPT(GPTConfig(**kw), GPTExecution(**ex))


def test_config_validation():
    with pytest.raises(ValueError, match="head_fp8"):
        _gpt(head_fp8=True, tie_embeddings=True)
    with pytest.raises(ValueError, match="vocab_multiple"):
        _gpt(vocab_size=50257, vocab_multiple=1, head_fp8=True, tie_embeddings=False)


SMALL = dict(vocab_size=256, vocab_multiple=16, n_layer=2, n_head=2, n_embd=64, block_size=32,
             tie_embeddings=False, norm="rmsnorm", bias=False)


def _pair(**option):
    """A small GPT with an FP8 option, its twin without, the same weights, and a batch."""
    torch.manual_seed(0)
    model = _gpt(**SMALL, **option)
    ref = _gpt(**SMALL)
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (4, 32))
    return model, ref, x, torch.roll(x, -1, dims=1)


def _assert_trains(model, x, y, steps, check=lambda m: True):
    """AdamW steps on one batch: every loss finite, every gradient passing ``check``, the loss down by 1."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        assert torch.isfinite(loss)
        loss.backward()
        assert check(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_gpt_with_fp8_head_trains_and_evaluates_in_full_precision():
    model, ref, x, y = _pair(head_fp8=True)
    model.eval()
    ref.eval()
    # evaluation keeps the full-precision head: identical to the model without the option
    torch.testing.assert_close(model(x, y), ref(x, y))
    model.train()
    _assert_trains(model, x, y, 30, check=lambda m: m.lm_head.weight.grad is not None
                   and m.lm_head.weight.grad.abs().sum() > 0)


def test_grad_scale_must_follow_a_mean_loss():
    # A mean cross-entropy over N rows, divided again for gradient accumulation, has tiny logit
    # gradients (p / (N * accum)). With the sum-loss scale they underflow e5m2 and only the targets'
    # -1 terms survive; with 1/(448 N) (what GPT(head_fp8=True) passes) they survive. The head rows share
    # a component (as real heads do), which the lost terms should cancel in the input gradient.
    torch.manual_seed(0)
    n, k, m, accum = 512, 32, 1024, 128
    x = torch.nn.functional.rms_norm(torch.randn(n, k), (k,))
    w = 0.02 * torch.randn(m, k) + 0.2 * torch.randn(1, k)
    targets = torch.randint(0, m, (n,))
    ref_x = x.clone().requires_grad_()
    (torch.nn.functional.cross_entropy(ref_x @ w.t(), targets) / accum).backward()
    errs = {}
    for name, gs in {"sum_scale": 1 / 448, "mean_scale": 1 / (448 * n)}.items():
        xq = x.clone().requires_grad_()
        logits = fp8_linear(xq, w, grad_scale=gs).float()
        (torch.nn.functional.cross_entropy(logits, targets) / accum).backward()
        errs[name] = _rel(xq.grad, ref_x.grad)
    # the true gradient is a small residual of cancelling terms, so even the good scale's relative
    # error is visible; the sum scale's is an order of magnitude worse (the gradient is wrong)
    assert errs["mean_scale"] < 0.4, errs
    assert errs["sum_scale"] > 10 * errs["mean_scale"], errs


def test_fp8_matmul_t_matches_and_saturates_instead_of_nan():
    torch.manual_seed(0)
    x = torch.nn.functional.rms_norm(torch.randn(32, 64), (64,)).to(torch.bfloat16)
    w = (0.05 * torch.randn(48, 64)).to(torch.bfloat16)
    out = fp8_matmul_t(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 48)
    assert _rel(out, x.float() @ w.float().t()) < 0.08
    # an input far beyond its scale's range (a large RMSNorm gain) saturates: finite, not NaN
    big = x * 1000
    assert torch.isfinite(fp8_matmul_t(big, w).float()).all()


def test_head_fp8_values_and_auto_mode():
    with pytest.raises(ValueError, match="head_fp8.*'auto'"):
        GPTExecution(head_fp8="yes")
    with pytest.raises(ValueError, match="head_fp8.*'auto'"):
        GPTExecution(head_fp8=1)  # not silently read as "auto"
    with pytest.raises(ValueError, match="loss_impl 'torch' or 'fused'"):
        _gpt(head_fp8=True, tie_embeddings=False, loss_impl="chunked")
    # "auto" is off where it cannot apply instead of an error: a recipe with it can still tie its head or
    # take another loss
    untied = GPTConfig(tie_embeddings=False, vocab_multiple=128)
    assert not GPTExecution(head_fp8="auto").fp8_head_applicable(GPTConfig(tie_embeddings=True))
    assert not GPTExecution(head_fp8="auto", loss_impl="chunked").fp8_head_applicable(untied)
    assert GPTExecution(head_fp8="auto").fp8_head_applicable(untied)
    cfg = dict(vocab_size=256, vocab_multiple=16, n_layer=2, n_head=2, n_embd=64, block_size=32,
               tie_embeddings=False, norm="rmsnorm", bias=False, logit_softcap=15.0)
    x = torch.randint(0, 256, (2, 32))
    y = torch.roll(x, -1, dims=1)
    for loss_impl in ("torch", "fused"):
        torch.manual_seed(0)
        auto = _gpt(**cfg, head_fp8="auto", loss_impl=loss_impl)
        plain = _gpt(**cfg, loss_impl=loss_impl)
        plain.load_state_dict(auto.state_dict())
        # a CPU has no FP8 matmul of its own: "auto" keeps the compute dtype there, bit for bit
        torch.testing.assert_close(auto(x, y), plain(x, y), atol=0, rtol=0)


def test_fused_loss_with_fp8_forward_matches_bf16_path():
    """loss_impl='fused' + head_fp8=True: FP8 logits and FP8 gradient matmuls from the loss kernel's e5m2 copy."""
    from lightning_opt.ops.softcap_ce import linear_softcap_cross_entropy

    torch.manual_seed(0)
    n, k, v = 64, 64, 256
    h = torch.nn.functional.rms_norm(torch.randn(n, k), (k,)).requires_grad_()
    w = (0.05 * torch.randn(v, k)).requires_grad_()
    y = torch.randint(0, v, (n,))
    with torch.autocast("cpu", torch.bfloat16):
        got = linear_softcap_cross_entropy(h, w, y, 15.0, fp8=True)
    got.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = 15.0 * torch.tanh((h2 @ w2.t()) / 15.0)
    ref = torch.nn.functional.cross_entropy(z, y)
    ref.backward()
    assert abs(float(got) - float(ref)) < 0.02 * float(ref)
    assert _rel(h.grad, h2.grad) < 0.1
    assert _rel(w.grad, w2.grad) < 0.1
    with pytest.raises(ValueError, match="multiples of 16"):
        linear_softcap_cross_entropy(h[:10], w, y[:10], 15.0, fp8=True)
    # the input gradient came from the FP8 copies: it differs from the bfloat16 path's, by FP8 rounding only
    h3, w3 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        linear_softcap_cross_entropy(h3, w3, y, 15.0, fp8=False).backward()
    assert 0 < _rel(h.grad, h3.grad) < 0.1
    # so did the weight gradient
    assert 0 < _rel(w.grad, w3.grad) < 0.1


class _ScaledMMAccum(TorchDispatchMode):
    """Records ``use_fast_accum`` of every ``aten._scaled_mm`` call that runs inside it (forward and backward)."""

    _OP = torch.ops.aten._scaled_mm.default
    _POS = [a.name for a in _OP._schema.arguments].index("use_fast_accum")

    def __init__(self) -> None:
        super().__init__()
        self.fast: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self._OP:
            self.fast.append(bool(kwargs.get("use_fast_accum", args[self._POS] if len(args) > self._POS else False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("fast", [False, True])
def test_backward_fast_accum_reaches_the_backward_matmuls(fast: bool):
    """fp8_linear and the fused FP8 loss: the forward matmul accumulates fast, the two backward matmuls as asked."""
    from lightning_opt.ops.softcap_ce import linear_softcap_cross_entropy

    torch.manual_seed(0)
    x = torch.nn.functional.rms_norm(torch.randn(32, 64), (64,)).requires_grad_()
    w = (0.05 * torch.randn(48, 64)).requires_grad_()
    with _ScaledMMAccum() as calls:
        fp8_linear(x, w, backward_fast_accum=fast).float().sum().backward()
    assert calls.fast == [True, fast, fast]
    y = torch.randint(0, 48, (32,))
    with _ScaledMMAccum() as calls, torch.autocast("cpu", torch.bfloat16):
        linear_softcap_cross_entropy(x, w, y, 15.0, fp8=True, backward_fast_accum=fast).backward()
    assert calls.fast == [True, fast, fast]


def test_gpt_config_fast_accum_reaches_every_fp8_matmul_and_the_hparams():
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    cfg = GPTConfig(vocab_size=256, vocab_multiple=16, n_layer=1, n_head=2, n_embd=64, block_size=16,
                    tie_embeddings=False, norm="rmsnorm", bias=False, logit_softcap=15.0)
    x = torch.randint(0, 256, (2, 16))
    y = torch.roll(x, -1, dims=1)
    for fast in (False, True):
        torch.manual_seed(0)
        ex = GPTExecution(loss_impl="fused", head_fp8=True, mlp_fp8=True, attn_fp8=True, fp8_backward_fast_accum=fast)
        module = GPT2SpeedrunModule(cfg, execution=ex)
        assert module.hparams["execution"].fp8_backward_fast_accum is fast
        with _ScaledMMAccum() as calls, torch.autocast("cpu", torch.bfloat16):
            module.model(x, y).backward()
        # 4 FP8 linears (c_attn, attention c_proj, c_fc, MLP c_proj) + the head: 5 forward, 10 backward matmuls
        assert sorted(calls.fast) == sorted([True] * 5 + [fast] * 10)


def test_loss_rows_write_an_e5m2_copy_of_the_gradient():
    from lightning_opt.ops.softcap_ce import G8_MULT, softcap_ce_rows_

    torch.manual_seed(0)
    logits = (4 * torch.randn(32, 512)).to(torch.bfloat16)
    y = torch.randint(0, 512, (32,))
    g8 = torch.empty(32, 512, dtype=torch.float8_e5m2)
    grad = logits.clone()
    softcap_ce_rows_(grad, y, 15.0, g8=g8)
    back = g8.float() / G8_MULT
    assert torch.isfinite(back).all() and _rel(back, grad) < 0.1  # e5m2 keeps 2 mantissa bits
    assert (back[torch.arange(32), y] < 0).all()  # the target's entry keeps its sign (p - 1 < 0)
    with pytest.raises(ValueError, match="float8_e5m2"):
        softcap_ce_rows_(logits.clone(), y, 15.0, g8=g8.view(torch.uint8))
    with pytest.raises(ValueError, match="write_grad"):
        softcap_ce_rows_(logits.clone(), y, 15.0, write_grad=False, g8=g8)
    # with g8t: the same FP8 copy, also transposed, and the logits keep their values
    g8b, g8t, kept = torch.empty_like(g8), torch.empty(512, 32, dtype=torch.float8_e5m2), logits.clone()
    loss = softcap_ce_rows_(kept, y, 15.0, g8=g8b, g8t=g8t)
    assert torch.equal(kept, logits) and torch.equal(g8b.view(torch.uint8), g8.view(torch.uint8))
    assert torch.equal(g8t.view(torch.uint8), g8.view(torch.uint8).t())
    assert torch.equal(loss, softcap_ce_rows_(logits.clone(), y, 15.0, write_grad=False))
    with pytest.raises(ValueError, match=r"shape \[V, N\] = \[512, 32\]"):
        softcap_ce_rows_(logits.clone(), y, 15.0, g8t=g8t)  # without g8
    with pytest.raises(ValueError, match=r"\[512, 32\]"):
        softcap_ce_rows_(logits.clone(), y, 15.0, g8=g8b, g8t=g8t.t())  # not [V, N]


def test_logits_for_the_caller_never_use_fp8():
    """model(idx) in training mode returns logits in the compute dtype: the FP8 head's gradient scale is set
    for a mean loss over the batch, which a caller's own use of the logits need not be."""
    cfg = dict(vocab_size=256, vocab_multiple=16, n_layer=2, n_head=2, n_embd=64, block_size=32,
               tie_embeddings=False, norm="rmsnorm", bias=False)
    torch.manual_seed(0)
    fp8 = _gpt(**cfg, head_fp8=True).train()
    plain = _gpt(**cfg).train()
    plain.load_state_dict(fp8.state_dict())
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(fp8(x), plain(x), atol=0, rtol=0)


def test_mlp_fp8_matches_the_float_mlp_and_trains():
    """mlp_fp8: both MLP matmuls in FP8 (CPU: torch emulates _scaled_mm); evaluation stays in full precision."""
    with pytest.raises(ValueError, match="mlp_fp8"):
        GPTExecution(mlp_fp8="on")
    with pytest.raises(ValueError, match="divisible by 16"):
        _gpt(n_embd=40, n_head=2, mlp_fp8=True)
    model, ref, x, y = _pair(mlp_fp8=True)  # the GELU MLP of the small config
    mlp, ref_mlp = model.blocks[0].mlp, ref.blocks[0].mlp
    h = torch.nn.functional.rms_norm(torch.randn(4, 32, 64), (64,)).requires_grad_()
    h2 = h.detach().clone().requires_grad_()
    out, want = mlp(h), ref_mlp(h2)
    assert _rel(out, want) < 0.1
    g = torch.randn_like(want) / want.numel() * 64  # a mean loss's gradient size
    out.backward(g.to(out.dtype))
    want.backward(g)
    assert _rel(h.grad, h2.grad) < 0.2
    assert _rel(mlp.c_fc.weight.grad, ref_mlp.c_fc.weight.grad) < 0.2
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x, y), ref(x, y), atol=0, rtol=0)  # evaluation: no FP8
    model.train()
    auto = _gpt(**SMALL, mlp_fp8="auto").train()
    auto.load_state_dict(ref.state_dict())
    torch.testing.assert_close(auto(x, y), ref.train()(x, y), atol=0, rtol=0)  # "auto" on a CPU: no FP8
    _assert_trains(model, x, y, 25)


def test_attn_fp8_matches_the_float_attention_and_trains():
    """attn_fp8: the q/k/v and output projections in FP8; the attention output and gradients stay close."""
    with pytest.raises(ValueError, match="attn_fp8"):
        GPTExecution(attn_fp8="yes")
    with pytest.raises(ValueError, match="divisible by 16"):
        _gpt(n_embd=40, n_head=2, attn_fp8=True)
    model, ref, x, y = _pair(attn_fp8=True)
    attn, ref_attn = model.blocks[0].attn, ref.blocks[0].attn
    h = torch.nn.functional.rms_norm(torch.randn(4, 32, 64), (64,)).requires_grad_()
    h2 = h.detach().clone().requires_grad_()
    with torch.no_grad():  # a non-zero output projection (zero_init_proj would make the check vacuous)
        w = torch.randn_like(attn.c_proj.weight) * 0.05
        attn.c_proj.weight.copy_(w)
        ref_attn.c_proj.weight.copy_(w)
    out, want = attn(h), ref_attn(h2)
    assert want.abs().mean() > 1e-3 and _rel(out, want) < 0.1
    g = torch.randn_like(want) / want.numel() * 64
    out.backward(g.to(out.dtype))
    want.backward(g)
    assert _rel(h.grad, h2.grad) < 0.2
    assert _rel(attn.c_attn.weight.grad, ref_attn.c_attn.weight.grad) < 0.2
    assert _rel(attn.c_proj.weight.grad, ref_attn.c_proj.weight.grad) < 0.2
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x, y), ref(x, y), atol=0, rtol=0)  # evaluation: no FP8
    model.train()
    _assert_trains(model, x, y, 25)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 matmuls (compute capability 8.9+)")
def test_fp8_head_and_mlp_compile_and_train_on_gpu():
    """The speedrun architecture with both FP8 options under torch.compile: finite, decreasing loss."""
    cfg = GPTConfig(vocab_size=512, vocab_multiple=128, n_layer=2, n_head=2, n_embd=128, block_size=64,
                    tie_embeddings=False, norm="rmsnorm", bias=False, mlp="relu2", logit_softcap=15.0,
                    qk_norm=True, pos_emb="rope")
    torch.manual_seed(0)
    model = GPT(cfg, GPTExecution(loss_impl="fused", head_fp8=True, mlp_fp8=True, attn_fp8=True)).cuda().train()
    step = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 512, (8, 64), device="cuda")
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(30):
        with torch.autocast("cuda", torch.bfloat16):
            loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 1.0


def test_auto_fp8_for_mlp_and_attention_needs_compile(monkeypatch):
    """'auto' with compiled_only (the MLP and attention projections): FP8 only inside torch.compile, where the
    casts fuse into neighbouring kernels; eager it would be slower. True always insists; evaluation never."""
    from lightning_opt.ops import fp8 as fp8_mod

    monkeypatch.setattr(fp8_mod, "_device_has_fp8", lambda x: True)  # as on an H100
    x = torch.randn(32, 64)
    assert fp8_mod.fp8_wanted("auto", x, True) is True  # the head's rule: no compile needed
    assert fp8_mod.fp8_wanted("auto", x, True, compiled_only=True) is False  # eager
    assert fp8_mod.fp8_wanted(True, x, True, compiled_only=True) is True
    assert fp8_mod.fp8_wanted("auto", x, False, compiled_only=True) is False

    def flag(t):
        return t * float(fp8_mod.fp8_wanted("auto", t, True, compiled_only=True))

    torch._dynamo.reset()
    assert torch.equal(torch.compile(flag, backend="eager", fullgraph=True)(x), x)  # traced: FP8 wanted
    assert torch.equal(flag(x), torch.zeros_like(x))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 matmuls (compute capability 8.9+)")
def test_auto_mlp_fp8_on_gpu_is_bf16_eager_and_fp8_compiled():
    torch.manual_seed(0)
    cfg = dict(vocab_size=512, vocab_multiple=128, n_layer=1, n_head=2, n_embd=128, block_size=64,
               tie_embeddings=False, norm="rmsnorm", bias=False, mlp="relu2")
    auto = _gpt(**cfg, mlp_fp8="auto").cuda().train()
    plain = _gpt(**cfg).cuda().train()
    plain.load_state_dict(auto.state_dict())
    h = torch.nn.functional.rms_norm(torch.randn(4, 64, 128, device="cuda"), (128,))
    with torch.autocast("cuda", torch.bfloat16):
        eager, ref = auto.blocks[0].mlp(h), plain.blocks[0].mlp(h)
        compiled = torch.compile(auto.blocks[0].mlp)(h)
        compiled_ref = torch.compile(plain.blocks[0].mlp)(h)
    torch.testing.assert_close(eager, ref, atol=0, rtol=0)  # eager "auto": no FP8
    # compiled: FP8 - off the compiled bf16 MLP by FP8 rounding (same graph otherwise), yet close to it
    assert 1e-3 < _rel(compiled, compiled_ref) < 0.1
