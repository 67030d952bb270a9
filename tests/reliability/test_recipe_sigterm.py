"""SIGTERM to a recipe's console-script process: exit 0 at a step boundary with its checkpoint and its metrics.

``python -m lightning_opt.recipes.gpt2 --config gpt2/demo`` (shrunk) runs as a child process, as a user or a
scheduler starts it; once it has saved a checkpoint the test sends it SIGTERM. The process must exit with status
0, leave ``step=N-exception.ckpt`` (``last.ckpt`` pointing at it), and write ``metrics.json`` for what it trained
(``stopped_by: "SIGTERM"``, ``steps`` = N), so a pre-empted run keeps its summary as well as its state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_to_the_recipe_process_keeps_checkpoint_and_metrics(tmp_path) -> None:
    args = ["--config", "gpt2/demo", "--trainer.accelerator", "cpu", "--trainer.max_steps", "100000",
            "--trainer.val_check_interval", "100000", "--trainer.enable_progress_bar", "false",
            "--model.model_config.n_layer", "1", "--model.model_config.n_embd", "32",
            "--model.model_config.n_head", "2", "--data.seq_len", "32", "--data.batch_size", "2",
            "--data.val_tokens", "256", "--callbacks.async_checkpoint.every_n_steps", "5"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lightning_opt.recipes.gpt2", *args], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("runs/*/version_0/checkpoints/step=*.ckpt")):
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "log.txt").read_text()
    assert rc == 0, out[-3000:]
    (run,) = tmp_path.glob("runs/*/version_0")
    (stopped,) = (run / "checkpoints").glob("step=*-exception.ckpt")
    step = int(stopped.name.split("=")[1].split("-")[0])
    assert (run / "checkpoints" / "last.ckpt").resolve().name == stopped.name
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["stopped_by"] == "SIGTERM"
    assert metrics["steps"] == step and step >= 5
    assert metrics["tokens_seen"] == step * 2 * 32
    assert metrics["train_time_s"] > 0
