"""Bad configuration in every recipe: wrong types and ranges, unknown names, missing optional packages.

Each case runs the recipe's ``main(args)`` as a user would (the real LightningCLI and YAML) and expects
an error that names the offending key or value and what to do, raised *before* ``Trainer.fit`` starts
(nothing trained, nothing written over); a missing package needed by a model that is only loaded in
``setup`` must be reported before the first training batch. Missing packages are simulated with ``sys.modules[name] = None``
(what ``import name`` then raises is exactly what a missing package raises).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from tests.reliability._recipes import COMMON, RECIPES, recipe_main, run_bad

# (fault kind, recipe, args, every one of these must be in the message)
CASES = [
    ("negative lr", "gpt2", ["--model.optim.lr", "-1"], ["lr=-1.0 must be positive"]),
    ("negative lr", "spd", ["--model.optim.lr", "-1"], ["lr", "must be positive"]),
    ("negative lr", "clt", ["--model.optim.lr", "-1"], ["lr=-1.0 must be positive"]),
    ("k > features", "clt", ["--model.clt.k", "100000"], ["k=100000", "lower k or raise n_features"]),
    ("k > features", "clt", ["--model.clt.activation", "topk", "--model.clt.k", "513"], ["k=513", "lower k"]),
    ("unknown activation", "clt", ["--model.clt.activation", "swish"], ["'swish'", "choose one of"]),
    ("unknown activation", "gpt2", ["--model.model_config.mlp", "swish"], ["'swish'", "choose one of"]),
    ("unknown activation", "spd", ["--model.spd.sigmoid", "swish"], ["'swish'", "choose one of"]),
    ("wrong type", "gpt2", ["--model.model_config.n_layer", "four"], ["n_layer", "Expected a <class 'int'>", "four"]),
    ("wrong type", "spd", ["--model.train.batch_size", "abc"], ["batch_size", "Expected a <class 'int'>"]),
    ("wrong type", "clt", ["--model.clt.n_features", "many"], ["n_features", "Expected a <class 'int'>"]),
    ("out of range", "gpt2", ["--data.batch_size", "0"], ["batch_size must be a positive integer"]),
    ("out of range", "clt", ["--data.seq_len", "1000"], ["seq_len=1000"]),
    ("out of range", "gpt2", ["--model.model_config.n_head", "3"], ["n_embd", "divisible by n_head=3"]),
    ("unknown name", "gpt2", ["--model.optim.name", "adamw9bit"], ["'adamw9bit' is unknown", "choose one of"]),
    ("unknown name", "spd", ["--model.spd.components", "[{pattern: nothing, C: 3}]",
                             "--model.target.train_steps", "5"], ["'nothing' matches no module", "linear1"]),
    ("seq_len > model context", "gpt2", ["--data.seq_len", "256"], ["256", "block_size"]),
]


def _id(case: tuple) -> str:
    return f"{case[1]}-{case[0].replace(' ', '_').replace('>', 'gt')}-{case[2][1].strip('[{')[:12]}"


@pytest.mark.parametrize("kind,recipe,args,needles", CASES, ids=[_id(c) for c in CASES])
def test_bad_recipe_config_is_refused_before_training(fault, tmp_path, monkeypatch, capsys, kind, recipe, args, needles):
    fault(f"bad config: {kind}", "a wrong value in a recipe's YAML / command line")
    message, started = run_bad(recipe, args, tmp_path, monkeypatch, capsys)
    missing = [n for n in needles if n not in message]
    fault.trial(not missing and not started, note=f"fit started: {started}; missing {missing}")
    fault.shown(message, max(needles, key=len))
    assert not missing, f"the error does not say {missing}:\n{message[-2000:]}"
    assert not started, f"the error came only after Trainer.fit started:\n{message[-500:]}"


# -- missing optional packages -----------------------------------------------------------------------


@pytest.mark.parametrize("backend, package", [("flash", "flash-attn"), ("flash4", "flash-attn-4")])
def test_missing_flash_attn_names_the_extra(fault, tmp_path, monkeypatch, capsys, backend, package):
    fault(f"missing {package}", f"attn_backend={backend} without {package} installed")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    message, started = run_bad(
        "gpt2", ["--model.execution.attn_backend", backend], tmp_path, monkeypatch, capsys, when="trained"
    )
    ok = "lightning-opt[gpu]" in message and package in message
    fault.trial(ok and not started, note=f"fit started: {started}")
    fault.shown(message, package)
    assert ok, message
    assert not started, f"the missing package was noticed only in a training step:\n{message[-500:]}"


def test_missing_bitsandbytes_falls_back_with_a_warning(fault, tmp_path, monkeypatch):
    fault("missing bitsandbytes", "optim name adamw8bit without bitsandbytes: warn, fall back to torch AdamW")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = recipe_main("gpt2")([
            "--config", str(RECIPES["gpt2"][1]), *COMMON, "--model.optim.name", "adamw8bit",
            "--model.model_config.n_layer", "1", "--model.model_config.n_embd", "32", "--data.batch_size", "2",
            "--data.val_tokens", "1024", "--trainer.val_check_interval", "2",
        ])
    texts = [str(w.message) for w in caught]
    ok = metrics["steps"] == 2 and any("bitsandbytes" in t and "Falling back to torch AdamW" in t for t in texts)
    fault.trial(ok, note="" if ok else f"warnings: {texts[:5]}")
    fault.shown("\n".join(texts), "bitsandbytes")
    assert ok, texts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on CPU adamw8bit falls back before importing")
def test_missing_bitsandbytes_on_gpu_names_the_extra(fault, monkeypatch):
    fault("missing bitsandbytes", "optim name adamw8bit without bitsandbytes: warn, fall back to torch AdamW")
    from lightning_opt.optim.factory import OptimConfig, build_optimizer

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    model = torch.nn.Linear(8, 8).cuda()
    with pytest.warns(UserWarning) as caught:
        (opt,) = build_optimizer(model, OptimConfig(name="adamw8bit"))
    texts = [str(w.message) for w in caught]
    ok = type(opt) is torch.optim.AdamW and any("lightning-opt[gpu]" in t for t in texts)
    fault.trial(ok, note=f"{type(opt).__name__}: {texts[:3]}")
    fault.shown("\n".join(texts), "lightning-opt[gpu]")
    assert ok, texts


@pytest.mark.parametrize("recipe,args", [
    ("spd", ["--model.target.kind", "hf_gpt2", "--model.target.model", "{n_layer: 1, n_embd: 16, n_head: 2}"]),
    ("clt", ["--data.target", "hf:gpt2"]),
], ids=["spd-hf_gpt2", "clt-hf_target"])
def test_missing_transformers_names_the_extra(fault, tmp_path, monkeypatch, capsys, recipe, args):
    fault("missing transformers", "a Hugging Face target model without transformers installed")
    monkeypatch.setitem(sys.modules, "transformers", None)
    message, started = run_bad(recipe, args, tmp_path, monkeypatch, capsys, when="trained")
    ok = "transformers" in message and "lightning-opt[hf]" in message
    fault.trial(ok and not started, note=f"fit started: {started}")
    fault.shown(message, "lightning-opt[hf]")
    assert ok, message[-2000:]
    assert not started, message[-500:]


@pytest.mark.slow
def test_clt_seq_len_beyond_the_target_context(fault, tmp_path, monkeypatch, capsys):
    """Slow: the demo target GPT (block_size 64) is trained on first use. Its context is known only once
    the DataModule has loaded it, so the error must come before the first training batch."""
    fault("bad config: seq_len > model context", "a wrong value in a recipe's YAML / command line")
    message, trained = run_bad(
        "clt", ["--data.seq_len", "512", "--data.tokens_per_batch", "1024"], tmp_path, monkeypatch, capsys,
        when="trained",
    )
    ok = "512" in message and "block_size" in message and not trained
    fault.trial(ok, note=f"trained: {trained}: {message[-200:]}")
    fault.shown(message, "block_size")
    assert ok, message[-2000:]
