"""The classic GPT-2 (tied head, no soft-cap, padded vocabulary) trains the same with ``loss_impl="fused"`` as with
``loss_impl="torch"``: the same loss and the same gradients, the padded head rows included."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution
from lightning_opt.ops import softcap_ce

# the classic recipe's architecture, shrunk: 300 real tokens padded to 320 head/embedding rows
CLASSIC = dict(vocab_size=300, vocab_multiple=64, n_layer=2, n_head=2, n_embd=32, block_size=32)
INTERPRETED = getattr(softcap_ce, "_softcap_ce_kernel", None).__class__.__name__ == "InterpretedFunction"


def _pair(loss_impl: str = "fused") -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    cfg = GPTConfig(**CLASSIC)
    assert cfg.tie_embeddings and cfg.logit_softcap is None and cfg.padded_vocab_size == 320
    fused = GPT(cfg, GPTExecution(loss_impl=loss_impl))
    ref = GPT(cfg, GPTExecution(loss_impl="torch"))
    ref.load_state_dict(fused.state_dict())
    assert fused.lm_head.weight is fused.wte.weight
    return fused, ref


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 300, (3, 24), generator=g)
    y = x.roll(-1, 1)
    y[1, 5] = -100  # ignored: in neither the mean nor the gradient
    return x, y


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernel", [False, True])
def test_fused_loss_matches_torch_loss_for_the_tied_classic_model(kernel, monkeypatch):
    """float32: the loss and every parameter's gradient, through the torch form of the fused loss and through
    its Triton kernel (Triton's interpreter on CPU)."""
    if kernel:
        if not INTERPRETED:
            pytest.skip("needs triton with TRITON_INTERPRET=1 at import")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setattr(softcap_ce, "kernel_available", lambda x: False)
    fused, ref = _pair()
    x, y = _batch()
    a, b = fused(x, y), ref(x, y)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    a.backward()
    b.backward()
    ga, gb = _grads(fused), _grads(ref)
    assert ga.keys() == gb.keys() and "lm_head.weight" not in ga  # tied: one parameter for embedding and head
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-6, rtol=1e-4, msg=name)
    # the padded rows (tokens 300..319) are head rows like any other: they join the softmax and get a gradient
    pad = ga["wte.weight"][300:]
    assert pad.abs().sum() > 0
    torch.testing.assert_close(pad, gb["wte.weight"][300:], atol=1e-6, rtol=1e-4)
    with torch.no_grad():  # evaluation: the same loss without the gradient sweep
        torch.testing.assert_close(fused(x, y), ref(x, y), atol=1e-5, rtol=1e-5)


def test_fused_loss_matches_torch_loss_under_bf16_autocast():
    """As the recipe trains (bf16-mixed): the head matmul in bfloat16 either way, the loss and its logit gradient
    in float32; the two differ only by bfloat16 rounding."""
    fused, ref = _pair()
    x, y = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fused(x, y), ref(x, y)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)
    a.backward()
    b.backward()
    ga, gb = _grads(fused), _grads(ref)
    for name in ("wte.weight", "wpe.weight", "blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_fc.bias", "ln_f.weight"):
        scale = gb[name].abs().max()
        assert (ga[name] - gb[name]).abs().max() <= 0.03 * scale, name


def test_classic_configs_ship_the_fused_loss():
    """The classic pretraining and Hugging Face fine-tuning configs train with the fused loss."""
    import yaml

    from lightning_opt.recipes import CONFIGS

    for name in ("gpt2-124m-classic", "finetune-hf-gpt2"):
        model = yaml.safe_load((CONFIGS / "gpt2" / f"{name}.yaml").read_text())["model"]
        assert model["execution"]["loss_impl"] == "fused", name
        assert model["model_config"].get("logit_softcap") is None, name
