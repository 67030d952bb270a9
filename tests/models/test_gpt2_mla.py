"""Multi-latent attention (GPTConfig.attention="mla"): shapes, training, cached generation equal to recomputation,
a KV cache of latents whose size is what kv_cache_bytes_per_token says, FLOP/parameter accounting, checkpoints."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution, KVCache, MultiLatentAttention
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
from lightning_opt.optim.factory import OptimConfig

TINY = dict(vocab_size=300, n_layer=4, n_head=4, n_embd=32, block_size=24, attention="mla", mla_kv_rank=12,
            mla_rope_dim=4)
CONFIGS = {
    "plain": {},
    "speedrun": dict(vocab_multiple=128, pos_emb="rope", rope_base=1024.0, rope_truncate=True, norm="rmsnorm",
                     bias=False, qk_norm=True, mlp="relu2", tie_embeddings=False, zero_init_proj=True,
                     logit_softcap=15.0, unet_skips=True, x0_mix=True, embed_norm=True, skip_attn_layers=(2,),
                     mla_q_rank=16),
    "no_rope_part": dict(mla_rope_dim=0),
    "window_docs": dict(window_size=5, doc_causal=True, eot_token=7, pos_emb="rope"),
    "window_schedule_swiglu": dict(window_schedule=(4, 12), pos_emb="rope", mlp="swiglu", mla_q_rank=16),
}


def _model(name: str, **over) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **CONFIGS[name], **over})).eval()
    with torch.no_grad():  # zero-initialised projections would make every logit equal: use random weights
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1)
    return model


def _seq(batch: int = 2, length: int = 20) -> torch.Tensor:
    seq = torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(1))
    seq[0, 2] = 7  # document separators for the doc_causal config
    if length > 9:
        seq[1, 9] = 7
    return seq


def test_shapes_and_parameters():
    cfg = GPTConfig(**{**TINY, "mla_q_rank": 16})
    attn = MultiLatentAttention(cfg, 0, GPTExecution())
    d, h, r, rd, hd = 32, 4, 12, 4, 8
    x = torch.randn(2, 5, d)
    c_kv, k_rope = attn.kv_down(x).split([r, rd], dim=-1)
    k, v = attn.keys_values(attn.kv_norm(c_kv), k_rope)
    assert k.shape == v.shape == (2, h, 5, hd)
    # every head's rope part is the same shared key (rotated), the rest comes from the latent
    assert torch.equal(k[:, 0, :, hd - rd :], k[:, 3, :, hd - rd :])
    assert not torch.equal(k[:, 0, :, : hd - rd], k[:, 3, :, : hd - rd])
    assert attn(x).shape == (2, 5, d)
    weights = {n: tuple(p.shape) for n, p in attn.named_parameters() if p.ndim == 2}
    assert weights == {"q_down.weight": (16, d), "q_proj.weight": (d, 16), "kv_down.weight": (r + rd, d),
                       "kv_up.weight": (h * (hd - rd + hd), r), "c_proj.weight": (d, d)}
    for name in ("kv_down", "kv_up"):  # Muon's row blocks cover the fused rows
        w = getattr(attn, name).weight
        assert sum(w.muon_row_splits) == w.shape[0]
    model = GPT(cfg)
    assert model(torch.zeros(3, 7, dtype=torch.long)).shape == (3, 7, 300)


@pytest.mark.parametrize(("over", "match"), [
    (dict(attention="gqa"), "attention"),
    (dict(n_kv_head=2), "n_kv_head"),
    (dict(mla_kv_rank=0), "mla_kv_rank"),
    (dict(mla_q_rank=0), "mla_q_rank"),
    (dict(mla_rope_dim=3), "mla_rope_dim"),
    (dict(mla_rope_dim=8), "mla_rope_dim"),
    (dict(mla_rope_dim=0, pos_emb="rope"), "pos_emb='rope' needs mla_rope_dim"),
    (dict(rope_truncate=True, mla_rope_dim=6), "rope_truncate"),
    (dict(n_value_embeds=1), "n_value_embeds"),
])
def test_config_refuses_what_mla_cannot_do(over, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **over})


def test_execution_refuses_what_mla_cannot_do():
    with pytest.raises(ValueError, match="attn_fp8"):
        GPT(GPTConfig(**TINY), GPTExecution(attn_fp8=True))


def test_tiny_mla_model_trains_on_cpu():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, "pos_emb": "rope", "mla_q_rank": 16}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    seq = (torch.randint(0, 300, (16, 1), generator=g) + torch.arange(17)) % 300  # counting: learnable
    losses = []
    for _ in range(40):
        loss = model(seq[:, :-1], seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"blocks.0.attn.kv_up.weight", "blocks.0.attn.kv_down.weight", "blocks.0.attn.q_down.weight"} <= grads


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_greedy_equals_recomputed(name):
    """Past block_size (6 + 30 > 24) the cached path recomputes the last block_size tokens, like the reference."""
    model = _model(name)
    prompt = _seq(2, 6)
    cached = model.generate(prompt, 30, greedy=True)
    recomputed = model.generate(prompt, 30, greedy=True, use_cache=False)
    assert torch.equal(cached, recomputed)
    assert len(set(cached[:, 6:].flatten().tolist())) > 3  # a real continuation, not one repeated token


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_logits_match_full_forward_each_step(name):
    model = _model(name)
    seq = _seq()
    full = model(seq)
    cache = KVCache(model, batch_size=2, max_len=seq.shape[1])
    with torch.no_grad():
        for a, b in [(0, 6)] + [(t, t + 1) for t in range(6, 14)] + [(14, 17), (17, 20)]:
            torch.testing.assert_close(model(seq[:, a:b], kv_cache=cache), full[:, a:b], atol=1e-5, rtol=0)
    # the cache holds the latents and rope keys only: no per-head keys or values
    assert not cache.keys and not cache.values
    n_attn = 4 - len(model.config.skip_attn_layers)
    assert len(cache.latents) == n_attn
    assert all(c.shape == (2, 20, 12) for c in cache.latents.values())
    assert all(k.shape == (2, 20, model.config.mla_rope_dim) for k in cache.rope_keys.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("over", [dict(attention="mha"), dict(attention="mha", n_kv_head=2), {},
                                  dict(skip_attn_layers=(1,))])
def test_cache_bytes_per_token_is_what_the_cache_allocates(over, dtype):
    model = GPT(GPTConfig(**{**TINY, **over})).to(dtype).eval()
    cache = KVCache(model, batch_size=3, max_len=10)
    with torch.no_grad():
        model(_seq(3, 4), kv_cache=cache)
    assert cache.nbytes() == 3 * 10 * model.kv_cache_bytes_per_token(dtype)
    per_layer = {"mha": 2 * model.config.kv_heads * 8, "mla": 12 + 4}[model.config.attention]
    assert model.kv_cache_bytes_per_token(dtype) == (4 - len(model.config.skip_attn_layers)) * per_layer * (
        4 if dtype == torch.float32 else 2)


def test_124m_shape_cache_sizes():
    """bf16 bytes per token for the benchmark's shapes: MLA (256 + 32) is 1/2.7 of GQA-4 and 1/5.3 of MHA."""
    shape = dict(n_layer=12, n_head=12, n_embd=768, pos_emb="rope")

    def per_token(**kw) -> int:
        return GPT(GPTConfig(**shape, **kw)).kv_cache_bytes_per_token(torch.bfloat16)

    assert per_token() == 12 * 2 * 768 * 2 == 36864
    assert per_token(n_kv_head=4) == 12 * 2 * 4 * 64 * 2
    assert per_token(attention="mla", mla_kv_rank=256, mla_rope_dim=32) == 12 * 288 * 2 == 6912


def test_flops_and_params_count_mla_projections():
    shape = dict(vocab_size=300, n_layer=3, n_head=4, n_embd=32, block_size=24, bias=False, pos_emb="rope")
    mha = GPT(GPTConfig(**shape))
    for q_rank in (None, 16):
        mla = GPT(GPTConfig(**shape, attention="mla", mla_kv_rank=12, mla_rope_dim=4, mla_q_rank=q_rank))
        d, h, r, rd, hd = 32, 4, 12, 4, 8
        q = d * d if q_rank is None else d * q_rank + q_rank + q_rank * d  # with the latent's norm gain
        attn = q + d * (r + rd) + r + r * h * (hd - rd + hd) + d * d  # down, norm gain, up, output
        per_layer = {n: p.numel() for n, p in mla.blocks[0].attn.named_parameters()}
        assert sum(per_layer.values()) == attn
        mha_attn = sum(p.numel() for p in mha.blocks[0].attn.parameters())
        assert mla.num_params() - mha.num_params() == 3 * (attn - mha_attn)
        # the same attention term (query/key heads keep head_dim), 6 FLOPs per projection parameter
        assert mla.flops_per_token(16) - mha.flops_per_token(16) == pytest.approx(6 * 3 * (attn - mha_attn))


def test_backends_agree_and_dropout_trains():
    """The MLA path dispatches like MHA: math and SDPA (and flex's CPU fallback) give the same output."""
    outs = {}
    seq = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(3))
    for backend in ("sdpa", "math", "flex"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**TINY, "block_size": 128, "window_size": 16}), GPTExecution(attn_backend=backend)).eval()
        outs[backend] = model(seq)
    torch.testing.assert_close(outs["math"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["flex"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY), GPTExecution(dropout=0.1)).train()
    seq = _seq()
    a, b = model(seq[:, :-1], seq[:, 1:]), model(seq[:, :-1], seq[:, 1:])
    assert a.item() != b.item()  # dropout is on in training
    a.backward()


def test_checkpoint_round_trip(tmp_path):
    cfg = GPTConfig(**{**TINY, "vocab_size": 32, "block_size": 16, "pos_emb": "rope", "mla_q_rank": 16})
    assert GPTConfig(**cfg.to_dict()) == cfg
    torch.manual_seed(0)
    module = GPT2SpeedrunModule(cfg, OptimConfig(lr=3e-3))
    seq = (torch.randint(0, 32, (16, 1), generator=torch.Generator().manual_seed(0)) + torch.arange(17)) % 32
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=8))
    path = tmp_path / "mla.ckpt"
    trainer.save_checkpoint(path)
    loaded = GPT2SpeedrunModule.load_from_checkpoint(path)
    assert loaded.model_config == cfg and loaded.model_config.attention == "mla"
    sa, sb = module.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any("kv_up" in k for k in sa)
    module.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(module(seq[:4, :-1]), loaded(seq[:4, :-1]))


def test_decoding_attends_in_latent_space_and_equals_the_up_projected_path():
    """One-token steps skip forming keys and values (the up-projections absorbed, biases included), prompts and
    QK-norm models form them; both give the same attention output."""
    model = _model("plain")  # bias=True: the key bias must drop out, the value bias pass through
    attn = model.blocks[0].attn
    # a block_size prompt (generate's refill of a full cache) forms them: both paths run in the generate tests
    assert attn.kv_up.bias is not None and attn._absorb(1) and not attn._absorb(24)
    assert not _model("speedrun").blocks[0].attn._absorb(1)
    with torch.no_grad():
        attn.kv_up.bias.normal_(0.0, 0.5)
        cache = KVCache(model, batch_size=2, max_len=9)
        cache.begin(_seq(2, 9), None, None)
        c_kv, k_rope = torch.randn(2, 9, 12), torch.randn(2, 9, 4)
        q = attn._rotate(torch.randn(2, 4, 9, 8), 0)
        latent = attn._latent_attention(q, c_kv, k_rope, cache.mask)
        k, v = attn.keys_values(c_kv, k_rope)
        torch.testing.assert_close(latent, torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=cache.mask), atol=1e-5, rtol=1e-5)
