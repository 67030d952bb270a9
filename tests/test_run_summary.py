"""metrics.json's speed and times: a short run reports a real tokens/s, and a resumed run reports the speed
of its own segment (its tokens over its train time) with the earlier segments' time carried in the
checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from tests.reliability._recipes import CONFIGS, recipe_main

TINY = ["--config", str(CONFIGS / "gpt2" / "demo.yaml"), "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--data.seq_len", "32", "--data.batch_size", "4",
        "--data.val_tokens", "256", "--model.model_config.n_layer", "1", "--model.model_config.n_embd", "32",
        "--model.model_config.n_head", "2"]
TOKENS_PER_STEP = 32 * 4


def _metrics(tmp_path: Path, name: str) -> dict:
    (path,) = tmp_path.rglob(name)
    return json.loads(path.read_text())


def test_short_and_resumed_runs_report_their_own_speed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main = recipe_main("gpt2")
    save = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(tmp_path / "ck"), "--trainer.callbacks.every_n_train_steps", "2"]
    main([*TINY, "--trainer.max_steps", "2", "--metrics_file", "first.json", *save])
    first = _metrics(tmp_path, "first.json")
    # the validation after fit is not training time: a 2-step run still has a positive time and speed
    assert first["train_time_s"] > 0 and first["tokens_per_s"] is not None and first["tokens_per_s"] > 0
    assert first["segment_tokens"] == first["tokens_seen"] == 2 * TOKENS_PER_STEP
    assert first["tokens_per_s"] == first["segment_tokens"] / first["train_time_s"]
    out = capsys.readouterr().out
    assert " 0 tokens/s" not in out and f"{2 * TOKENS_PER_STEP:,} tokens in" in out, out

    (ckpt,) = (tmp_path / "ck").glob("*.ckpt")
    main([*TINY, "--trainer.max_steps", "5", "--ckpt_path", str(ckpt), "--metrics_file", "resumed.json"])
    resumed = _metrics(tmp_path, "resumed.json")
    assert resumed["steps"] == 5 and resumed["tokens_seen"] == 5 * TOKENS_PER_STEP
    assert resumed["segment_tokens"] == 3 * TOKENS_PER_STEP  # this segment's tokens, not the run's
    assert resumed["tokens_per_s"] == resumed["segment_tokens"] / resumed["train_time_s"]
    # the checkpoint, saved after step 2, carries the first segment's train time up to then
    assert 0 < resumed["train_time_total_s"] - resumed["train_time_s"] <= first["train_time_s"]


class SlowFirstBatch(Callback):
    """Sleeps before the segment's first training batch, as a first step that compiles does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.slept = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.slept:
            self.slept = True
            time.sleep(self.seconds)


def test_steady_speed_excludes_the_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sleep_s, steps = 1.5, 10
    slow = ["--trainer.callbacks+=tests.test_run_summary.SlowFirstBatch", "--trainer.callbacks.seconds", str(sleep_s)]
    # a validation inside the warm-up window and one after it: neither counts as training time
    recipe_main("gpt2")([*TINY, "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2", *slow])
    m = _metrics(tmp_path, "metrics.json")
    times = {k: m[k] for k in ("warmup_s", "train_time_s", "tokens_per_s", "steady_tokens_per_s", "val_history")}
    assert m["warmup_steps"] == 3 and len(m["val_history"]) >= 4, times
    assert sleep_s <= m["warmup_s"] < m["train_time_s"], times
    steady_tokens = (steps - m["warmup_steps"]) * TOKENS_PER_STEP
    assert m["steady_tokens_per_s"] == steady_tokens / (m["train_time_s"] - m["warmup_s"]), times
    assert m["steady_tokens_per_s"] > m["tokens_per_s"] == steps * TOKENS_PER_STEP / m["train_time_s"], times
    last = capsys.readouterr().out.splitlines()
    line = next(x for x in last if x.startswith("final val/loss"))
    assert f"steady {m['steady_tokens_per_s']:,.0f} tokens/s after {m['warmup_s']:.1f} s of warm-up" in line, line
