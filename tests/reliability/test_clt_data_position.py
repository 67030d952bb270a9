"""A CLT run resumed in the middle of a pass over its data trains on the batches the uninterrupted run trains on.

The recipe (``recipes.clt.main``) trains 7 steps over passes of 3 batches (``train_tokens`` = 3 batches), with
AuxK after a short dead-feature window, resampling every 2 steps and a checkpoint after every step. Resumed with
``--ckpt_path`` from step 2 (inside the first pass) and from step 4 (inside the second), the final checkpoint
(weights, buffers, optimizer state, resampling generator) equals the uninterrupted run's bit for bit. Both the
online activations (the target runs each step) and a cache written once (``data.cache_dir``, shuffled each pass)
are checked. Without the data position in the checkpoint the resumed run restarts the pass and differs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.recipes.test_resume import _args, _run_checkpoints, _same, target_ckpt  # noqa: F401 - a fixture
from tests.reliability._recipes import recipe_main

torch.set_num_threads(1)

STEPS = 7


def _checkpoint(folder: Path, step: int) -> dict:
    (path,) = folder.glob(f"step={step:09d}.ckpt")
    return torch.load(path, map_location="cpu", weights_only=True)


def _state(ckpt: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint that training changes: weights and buffers, optimizer state."""
    out = {f"model.{k}": v for k, v in ckpt["state_dict"].items()}
    for i, opt in enumerate(ckpt["optimizer_states"]):
        for p, entry in opt["state"].items():
            out.update({f"opt{i}.{p}.{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("cache", [False, True], ids=["online", "cached"])
def test_clt_resumes_mid_pass_on_the_same_batches(cache: bool, tmp_path, monkeypatch, target_ckpt: str) -> None:  # noqa: F811
    monkeypatch.chdir(tmp_path)
    main = recipe_main("clt")
    base = [*_args("clt_demo.yaml", tmp_path, target_ckpt),
            "--data.train_tokens", str(3 * 128), "--trainer.max_steps", str(STEPS),
            "--model.dead_tokens", "256", "--model.resample_dead_every", "2",
            "--callbacks.async_checkpoint.every_n_steps", "1", "--callbacks.async_checkpoint.keep_last_k", "null",
            "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "100"]
    if cache:
        base += ["--data.cache_dir", str(tmp_path / "cache"), "--data.dtype", "float32"]
    main(base)
    first = _run_checkpoints(tmp_path, 0)
    reference = _state(_checkpoint(first, STEPS))
    for run, start in enumerate((2, 4), start=1):
        (start_ckpt,) = first.glob(f"step={start:09d}.ckpt")
        main([*base, "--ckpt_path", str(start_ckpt)])
        resumed = _state(_checkpoint(_run_checkpoints(tmp_path, run), STEPS))
        assert _same(reference, resumed) == [], f"resumed from step {start}: differs from the uninterrupted run"
