"""Stochastic depth (GPTExecution.layer_drop) and checkpointing the first N blocks (GPTExecution.grad_checkpoint=N)."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution

BASE = dict(vocab_size=300, n_layer=4, n_head=4, n_embd=32, block_size=32, pos_emb="rope", norm="rmsnorm")


def _pair(arch: dict | None = None, **extra) -> tuple[GPT, GPT]:
    """A model and the same weights under ``extra`` settings (``arch``: architecture options for both)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(**BASE, **(arch or {})))
    other = GPT(GPTConfig(**BASE, **(arch or {})), GPTExecution(**extra))
    other.load_state_dict(base.state_dict())
    return base, other


def test_layer_drop_zero_changes_nothing_and_draws_nothing():
    base, same = _pair(layer_drop=0.0)
    x = torch.randint(0, 300, (2, 16))
    state = torch.random.get_rng_state()
    torch.testing.assert_close(same.train()(x), base.train()(x), rtol=0, atol=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # no draw at layer_drop=0


def test_layer_drop_eval_runs_every_block_deterministically():
    base, dropped = _pair(dict(unet_skips=True), layer_drop=0.5)
    x = torch.randint(0, 300, (2, 16))
    base.eval()
    dropped.eval()
    first = dropped(x)
    torch.testing.assert_close(dropped(x), first, rtol=0, atol=0)
    torch.testing.assert_close(first, base(x), rtol=0, atol=0)


def test_layer_drop_training_skips_blocks_at_the_configured_rates():
    cfg, ex = GPTConfig(**BASE), GPTExecution(layer_drop=0.6)
    model = GPT(cfg, ex).train()
    model.layer_drop_generator = torch.Generator().manual_seed(1234)
    runs = [0] * cfg.n_layer
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    n = 1500
    x = torch.randint(0, 300, (1, 4))
    with torch.no_grad():
        for _ in range(n):
            model(x)
    expected = [1 - ex.layer_drop_prob(i, cfg.n_layer) for i in range(cfg.n_layer)]
    assert expected == pytest.approx([0.85, 0.7, 0.55, 0.4])
    rates = [r / n for r in runs]
    for rate, want in zip(rates, expected):
        assert abs(rate - want) < 4 * (want * (1 - want) / n) ** 0.5, (rates, expected)


def test_layer_drop_scales_a_kept_block_and_skipped_blocks_get_no_gradient():
    torch.manual_seed(0)
    cfg, ex = GPTConfig(**BASE), GPTExecution(layer_drop=0.7)
    model = GPT(cfg, ex).train()
    model.layer_drop_generator = torch.Generator().manual_seed(5)
    draws = torch.rand(cfg.n_layer, generator=torch.Generator().manual_seed(5)).tolist()
    kept = [d >= ex.layer_drop_prob(i, cfg.n_layer) for i, d in enumerate(draws)]
    assert any(kept) and not all(kept)  # this seed both keeps and skips
    x = torch.randint(0, 300, (2, 16))
    got = model(x)
    with torch.no_grad():
        h = model.wte(x)
        for i, block in enumerate(model.blocks):
            if kept[i]:
                h = h + (block(h) - h) / (1 - ex.layer_drop_prob(i, cfg.n_layer))
        want = model.lm_head(model.ln_f(h))[..., : cfg.vocab_size]
    torch.testing.assert_close(got, want)
    got.float().square().mean().backward()
    for i, block in enumerate(model.blocks):
        has_grad = block.mlp.c_fc.weight.grad is not None
        assert has_grad == kept[i]


def test_layer_drop_is_checked():
    with pytest.raises(ValueError, match="layer_drop"):
        GPTExecution(layer_drop=1.0)


def _saved_bytes_and_grads(model: GPT, x: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x.roll(-1, 1))
    loss.backward()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_the_first_n_blocks_same_gradients_fewer_saved_activations():
    x = torch.randint(0, 300, (2, 32))
    settings = (False, 1, 2, 3, 4, True)  # a list, not dict keys: True == 1 as a key
    results = [_saved_bytes_and_grads(_pair(dict(unet_skips=True, n_value_embeds=1), grad_checkpoint=ckpt)[1].train(), x)
               for ckpt in settings]
    ref_grads = results[0][1]
    for ckpt, (_, grads) in zip(settings, results):
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=f"{ckpt} {name}")
    saved = [b for b, _ in results]
    assert saved[0] > saved[1] > saved[2] > saved[3] > saved[4], saved
    assert saved[5] == saved[4]  # True is every block
    per_block = saved[0] - saved[1]
    # each checkpointed block saves about the same (its activations; a few scalars differ)
    assert [saved[0] - b for b in saved[:5]] == pytest.approx([n * per_block for n in range(5)], rel=1e-3)
    assert GPTExecution(grad_checkpoint=True).checkpointed_blocks(4) == 4
    assert GPTExecution(grad_checkpoint=False).checkpointed_blocks(4) == 0
    assert GPTExecution(grad_checkpoint=3).checkpointed_blocks(4) == 3


@pytest.mark.parametrize("value", [5, -1])
def test_grad_checkpoint_block_count_is_checked(value):
    with pytest.raises(ValueError, match="grad_checkpoint"):
        GPT(GPTConfig(**BASE), GPTExecution(grad_checkpoint=value))
