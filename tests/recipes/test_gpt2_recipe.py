from __future__ import annotations

import json

import pytest

from lightning_opt.recipes import CONFIGS


def _recipe():
    from lightning_opt.recipes import gpt2

    return gpt2


def test_demo_recipe_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = _recipe().main([
        "--config", str(CONFIGS / "gpt2/demo.yaml"),
        "--trainer.max_steps", "40", "--trainer.val_check_interval", "20",
        "--trainer.enable_progress_bar", "false",
        "--model.model_config.n_layer", "2", "--model.model_config.n_embd", "64",
        "--data.batch_size", "8", "--data.val_tokens", "8192",
    ])
    files = list((tmp_path / "runs").rglob("metrics.json"))
    assert len(files) == 1
    written = json.loads(files[0].read_text())
    assert written["steps"] == 40 and written["tokens_seen"] == 40 * 8 * 128
    history = [row["val_loss"] for row in written["val_history"]]
    assert len(history) == 2 and history[-1] < history[0]
    assert written["final_val_loss"] == pytest.approx(metrics["final_val_loss"])
    assert written["tokens_per_s"] > 0 and "cpu" in written["device"]
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*")), "TensorBoard logs missing"


def test_bad_config_value_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((SystemExit, ValueError)):
        _recipe().main(["--config", str(CONFIGS / "gpt2/demo.yaml"), "--model.optim.lr", "-1"])


@pytest.mark.parametrize("name", ["gpt2-124m-classic", "gpt2-124m-speedrun"])
def test_full_size_configs_parse_and_run_shrunk(name, tmp_path, monkeypatch):
    """The GPU configs stay valid: run them shrunk to seconds on CPU (built-in corpus, no compile)."""
    monkeypatch.chdir(tmp_path)
    metrics = _recipe().main([
        "--config", str(CONFIGS / f"gpt2/{name}.yaml"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--model.model_config.n_layer", "6", "--model.model_config.n_embd", "64", "--model.model_config.n_head", "2",
        "--model.model_config.block_size", "64", "--model.compile", "false",
        "--data.seq_len", "64", "--data.batch_size", "2", "--data.val_tokens", "1024",
        # the speedrun config drops layer 7's attention: name a layer the 6-layer model has
        *(["--model.model_config.skip_attn_layers", "[3]"] if name == "gpt2-124m-speedrun" else []),
    ])
    assert metrics["steps"] == 2 and metrics["final_val_loss"] is not None


def _run_overlay_shrunk(tmp_path, monkeypatch, overlay: str, *extra: str) -> tuple[dict, str]:
    """The speedrun config + an overlay, shrunk to seconds on CPU; its metrics and the saved config text."""
    monkeypatch.chdir(tmp_path)
    metrics = _recipe().main([
        "--config", str(CONFIGS / "gpt2/gpt2-124m-speedrun.yaml"),
        "--config", str(CONFIGS / f"gpt2/{overlay}.yaml"),
        "--trainer.max_steps", "2",
        "--model.model_config.n_layer", "6", "--model.model_config.n_embd", "64", "--model.model_config.n_head", "2",
        "--model.model_config.skip_attn_layers", "[3]", "--model.compile", "false", "--data.val_tokens", "1024",
        *extra,
    ])
    assert metrics["steps"] == 2 and metrics["final_val_loss"] is not None
    return metrics, "\n".join(p.read_text() for p in tmp_path.rglob("config.yaml"))


def test_long_sequence_overlay_parses_and_runs_shrunk(tmp_path, monkeypatch):
    """gpt2-124m-speedrun-long.yaml layers on the speedrun config (FlexAttention's dense CPU fallback here)."""
    _, saved = _run_overlay_shrunk(tmp_path, monkeypatch, "gpt2-124m-speedrun-long",
                                   "--trainer.val_check_interval", "2", "--trainer.accumulate_grad_batches", "2",
                                   "--model.model_config.block_size", "256", "--data.seq_len", "256")
    for line in ("attn_backend: flex", "doc_causal: true", "batch_size: 1", "- 128", "- 1856"):
        assert line in saved, line


def test_half_batch_overlay_parses_and_runs_shrunk(tmp_path, monkeypatch):
    """gpt2-124m-speedrun-halfbatch.yaml layers on the speedrun config: 4 micro-batches of 64 per step, 216 steps."""
    _, saved = _run_overlay_shrunk(tmp_path, monkeypatch, "gpt2-124m-speedrun-halfbatch",
                                   "--trainer.val_check_interval", "8", "--data.batch_size", "2",
                                   "--model.model_config.block_size", "64", "--data.seq_len", "64")
    assert "accumulate_grad_batches: 4" in saved
    overlay = (CONFIGS / "gpt2/gpt2-124m-speedrun-halfbatch.yaml").read_text()
    assert "max_steps: 216" in overlay and "batch_size: 64" in overlay
