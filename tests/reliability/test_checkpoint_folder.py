"""A checkpoint folder is protected: one live writer (a lock), unique temporary names, a checksum per
checkpoint, and a last healthy checkpoint that pruning keeps through a divergence.

Concurrent runs and kill -9 use real child processes (the reliability harness's forkserver); the rest
are real Trainer runs on real files.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import AsyncCheckpoint, NaNSkip
from lightning_opt.callbacks.async_checkpoint import atomic_torch_save, checkpoint_lineage
from tests.reliability._harness import (
    BATCH,
    SEQ_LEN,
    Batches,
    TinyLM,
    ckpt_run,
    join_or_kill,
    kill9,
    loads,
    make_shard,
    random_batches,
    read_losses,
    start,
    step_files,
    trainer,
    wait_for,
)

TIMEOUT = 60.0


def _spec(root: Path, shard: Path, name: str, **kw) -> dict:
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    return {"shard": str(shard), "root": str(run), "ckdir": str(root / "ck"), "loss_log": str(run / "losses.txt"),
            "max_steps": 30, "every_n_steps": 1, "keep_last_k": 3, **kw}


def test_second_run_into_a_busy_folder_is_refused(fault, tmp_path):
    """Two runs with AsyncCheckpoint(every_n_steps=1) into one folder: the second stops at setup with a
    message naming the first (pid, host); the first finishes and every checkpoint is its own and loads."""
    fault("two runs, one checkpoint folder", "a second run starts into the folder of a live run (every_n_steps=1)")
    shard = make_shard(tmp_path / "train.bin", 10 * BATCH * SEQ_LEN + 1)
    first = _spec(tmp_path, shard, "first", step_sleep=0.03, out=str(tmp_path / "first" / "final.pt"))
    a = start(ckpt_run, first)
    try:
        assert wait_for(lambda: len(read_losses(Path(first["loss_log"]))) >= 3, TIMEOUT, a), "first run never started"
        second = _spec(tmp_path, shard, "second")
        b = start(ckpt_run, second)
        assert join_or_kill(b, TIMEOUT), "the second run hung"
        assert join_or_kill(a, TIMEOUT) and a.exitcode == 0, "the first run failed"
    finally:
        kill9(a)
    error = Path(second["root"], "error.txt")
    msg = error.read_text() if error.exists() else ""
    fault.shown(msg, "in use")
    refused = b.exitcode != 0 and f"pid {a.pid}" in msg and socket.gethostname() in msg
    files = step_files(tmp_path / "ck")
    broken = [p.name for _, p in files if loads(p) is None]
    last = loads(tmp_path / "ck" / "last.ckpt")
    final = torch.load(first["out"], weights_only=False)
    own = last is not None and last["global_step"] == 30 and all(
        torch.equal(v, final["params"][k]) for k, v in last["state_dict"].items()
    )
    fault.trial(refused and not broken and own, data_lost=bool(broken) or not own, note=msg[:200])
    assert refused, f"second run: exit code {b.exitcode}, error {msg!r}"
    assert not broken and own, (broken, None if last is None else last["global_step"])
    assert not (tmp_path / "ck" / ".lock").exists(), "the lock outlived the run that held it"


def test_lock_of_a_killed_run_is_taken_over(fault, tmp_path):
    fault("stale folder lock", "kill -9 a run, then resume into its folder: the dead run's lock is taken over")
    shard = make_shard(tmp_path / "train.bin", 10 * BATCH * SEQ_LEN + 1)
    first = _spec(tmp_path, shard, "first", step_sleep=0.02)
    a = start(ckpt_run, first)
    reached = wait_for(lambda: len(read_losses(Path(first["loss_log"]))) >= 4, TIMEOUT, a)
    kill9(a)
    assert reached, "first run never started"
    lock = json.loads((tmp_path / "ck" / ".lock").read_text())
    assert lock["pid"] == a.pid
    second = _spec(tmp_path, shard, "second", max_steps=8, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    b = start(ckpt_run, second)
    assert join_or_kill(b, TIMEOUT), "the resumed run hung"
    said = Path(second["root"], "warnings.txt").read_text()
    fault.shown(said, "taking over the lock")
    ok = b.exitcode == 0 and f"pid {a.pid}" in said and "not running" in said
    fault.trial(ok, note=said[:200])
    assert ok, (b.exitcode, said)


def _fit(root: Path, ckdir: Path, steps: int = 4, **kw) -> None:
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=2, **kw)
    trainer(root, [cb], max_steps=steps).fit(TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(steps, 0)))


def test_resume_from_a_lagging_last_link_rewrites_its_own_run_s_files(fault, tmp_path):
    fault("last.ckpt lags its run's newest file", "a run killed after renaming step=4 into place, before last.ckpt "
          "moved: resuming from last.ckpt (step 2) saves steps 3 and 4 again; a fresh run is still refused")
    ckdir = tmp_path / "ck"
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1)
    trainer(tmp_path / "a", [cb], max_steps=4).fit(TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(4, 0)))
    first = cb.lineage
    assert first and checkpoint_lineage(str(ckdir / "step=000000004.ckpt")) == first
    os.replace(ckdir / "last.ckpt", tmp_path / "unused")
    os.symlink("step=000000002.ckpt", ckdir / "last.ckpt")  # where a kill between rename and relink leaves it
    resumed = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "b", [resumed], max_steps=5).fit(
            TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(5, 0)), ckpt_path=str(ckdir / "last.ckpt")
        )
    steps = {s: loads(p)["global_step"] for s, p in step_files(ckdir)}
    ok = resumed.lineage == first and steps.get(5) == 5 and os.readlink(ckdir / "last.ckpt") == "step=000000005.ckpt"
    assert not any("another run" in str(w.message) for w in caught), [str(w.message) for w in caught]
    fresh = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1)
    with pytest.raises(RuntimeError, match=r"step=00000000[12]\.ckpt exists and another run wrote it") as err:
        trainer(tmp_path / "c", [fresh], max_steps=2).fit(
            TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(2, 0))
        )
    ok = ok and fresh.lineage != first
    fault.shown(str(err.value), "another run wrote it")
    fault.trial(ok, note=f"steps {sorted(steps)}, lineage kept {resumed.lineage == first}")
    assert ok, (steps, resumed.lineage, first)


def _write_lock(ckdir: Path, host: str, pid: int, age_s: float) -> Path:
    ckdir.mkdir(parents=True, exist_ok=True)
    lock = ckdir / ".lock"
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": "2024-01-01T00:00:00"}))
    when = time.time() - age_s
    os.utime(lock, (when, when))
    return lock


def test_lock_held_on_another_host_is_respected_until_its_heartbeat_stops(fault, tmp_path):
    fault("folder lock of another host", "a lock naming a run on another host: refused while its heartbeat is fresh, "
          "taken over with a warning after an hour without one")
    ckdir = tmp_path / "ck"
    _write_lock(ckdir, "other-node.example", 4242, age_s=5)
    with pytest.raises(RuntimeError) as info:
        _fit(tmp_path / "a", ckdir)
    msg = str(info.value)
    assert "pid 4242" in msg and "other-node.example" in msg and "2024-01-01" in msg and "dirpath" in msg, msg
    assert not step_files(ckdir)
    _write_lock(ckdir, "other-node.example", 4242, age_s=3600)  # no heartbeat for an hour: the run is gone
    with pytest.warns(UserWarning, match="other-node.example"):
        _fit(tmp_path / "b", ckdir)
    assert [s for s, _ in step_files(ckdir)] == [2, 4]
    assert not (ckdir / ".lock").exists()
    fault.shown(msg, "pid 4242")
    fault.trial(True)


def test_concurrent_writers_use_their_own_temporary_files(fault, tmp_path):
    """Two writers saving into one folder at once (e.g. a run and a manual save) must not share a temp name."""
    fault("two writers, one folder", "two threads each save 20 x 1 MiB checkpoints into one folder at once")
    errors: list[BaseException] = []
    big = {"w": torch.randn(1 << 18)}

    def save(name: str) -> None:
        try:
            for i in range(20):
                atomic_torch_save({**big, "who": name, "i": i}, str(tmp_path / f"{name}.ckpt"))
        except BaseException as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=save, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in ("a", "b"):
        ck = torch.load(tmp_path / f"{name}.ckpt", weights_only=True)
        assert ck["who"] == name and ck["i"] == 19
    fault.trial(True)


def test_every_checkpoint_has_a_matching_checksum(fault, tmp_path):
    fault("checksum per checkpoint", "every checkpoint of a run has a <file>.sha256 equal to its SHA-256")
    ckdir = tmp_path / "ck"
    _fit(tmp_path, ckdir, steps=6)
    for _, path in step_files(ckdir):
        side = Path(f"{path}.sha256")
        assert side.exists(), f"no checksum next to {path.name}"
        assert side.read_text().split()[0] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not any((ckdir / ".writing").glob("*")), "temporary files left behind"
    fault.trial(True)


class _BlowUp(Callback):
    """Multiplies every weight by 1e20 at the end of the step that reaches ``at``: one finite, huge update
    (the next forward overflows, so NaNSkip skips every later step)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.mul_(1e20)


def test_divergence_keeps_the_last_healthy_checkpoint(fault, tmp_path):
    """keep_last_k=2 and a save every step: the steps that blow up and the skipped ones after them must not
    push the last checkpoint from before the divergence out of the folder, and NaNSkip's error names it."""
    fault("divergence with pruning", "a finite huge update, then skipped steps until NaNSkip stops (keep_last_k=2)")
    ckdir = tmp_path / "ck"
    blow_at, steps = 6, 20
    cbs = [NaNSkip(max_consecutive_skips=4), _BlowUp(blow_at),
           AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1, keep_last_k=2)]
    with pytest.raises(RuntimeError) as info:
        trainer(tmp_path, cbs).fit(TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(steps, 0)))
    msg = str(info.value)
    fault.shown(msg, "healthy")
    healthy = ckdir / f"step={blow_at - 1:09d}.ckpt"
    ck = loads(healthy) if healthy.exists() else None
    finite = ck is not None and all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in ck["state_dict"].values())
    clear = "consecutive optimizer steps were skipped" in msg and str(healthy) in msg
    fault.trial(finite and clear, data_lost=not finite, note=msg[:200])
    assert finite, f"the last checkpoint before the divergence is gone: {sorted(p.name for p in ckdir.iterdir())}"
    assert clear, msg
    clean = TinyLM(dropout=0.0)
    trainer(tmp_path / "ref", []).fit(clean, train_dataloaders=Batches(random_batches(blow_at - 1, 0)))
    assert all(torch.equal(v, clean.state_dict()[k]) for k, v in ck["state_dict"].items())
