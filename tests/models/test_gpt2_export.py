"""GPT.save_pretrained: a Hugging Face GPT-2 folder that transformers loads with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=32)


def _trained_looking(model: GPT) -> GPT:
    # non-default values everywhere (biases and LayerNorm gains start at 0 and 1): a transposed or
    # swapped tensor shows in the logits
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def test_classic_export_loads_in_transformers_with_the_same_logits(tmp_path):
    model = _trained_looking(GPT(GPTConfig(**TINY)))
    out = model.save_pretrained(tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.randint(0, TINY["vocab_size"], (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert theirs.shape == ours.shape == (3, 32, TINY["vocab_size"])
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # and back: from_pretrained reads the folder into the same model
    again = GPT.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(idx), ours, rtol=0, atol=0)


def test_padded_vocab_exports_the_real_rows(tmp_path):
    model = _trained_looking(GPT(GPTConfig(**TINY, vocab_multiple=64)))
    out = model.save_pretrained(tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == TINY["vocab_size"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    idx = torch.arange(32).view(1, 32) % TINY["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=1e-4, atol=1e-4)


def test_speedrun_architecture_is_refused_naming_the_fields(tmp_path):
    cfg = GPTConfig(**{**TINY, "vocab_size": 256}, pos_emb="rope", norm="rmsnorm", bias=False, qk_norm=True,
                    mlp="relu2", tie_embeddings=False, logit_softcap=30.0)
    with pytest.raises(ValueError, match="cannot represent") as info:
        GPT(cfg).save_pretrained(tmp_path / "hf")
    for field in ("pos_emb='rope'", "norm='rmsnorm'", "mlp='relu2'", "tie_embeddings=False", "gpt2-124m-classic"):
        assert field in str(info.value)
    assert not (tmp_path / "hf").exists()  # nothing half-written
