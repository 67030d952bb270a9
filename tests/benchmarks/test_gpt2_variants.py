"""benchmarks/gpt2_variants.py: multi-token prediction and mixture-of-experts MLPs outside the library."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpt2_variants import MoE, VariantGPT, build_gpt
from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution

BASE = GPTConfig(vocab_size=300, n_layer=4, n_head=4, n_embd=32, block_size=32)


@pytest.mark.parametrize("variants", [dict(mtp_heads=2), dict(moe_experts=2, moe_top_k=1),
                                      dict(mtp_heads=1, moe_experts=3, moe_top_k=2)])
def test_variants_train_and_evaluate_with_the_plain_loss(variants):
    torch.manual_seed(0)
    model = VariantGPT(BASE, **variants)
    x = torch.randint(0, 300, (2, 16))
    y = x.roll(-1, 1)
    train_loss = model(x, y)
    train_loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "mtp" in n or "router" in n)
    model.eval()
    with torch.no_grad():
        eval_loss = model(x, y)
        plain = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(eval_loss, plain)
    assert train_loss.item() > eval_loss.item()  # the auxiliary terms are positive
    assert model.flops_per_token(16) > 0
    if variants.get("mtp_heads"):
        assert any(p is model.mtp[0][1].weight for p in model.hidden_matrices())
    if variants.get("moe_experts"):
        assert isinstance(model.blocks[0].mlp, MoE)
        assert not any(p is model.blocks[0].mlp.router.weight for p in model.hidden_matrices())


def test_chunked_loss_reaches_the_mtp_heads():
    torch.manual_seed(0)
    base = VariantGPT(BASE, mtp_heads=1)
    chunked = VariantGPT(BASE, GPTExecution(loss_impl="chunked", loss_chunk_size=7), mtp_heads=1)
    chunked.load_state_dict(base.state_dict())
    x = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(chunked(x, x.roll(-1, 1)), base(x, x.roll(-1, 1)), atol=1e-5, rtol=1e-5)


def test_variant_settings_are_checked_and_off_builds_the_library_model():
    with pytest.raises(ValueError, match="moe_experts"):
        VariantGPT(BASE, moe_experts=1)
    with pytest.raises(ValueError, match="layer_drop"):
        VariantGPT(BASE, GPTExecution(layer_drop=0.1), moe_experts=2)
    assert type(build_gpt(BASE, None, mtp_heads=0, moe_experts=0)) is GPT
    assert isinstance(build_gpt(BASE, None, mtp_heads=1), VariantGPT)
