from __future__ import annotations

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution, RMSNorm
from tests._train import loss_drop

BASE = dict(vocab_size=300, n_layer=4, n_head=4, n_embd=32, block_size=32)
OPTIONS = {
    "classic": {},
    "rope": dict(pos_emb="rope"),
    "rmsnorm_qknorm": dict(norm="rmsnorm", qk_norm=True, bias=False),
    "relu2": dict(mlp="relu2"),
    "swiglu": dict(mlp="swiglu"),
    "untied_zero_init": dict(tie_embeddings=False, zero_init_proj=True),
    "softcap": dict(logit_softcap=15.0),
    "value_embeds": dict(n_value_embeds=2),
    "unet": dict(unet_skips=True),
    "gqa": dict(n_kv_head=2),
    "window": dict(window_size=4),
    "doc_causal": dict(doc_causal=True, eot_token=0),
    "vocab_pad": dict(vocab_multiple=128),
    "no_norm_weight": dict(norm="rmsnorm", qk_norm=True, bias=False, norm_weight=False),
    "no_layernorm_weight": dict(norm_weight=False),
    "record_parity": dict(pos_emb="rope", rope_base=1024.0, rope_truncate=True, x0_mix=True, embed_norm=True,
                          skip_attn_layers=(2,), n_value_embeds=1),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_forward_backward(name):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, **OPTIONS[name]))
    x = torch.randint(0, 300, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 300)
    loss = model(x, x.roll(-1, 1))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert model.flops_per_token(16) > 0


def test_from_hf_same_logits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=48, n_layer=3, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT.from_hf(hf).eval()
    idx = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=0)
    # a bare state dict works too
    ours2 = GPT.from_hf(hf.state_dict(), config=ours.config).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours2(idx), hf(idx).logits, atol=1e-4, rtol=0)


def test_from_hf_rejects_other_model():
    with pytest.raises(ValueError, match="not a GPT-2 state dict"):
        GPT.from_hf({"foo.weight": torch.zeros(2, 2)}, config=GPTConfig(**BASE))


def test_window_limits_attention():
    """A token beyond the window must not influence the output."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, window_size=3, pos_emb="rope")).eval()
    x = torch.randint(1, 300, (1, 10))
    y = x.clone()
    y[0, 0] = (x[0, 0] + 1) % 300
    with torch.no_grad():
        a, b = model(x), model(y)
    # position 3 attends to 1..3 in layer 1, but 4 layers widen the field to 0..; last position (9) sees 6..9 -> 0..9
    # after 4 layers the receptive field is 4*(3-1)=8 back: position 9 sees from 1, so it is unaffected by position 0
    torch.testing.assert_close(a[0, 9], b[0, 9])
    assert not torch.allclose(a[0, 1], b[0, 1])


def test_doc_causal_isolates_documents():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, doc_causal=True, eot_token=0, pos_emb="rope")).eval()
    x = torch.tensor([[5, 6, 7, 0, 8, 9, 10]])
    y = x.clone()
    y[0, 1] = 42  # change inside the first document
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[0, 3:], b[0, 3:])  # second document (from the EOT on) unaffected
    assert not torch.allclose(a[0, 2], b[0, 2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_embd=30), "divisible by n_head"),
        (dict(mlp="tanh"), "mlp"),
        (dict(norm="batchnorm"), "norm"),
        (dict(n_kv_head=3), "n_kv_head"),
        (dict(n_layer=0), "positive"),
        (dict(skip_attn_layers=(4,)), "skip_attn_layers"),
        (dict(n_head=16, pos_emb="rope", rope_truncate=True), "rope_truncate"),
        (dict(n_value_embeds=1, skip_attn_layers=(0, 3)), "value embedding 0"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**BASE, **kwargs})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn_backend="xformers"), "GPTExecution.attn_backend"),
        (dict(loss_impl="liger"), "GPTExecution.loss_impl"),
        (dict(loss_chunk_size=0), "GPTExecution.loss_chunk_size"),
    ],
)
def test_execution_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTExecution(**kwargs)


def test_execution_is_not_architecture():
    """Execution settings are not GPTConfig fields: a model config that holds them is refused naming where they
    belong; keys that are no field at all are refused too."""
    with pytest.raises(TypeError):
        GPTConfig(**BASE, loss_impl="chunked")
    config = GPTConfig(**BASE).to_dict()
    assert GPTConfig.from_dict(config) == GPTConfig(**BASE)
    with pytest.raises(ValueError, match=r"execution settings \['attn_backend', 'loss_impl'\].*model\.execution"):
        GPTConfig.from_dict({**config, "loss_impl": "chunked", "attn_backend": "sdpa"})
    with pytest.raises(ValueError, match=r"no field\(s\) \['moe_experts'\]"):
        GPTConfig.from_dict({**config, "moe_experts": 0})
    with pytest.raises(ValueError, match="no field"):
        GPTConfig.from_dict({**config, "flux_capacitor": 1})
    with pytest.raises(ValueError, match="no field"):
        GPTExecution.from_dict({"n_layer": 2})


def test_sequence_too_long():
    model = GPT(GPTConfig(**BASE))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 40, dtype=torch.long))


def test_num_params_gpt2_small():
    model = GPT(GPTConfig())  # GPT-2 124M
    total = model.num_params(non_embedding=False) + 0
    assert 124_000_000 < total < 125_000_000


@pytest.mark.parametrize("extra", [dict(logit_softcap=30.0, tie_embeddings=False), dict()])
def test_chunked_loss_matches_torch_loss(extra):
    torch.manual_seed(0)
    base = GPT(GPTConfig(**BASE, **extra))
    chunked = GPT(GPTConfig(**BASE, **extra), GPTExecution(loss_impl="chunked", loss_chunk_size=7))
    chunked.load_state_dict(base.state_dict())
    x = torch.randint(0, 300, (2, 16))
    y = x.roll(-1, 1)
    a, b = base(x, y), chunked(x, y)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    a.backward()
    b.backward()
    for (name, pa), pb in zip(base.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_grad_checkpoint_same_gradients():
    torch.manual_seed(0)
    cfg = dict(**BASE, pos_emb="rope", norm="rmsnorm", unet_skips=True, n_value_embeds=1)
    base = GPT(GPTConfig(**cfg))
    ckpt = GPT(GPTConfig(**cfg), GPTExecution(grad_checkpoint=True))
    ckpt.load_state_dict(base.state_dict())
    x = torch.randint(0, 300, (2, 16))
    base(x, x).backward()
    ckpt(x, x).backward()
    for (name, pa), pb in zip(base.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_fp8_loss_trains():
    from tests.ops.test_cross_entropy import _fp8_supported

    if not _fp8_supported():
        pytest.skip("torch._scaled_mm (fp8) not available")
    torch.manual_seed(0)
    cfg = dict(**BASE, vocab_multiple=128, logit_softcap=30.0, tie_embeddings=False)
    ref = GPT(GPTConfig(**cfg))
    fp8 = GPT(GPTConfig(**cfg), GPTExecution(loss_impl="chunked_fp8", loss_chunk_size=16))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randint(0, 300, (2, 16))
    a, b = ref(x, x.roll(-1, 1)), fp8(x, x.roll(-1, 1))
    assert abs(a.item() - b.item()) / a.item() < 0.03
    b.backward()
    assert fp8.lm_head.weight.grad is not None and torch.isfinite(fp8.lm_head.weight.grad).all()


@pytest.mark.parametrize("loss_impl", ["torch", "chunked"])
def test_speedrun_model_traces_without_graph_breaks(loss_impl):
    """torch.compile sees one graph: no import probes, .item() or data-dependent shapes in forward + loss."""
    import torch._dynamo

    cfg = GPTConfig(**{**BASE, "n_layer": 2}, vocab_multiple=128, pos_emb="rope", norm="rmsnorm", bias=False,
                    qk_norm=True, mlp="relu2", tie_embeddings=False, zero_init_proj=True, logit_softcap=30.0,
                    n_value_embeds=1, unet_skips=True,
                    x0_mix=True, embed_norm=True, rope_truncate=True, skip_attn_layers=(1,))
    model = GPT(cfg, GPTExecution(loss_impl=loss_impl, loss_chunk_size=16))
    x = torch.randint(0, 300, (2, 16))
    try:
        explained = torch._dynamo.explain(model)(x, x.roll(-1, 1))
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_every_parameter_gets_a_gradient_in_the_speedrun_config():
    """DDP (without find_unused_parameters) needs a gradient for every trainable parameter after backward."""
    cfg = GPTConfig(**{**BASE, "n_layer": 6}, vocab_multiple=128, pos_emb="rope", norm="rmsnorm", bias=False,
                    qk_norm=True, mlp="relu2", tie_embeddings=False, zero_init_proj=True, logit_softcap=30.0,
                    n_value_embeds=2, unet_skips=True, x0_mix=True, embed_norm=True, skip_attn_layers=(3,))
    model = GPT(cfg)
    x = torch.randint(0, 300, (2, 16))
    model(x, x.roll(-1, 1)).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    # value-embedding mixes exist exactly in the layers that get a value embedding (first 2, last 2)
    assert [b.attn is not None and b.attn.ve_lambda is not None for b in model.blocks] == [
        True, True, False, False, True, True]
    assert model.blocks[3].attn is None and model.blocks[3].ln_1 is None


def test_x0_mix_starts_as_the_plain_residual_stream():
    """At init (a=1, b=0) the x0 mix changes nothing; the gradient still reaches b."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**BASE, norm="rmsnorm", bias=False))
    mixed = GPT(GPTConfig(**BASE, norm="rmsnorm", bias=False, x0_mix=True))
    missing, unexpected = mixed.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("x0_lambdas" in k for k in missing)
    x = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(mixed(x), plain(x))
    mixed(x, x.roll(-1, 1)).backward()
    assert all(b.x0_lambdas.grad[1].abs() > 0 for b in mixed.blocks)


def test_embed_norm_and_skipped_attention():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BASE, norm="rmsnorm", bias=False, embed_norm=True, skip_attn_layers=(0, 2)))
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    model(torch.randint(0, 300, (2, 16)))
    rms = seen["x"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=1e-3)
    assert [b.attn is None for b in model.blocks] == [True, False, True, False]
    full = GPT(GPTConfig(**BASE, norm="rmsnorm", bias=False))
    per_attn = sum(p.numel() for p in full.blocks[0].attn.parameters()) + full.config.n_embd
    assert full.num_params() - model.num_params() == 2 * per_attn


def test_norms_without_weights_are_plain_normalisation():
    """norm_weight=False: no norm parameter anywhere (block norms, final norm, QK-norm); every norm output of
    an RMS-normalised model is a unit-RMS row (the bound the FP8 input scales rely on); the loss still trains."""
    torch.manual_seed(0)
    cfg = dict(**BASE, norm="rmsnorm", bias=False, qk_norm=True, norm_weight=False)
    model = GPT(GPTConfig(**cfg))
    with_w = GPT(GPTConfig(**{**cfg, "norm_weight": True}))
    norms = [m for m in with_w.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * 2 + 4 * 2 + 1  # ln_1, ln_2, q_norm, k_norm per block; ln_f
    assert model.num_params() == with_w.num_params() - sum(p.numel() for m in norms for p in m.parameters())
    assert all(m.weight is None for m in model.modules() if isinstance(m, RMSNorm))
    seen = []
    model.blocks[1].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randint(0, 300, (2, 16))
    model(x)
    rms = seen[0].pow(2).mean(-1).sqrt()  # 1 up to the eps in the denominator (a small residual stream at init)
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=2e-2, rtol=0)
    assert (rms <= 1.0).all() and (seen[0].abs() <= cfg["n_embd"] ** 0.5).all()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first, last = loss_drop(model, opt, x, 20)
    assert last < first - 1.0


@pytest.mark.parametrize("where, qk_gains, block_gains", [("qk", True, False), ("blocks", False, True)])
def test_norm_gains_in_part_of_the_norms(where, qk_gains, block_gains):
    cfg = dict(**BASE, norm="rmsnorm", bias=False, qk_norm=True)
    model = GPT(GPTConfig(**cfg, norm_weight=where))
    attn = model.blocks[0].attn
    assert (attn.q_norm.weight is not None, attn.k_norm.weight is not None) == (qk_gains, qk_gains)
    assert (model.blocks[0].ln_1.weight is not None, model.ln_f.weight is not None) == (block_gains, block_gains)
    x = torch.randint(0, 300, (2, 16))
    model(x, x.roll(-1, 1)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_norm_weight_values_are_checked():
    with pytest.raises(ValueError, match="norm_weight"):
        GPTConfig(norm_weight="some")
    with pytest.raises(ValueError, match="qk_norm=True"):
        GPTConfig(norm_weight="qk")


def test_truncated_rope_leaves_half_the_pairs_unrotated():
    from lightning_opt.models.gpt2 import Rotary

    rot = Rotary(head_dim=16, max_len=8, base=1024.0, truncate=True)
    q = torch.randn(1, 1, 8, 16)
    out = rot(q)
    # pairs (i, i + 8) for i in 4..7 have frequency 0: unchanged; pair 0 has frequency 1: rotated
    torch.testing.assert_close(out[..., 4:8], q[..., 4:8])
    torch.testing.assert_close(out[..., 12:16], q[..., 12:16])
    assert not torch.allclose(out[..., 1:, 0], q[..., 1:, 0])


def test_fused_qkv_carries_muon_row_splits():
    model = GPT(GPTConfig(**BASE, n_kv_head=2))
    w = model.blocks[0].attn.c_attn.weight
    assert w.muon_row_splits == (32, 16, 16) and sum(w.muon_row_splits) == w.shape[0]


def test_window_schedule_grows_the_window_without_new_parameters():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**BASE, "block_size": 32}, pos_emb="rope", window_schedule=(4, 16))
    sdpa = GPTExecution(attn_backend="sdpa")
    model = GPT(cfg, sdpa)
    assert [model.window_at(p) for p in (0.0, 0.25, 0.5, 1.0)] == [4, 4, 8, 16]
    record = GPT(GPTConfig(**BASE, pos_emb="rope", window_schedule=(128, 1856)))
    assert record.window_at(0.0) == 128 and record.window_at(1.0) == 1792  # the speedrun's 1 -> 14 blocks
    x = torch.randint(0, 300, (2, 24))
    model.eval()
    model.set_train_progress(0.0)
    early = model(x)
    model.set_train_progress(1.0)
    assert int(model.attn_window) == 16
    late = model(x)
    # positions within the first window see the same keys either way; later ones see more
    torch.testing.assert_close(early[:, :4], late[:, :4])
    assert not torch.allclose(early[:, 20:], late[:, 20:])
    # the same as a fixed window of that size
    fixed = GPT(GPTConfig(**{**BASE, "block_size": 32}, pos_emb="rope", window_size=16), sdpa)
    weights = {k: v for k, v in model.state_dict().items() if k != "attn_window"}
    fixed.load_state_dict(weights)
    fixed.eval()
    torch.testing.assert_close(fixed(x), late)
    # the window is part of the state: a restored model evaluates with the window it was trained to
    restored = GPT(cfg, sdpa)
    restored.load_state_dict(model.state_dict())
    assert int(restored.attn_window) == 16
    restored.eval()
    torch.testing.assert_close(restored(x), late)
    with pytest.raises(ValueError, match="window_schedule"):
        GPTConfig(**BASE, window_schedule=(16, 4))
    with pytest.raises(ValueError, match="window_schedule"):
        GPT(GPTConfig(**BASE, window_schedule=(4, 16)), GPTExecution(attn_backend="flash"))


def test_flex_backend_model_trains_on_cpu_with_documents():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**BASE, "block_size": 256}, pos_emb="rope", norm="rmsnorm", bias=False,
                    doc_causal=True, eot_token=0, window_schedule=(32, 128))
    model = GPT(cfg, GPTExecution(attn_backend="flex"))
    ref = GPT(GPTConfig(**{**BASE, "block_size": 256}, pos_emb="rope", norm="rmsnorm", bias=False,
                        doc_causal=True, eot_token=0, window_size=32), GPTExecution(attn_backend="math"))
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k != "attn_window"})
    x = torch.randint(1, 300, (1, 256))
    x[0, 100] = 0
    loss = model(x, x.roll(-1, 1))
    torch.testing.assert_close(loss, ref(x, x.roll(-1, 1)), atol=1e-5, rtol=1e-5)
    loss.backward()
    assert model.blocks[0].attn.c_attn.weight.grad is not None


@pytest.mark.parametrize("autocast", [False, True])
def test_fp8_projections_return_the_dtype_the_plain_layer_would(autocast):
    """FP8 attention and MLP projections with value embeddings, in float32 and under bf16 autocast: the
    projections hand back what ``nn.Linear`` would (float32 without autocast), so q/k meet a float32 v."""
    from tests.ops.test_cross_entropy import _fp8_supported

    if not _fp8_supported():
        pytest.skip("torch._scaled_mm (fp8) not available")
    import yaml

    from lightning_opt.recipes import CONFIGS

    torch.manual_seed(0)
    raw = yaml.safe_load((CONFIGS / "gpt2" / "gpt2-124m-speedrun.yaml").read_text())["model"]["model_config"]
    raw.update(n_layer=6, n_head=2, n_embd=64, block_size=16, vocab_size=64, vocab_multiple=1, skip_attn_layers=[3],
               eot_token=0)  # documents split by token 0 of the tiny vocabulary
    cfg = GPTConfig(**raw)  # the speedrun architecture (value embeddings, x0 mixing) at a tiny size
    ref = GPT(cfg)
    fp8 = GPT(cfg, GPTExecution(attn_fp8=True, mlp_fp8=True))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a, b = ref(x, x.roll(-1, 1)), fp8(x, x.roll(-1, 1))
    b.backward()
    assert torch.isfinite(b) and abs(a.item() - b.item()) < 0.05 * a.item()
    assert fp8.blocks[0].attn.c_attn.weight.grad is not None
