"""Fine-tuning from Hugging Face GPT-2 files through the recipe, then sampling from its checkpoint."""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.models.gpt2 import GPT, GPTConfig, GPTExecution
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
from lightning_opt.recipes import CONFIGS

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
SHRINK = [  # the fine-tuning config at the tiny HF model's shape, on the built-in (byte-level) corpus
    "--config", str(CONFIGS / "gpt2/finetune-hf-gpt2.yaml"),
    *[a for k, v in SHAPE.items() for a in (f"--model.model_config.{k}", str(v))],
    "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
    "--data.seq_len", "64", "--data.batch_size", "8", "--data.val_tokens", "4096",
]


def _load(name: str):
    return importlib.import_module(f"lightning_opt.recipes.{name}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=128,
                                     bos_token_id=255, eos_token_id=255)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("hf-gpt2")
    model.save_pretrained(path)
    return path, model


def _hf_val_loss(model) -> float:
    """The HF model's mean next-token loss on the recipe's validation windows."""
    data = TokenShardDataModule("builtin", "builtin", seq_len=64, batch_size=8, val_tokens=4096)
    total = count = 0.0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            logits = model(x).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


def test_init_from_loads_the_hf_weights(hf_dir):
    path, hf = hf_dir
    module = GPT2SpeedrunModule(model_config=GPTConfig(**SHAPE), execution=GPTExecution(dropout=0.1),
                                init_from=str(path))
    module.setup("fit")
    expected = GPT.from_hf(hf).state_dict()
    expected["wpe.weight"] = expected["wpe.weight"][:64]  # block_size 64 keeps the first of the 128 positions
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    x = torch.randint(0, 256, (2, 64))
    torch.testing.assert_close(module.model.eval()(x), hf(x).logits, atol=1e-5, rtol=1e-5)
    module.model.load_state_dict(GPT(GPTConfig(**SHAPE)).state_dict())
    module.setup("validate")  # a second setup (validation after fit) keeps the trained weights
    assert not torch.equal(module.model.wte.weight, hf.transformer.wte.weight)


def test_init_from_refuses_a_mismatched_config(hf_dir, tmp_path):
    path, _ = hf_dir
    with pytest.raises(ValueError, match=r"n_layer: 2 \(not 3\).*pos_emb: 'learned' \(not 'rope'\)"):
        GPT.from_pretrained(path, GPTConfig(**{**SHAPE, "n_layer": 3}, pos_emb="rope"))
    with pytest.raises(ValueError, match="vocab_multiple: 1"):
        GPT.from_pretrained(path, GPTConfig(**SHAPE, vocab_multiple=100))  # 300 head rows
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT.from_pretrained(tmp_path)


def test_finetune_from_hf_then_sample(hf_dir, tmp_path, monkeypatch, capsys):
    path, hf = hf_dir
    recipe = _load("gpt2")
    monkeypatch.chdir(tmp_path)
    # no training steps (a recipe run refuses max_steps 0): the recipe's CLI validates the model it starts from
    from lightning_opt.cli import build_recipe_cli

    cli, _ = build_recipe_cli(GPT2SpeedrunModule, TokenShardDataModule, [
        *SHRINK, "--model.init_from", str(path), "--trainer.logger", "false",
        "--trainer.default_root_dir", str(tmp_path / "start")], cli_class=recipe.GPT2RecipeCLI)
    (start,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False, weights_only=True)
    assert start["val/loss"] == pytest.approx(_hf_val_loss(hf), rel=1e-5)

    tuned = recipe.main([*SHRINK, "--model.init_from", str(path), "--trainer.max_steps", "40",
                         "--trainer.val_check_interval", "20", "--model.optim.lr", "3e-3",
                         "--model.schedule.warmup_steps", "0"])
    history = [row["val_loss"] for row in tuned["val_history"]]
    assert len(history) == 2 and history[-1] < history[0] < start["val/loss"]

    ckpt = next((tmp_path / "runs").rglob("*.ckpt"))
    capsys.readouterr()
    texts = _load("sample").main(["--ckpt_path", str(ckpt), "--prompt", "The ", "--max_new_tokens", "24",
                                  "--temperature", "0.8", "--top_k", "20", "--seed", "1", "--num_samples", "2"])
    assert len(texts) == 2 and all(t.startswith("The ") and len(t) > len("The ") for t in texts)
    assert capsys.readouterr().out.count("--- sample") == 2
    again = _load("sample").main(["--ckpt_path", str(tmp_path / "runs"), "--prompt", "The ", "--max_new_tokens", "24",
                                  "--temperature", "0.8", "--top_k", "20", "--seed", "1", "--num_samples", "2"])
    assert again == texts  # the seed fixes the samples; a run directory names its newest checkpoint

    # the checkpoint's weights: 40 small steps from the HF ones
    module = GPT2SpeedrunModule.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    moved = (module.model.wte.weight - hf.transformer.wte.weight).abs().max()
    assert 0 < moved < 40 * 3e-3 * 1.5  # AdamW moves an element at most about lr per step


def test_sample_refuses_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _load("sample").main(["--ckpt_path", str(tmp_path / "none.ckpt"), "--prompt", "x"])
