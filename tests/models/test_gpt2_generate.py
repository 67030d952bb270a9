"""GPT.generate and the KV cache: cached decoding equals recomputing the full forward pass every step."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution, KVCache, sample_next

TINY = dict(vocab_size=300, n_layer=4, n_head=4, n_embd=32, block_size=24)
CONFIGS = {
    "classic": {},
    # the speedrun recipe's architecture (lightning_opt/recipes/configs/gpt2/gpt2-124m-speedrun.yaml) at tiny size
    "speedrun": dict(vocab_multiple=128, pos_emb="rope", rope_base=1024.0, rope_truncate=True, norm="rmsnorm",
                     bias=False, qk_norm=True, mlp="relu2", tie_embeddings=False, zero_init_proj=True,
                     logit_softcap=15.0, n_value_embeds=1, unet_skips=True, x0_mix=True, embed_norm=True,
                     skip_attn_layers=(2,)),
    "gqa_window_docs": dict(n_kv_head=2, window_size=5, doc_causal=True, eot_token=7, pos_emb="rope"),
    "window_schedule_swiglu": dict(window_schedule=(4, 12), mlp="swiglu", n_value_embeds=2),
}


def _model(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **CONFIGS[name])).eval()
    with torch.no_grad():  # zero-initialised projections would make every logit equal: use random weights
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1)
    return model


def _prompt(batch: int = 2, length: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (batch, length), generator=g)
    if length > 2:
        prompt[0, 2] = 7  # a document separator for the doc_causal config
    return prompt


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_greedy_equals_recomputed(name):
    """Past block_size (6 + 30 > 24) the cached path recomputes the last block_size tokens, like the reference."""
    model = _model(name)
    prompt = _prompt()
    cached = model.generate(prompt, 30, greedy=True)
    recomputed = model.generate(prompt, 30, greedy=True, use_cache=False)
    assert cached.shape == (2, 36)
    assert torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, recomputed)
    assert len(set(cached[:, 6:].flatten().tolist())) > 3  # a real continuation, not one repeated token


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_logits_match_full_forward_each_step(name):
    """Prefill, then chunks of 1 and 3 tokens: each position's logits equal the full forward's within 1e-5."""
    model = _model(name)
    seq = torch.cat([_prompt(), torch.randint(0, 300, (2, 14), generator=torch.Generator().manual_seed(2))], 1)
    seq[1, 9] = 7
    full = model(seq)
    cache = KVCache(model, batch_size=2, max_len=seq.shape[1])
    pieces = [(0, 6)] + [(t, t + 1) for t in range(6, 14)] + [(14, 17), (17, 20)]
    with torch.no_grad():
        for a, b in pieces:
            step = model(seq[:, a:b], kv_cache=cache)
            torch.testing.assert_close(step, full[:, a:b], atol=1e-5, rtol=0)
    assert cache.length == 20


def test_cache_refuses_overflow_batch_mismatch_and_targets():
    model = _model("classic")
    cache = KVCache(model, batch_size=2, max_len=8)
    model(_prompt(2, 6), kv_cache=cache)
    with pytest.raises(ValueError, match="do not fit"):
        model(_prompt(2, 3), kv_cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequences"):
        model(_prompt(1, 1), kv_cache=cache)
    with pytest.raises(ValueError, match="targets"):
        model(_prompt(2, 1), _prompt(2, 1), kv_cache=cache)
    with pytest.raises(ValueError, match="block_size"):
        KVCache(model, batch_size=1, max_len=25)


def test_temperature_zero_and_greedy_are_argmax():
    model = _model("speedrun")
    prompt = _prompt()
    greedy = model.generate(prompt, 5, greedy=True)
    assert torch.equal(model.generate(prompt, 5, temperature=0.0), greedy)
    # top_k=1 sampling has one token to draw: the argmax
    assert torch.equal(model.generate(prompt, 5, top_k=1, generator=torch.Generator().manual_seed(0)), greedy)
    first = model(prompt)[:, -1].argmax(-1)
    assert torch.equal(greedy[:, 6], first)


def test_top_k_and_top_p_sample_only_the_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    top_k = sample_next(logits, temperature=5.0, top_k=3, generator=g)
    assert set(top_k.tolist()) == {0, 1, 2}  # a high temperature spreads the draws over all three
    probs = logits[0].softmax(-1)  # [0.64, 0.23, 0.09, ...]: 0.64 < 0.8 <= 0.64 + 0.23
    assert probs[0] < 0.8 <= probs[:2].sum()
    top_p = sample_next(logits, top_p=0.8, generator=g)
    assert set(top_p.tolist()) == {0, 1}
    both = sample_next(logits, temperature=100.0, top_k=4, top_p=0.6, generator=g)
    assert set(both.tolist()) == {0, 1, 2}  # at T=100 the top 4 are near-uniform: 3 of them reach 0.6
    everything = sample_next(logits, temperature=100.0, generator=g)
    assert set(everything.tolist()) == set(range(6))
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        sample_next(logits, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)


def test_sampling_is_reproducible_and_stays_in_top_k():
    model = _model("classic")
    prompt = _prompt()
    a = model.generate(prompt, 12, temperature=1.5, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 12, temperature=1.5, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    for t in range(6, 18):  # each sampled token is among the 5 most likely after its context
        allowed = model(a[:, max(0, t - 24) : t])[:, -1].topk(5).indices
        assert (allowed == a[:, t : t + 1]).any(-1).all()


def test_eos_stops_and_pads():
    model = _model("classic")
    prompt = _prompt()
    free = model.generate(prompt, 10, greedy=True)
    eos = int(free[0, 8])  # the third token sequence 0 produces; sequence 1 never produces it
    assert not (free[1, 6:] == eos).any() and not (free[0, 6:8] == eos).any()
    out = model.generate(prompt, 10, greedy=True, eos_token=eos)
    assert out.shape == free.shape  # sequence 1 goes on to the end
    assert torch.equal(out[0, :9], free[0, :9]) and (out[0, 9:] == eos).all()  # sequence 0 is padded with eos
    assert torch.equal(out[1], free[1])
    alone = model.generate(prompt[:1], 10, greedy=True, eos_token=eos)
    assert torch.equal(alone, free[:1, :9])  # every sequence stopped: generation ends


def test_generate_restores_training_mode_and_ignores_dropout():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY), GPTExecution(dropout=0.5)).train()
    x = _prompt()
    assert not torch.equal(model(x), model(x))  # dropout is on in training
    out1 = model.generate(x, 4, greedy=True)
    out2 = model.generate(x, 4, greedy=True)
    assert torch.equal(out1, out2) and model.training
    model.eval()
    assert torch.equal(model(x), model(x))


def test_dropout_is_validated():
    with pytest.raises(ValueError, match="dropout"):
        GPTExecution(dropout=1.0)
    with pytest.raises(ValueError, match="attn_backend"):
        GPTExecution(dropout=0.1, attn_backend="flex")
