"""Gradient clipping must not hide a non-finite gradient from NaNSkip, and an activation cache must not be read
for another target, other token files or settings, or when a shard is cut short.

NaNSkip: Inf/NaN gradients at fixed steps under no clipping, norm clipping and value clipping (which turns an Inf
into a finite +-clip_val), through Lightning's own clipping of a plain LightningModule and through
``TrainingModule.configure_gradient_clipping``, in both modes, with and without accumulation. Each run must be
bit-identical to a run that never saw the optimizer steps those batches belong to.

Activation cache: the CLT recipe ``main(args)`` builds a cache, then runs again on the same ``cache_dir`` with
another target of the same shape, other ``train_files``, another ``seq_len``: each is refused before training,
naming what differs; a truncated shard is refused at setup, naming the file and its sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_opt.callbacks import NaNSkip
from lightning_opt.modules.base import TrainingModule
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig
from tests.reliability._harness import (
    VOCAB,
    Batches,
    TinyLM,
    inject,
    random_batches,
    state,
    state_diff,
    trainer,
)
from tests.reliability._recipes import run_bad

STEPS = 12
# batch 0: the optimizer has no state yet (NaNSkip decides on the host); later ones take the device path
FAULTS = {0: "inf_grad", 5: "inf_grad", 8: "nan_grad"}
CLIPS = {
    "none": {},
    "norm": {"gradient_clip_val": 0.5},
    "value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
}


class TinyTrainingLM(TrainingModule):
    """Embedding -> linear head on the shared base (its optimizer, schedule and configure_gradient_clipping)."""

    def __init__(self, faults: dict[int, str] | None = None) -> None:
        super().__init__(OptimConfig(lr=0.02, weight_decay=0.01), ScheduleConfig(warmup_steps=2, total_steps=STEPS))
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
        self.faults = faults or {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        kind = self.faults.get(batch_idx)
        return loss if kind is None else inject(loss, self.model[1].weight, kind)


MODULES = {"lightning": lambda faults=None: TinyLM(dropout=0.0, faults=faults), "training_module": TinyTrainingLM}


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("clip", list(CLIPS))
def test_nonfinite_gradient_is_skipped_under_every_clipping(fault, tmp_path, module: str, clip: str) -> None:
    fault(f"Inf/NaN gradient with {clip} clipping ({module})",
          f"Inf/NaN gradients at steps {sorted(FAULTS)}, Trainer clipping {CLIPS[clip] or 'off'}")
    make = MODULES[module]
    batches = random_batches(STEPS, 0)
    problems = []
    for accumulate in (1, 2):
        bad = {b // accumulate for b in FAULTS}
        kw = {"accumulate_grad_batches": accumulate, **CLIPS[clip]}
        clean = make()
        t = trainer(tmp_path / f"ref{accumulate}", [], **kw)
        t.fit(clean, train_dataloaders=Batches([b for i, b in enumerate(batches) if i // accumulate not in bad]))
        reference = state(clean, t)
        for mode in ("device", "host"):
            skip = NaNSkip(mode=mode, max_consecutive_skips=None)
            faulty = make(faults=FAULTS)
            t = trainer(tmp_path / f"{mode}{accumulate}", [skip], **kw)
            t.fit(faulty, train_dataloaders=Batches(batches))
            diffs = state_diff(state(faulty, t), reference)
            ok = skip.skipped_total == len(bad) and not diffs
            fault.trial(ok, data_lost=bool(diffs), note="" if ok else f"{mode} x{accumulate}: {diffs[:3]}")
            if not ok:
                problems.append((mode, accumulate, skip.skipped_total, len(bad), diffs[:5]))
    assert not problems, problems


# -- the activation cache of the CLT recipe ----------------------------------------------------------------


def _target(path: Path, seed: int) -> str:
    """A tiny GPT checkpoint; every seed gives the same shape (2 layers x 16) and other weights."""
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=16, block_size=32)
    torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, path)
    return str(path)


def _clt_args(target: str, cache: Path, train: Path, val: Path, seq_len: int = 16) -> list[str]:
    return ["--data.target", target, "--data.cache_dir", str(cache), "--data.train_files", str(train),
            "--data.val_files", str(val), "--data.seq_len", str(seq_len), "--data.tokens_per_batch", "64",
            "--data.train_tokens", "1024", "--data.val_tokens", "64", "--data.stats_tokens", "256",
            "--model.clt.n_layers", "2", "--model.clt.d_model", "16", "--model.clt.n_features", "32",
            "--model.clt.k", "4", "--model.aux_k", "4", "--trainer.limit_val_batches", "1"]


def _run_clt(tmp_path: Path, monkeypatch, args: list[str]) -> None:
    from tests.reliability._recipes import COMMON, RECIPES, recipe_main

    monkeypatch.chdir(tmp_path)
    recipe_main("clt")(["--config", str(RECIPES["clt"][1]), *COMMON, *args])


def _files(cache: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(cache.iterdir())}


def test_activation_cache_of_other_inputs_is_refused(fault, tmp_path, monkeypatch, capsys) -> None:
    """A cache built for target A, shard 1, seq_len 16: the same settings reuse it as it is; target B (same shape,
    other weights), shard 2, or seq_len 32 on the same folder are refused before training, naming the setting,
    and leave the cache untouched; target B in a new folder builds B's activations there."""
    from lightning_opt.data.activations import (
        CachedActivations,
        MLPActivationCapture,
        iter_activation_batches,
        load_target_model,
        token_windows,
    )
    from tests.reliability._harness import make_shard

    fault("activation cache reused for other inputs", "CLT recipe, cache of target A read with target B / "
          "other train_files / other seq_len")
    a, b = _target(tmp_path / "a.pt", 0), _target(tmp_path / "b.pt", 1)
    shard1, shard2 = make_shard(tmp_path / "one.bin", 4096, seed=1), make_shard(tmp_path / "two.bin", 4096, seed=2)
    val = make_shard(tmp_path / "val.bin", 1024, seed=3)
    cache = tmp_path / "acts"
    _run_clt(tmp_path, monkeypatch, _clt_args(a, cache, shard1, val))
    built = _files(cache)
    assert "meta.json" in built
    _run_clt(tmp_path, monkeypatch, _clt_args(a, cache, shard1, val))  # the same inputs: read as it is
    assert _files(cache) == built

    cases = {"target_weights_sha256": _clt_args(b, cache, shard1, val),
             "train_files": _clt_args(a, cache, shard2, val),
             "seq_len": _clt_args(a, cache, shard1, val, seq_len=32)}
    for differing, args in cases.items():
        message, trained = run_bad("clt", args, tmp_path, monkeypatch, capsys, when="trained")
        ok = (f"{differing}:" in message and str(cache) in message and "another cache_dir" in message
              and not trained and _files(cache) == built)
        fault.trial(ok, data_lost=_files(cache) != built, note="" if ok else f"{differing}: {message[-300:]}")
        fault.shown(message, differing)
        assert ok, (differing, trained, message[-1500:])

    fresh = tmp_path / "acts_b"
    _run_clt(tmp_path, monkeypatch, _clt_args(b, fresh, shard1, val))
    capture = MLPActivationCapture(load_target_model(b), torch.bfloat16)
    x, y = next(iter_activation_batches(capture, token_windows(shard1, 16, 4, None), 64))
    cx, cy = CachedActivations(fresh)[0]
    assert torch.equal(cx, x) and torch.equal(cy, y)
    assert not torch.equal(CachedActivations(cache)[0][0], x)  # A's cache holds other activations


def test_truncated_activation_shard_is_refused_at_setup(fault, tmp_path, monkeypatch, capsys) -> None:
    from tests.reliability._harness import make_shard

    fault("truncated activation shard", "CLT recipe on a cache whose acts_00000.bin lost its tail, meta.json intact")
    target = _target(tmp_path / "a.pt", 0)
    train, val = make_shard(tmp_path / "one.bin", 4096, seed=1), make_shard(tmp_path / "val.bin", 1024, seed=3)
    cache = tmp_path / "acts"
    args = _clt_args(target, cache, train, val)
    _run_clt(tmp_path, monkeypatch, args)
    shard = cache / "acts_00000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 3)
    message, trained = run_bad("clt", args, tmp_path, monkeypatch, capsys, when="trained")
    ok = (str(shard.name) in message and f"is {size // 3} bytes" in message and f"expected {size} bytes" in message
          and "Delete the cache folder" in message and not trained)
    fault.trial(ok, note="" if ok else message[-300:])
    fault.shown(message, "truncated")
    assert ok, (trained, message[-1500:])
