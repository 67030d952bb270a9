"""Disk full while a checkpoint is written: the previous checkpoint survives, ``last`` never points at
a partial file, and training stops with a message that says what happened (AsyncCheckpoint has no
keep-going option: a run that cannot checkpoint stops rather than silently losing work).

The real test mounts a small tmpfs (needs root; skipped otherwise); the injected variant makes
``torch.save`` write part of the file and raise ``OSError(ENOSPC)``, and runs everywhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import AsyncCheckpoint
from tests.reliability._harness import Batches, TinyLM, loads, random_batches, step_files, trainer

STEPS = 8


class FillDiskAfterFirstSave(Callback):
    """Once the first checkpoint is on disk, fill the file system to leave ``leave`` bytes free."""

    def __init__(self, ckpt: AsyncCheckpoint, dirpath: Path, leave: int) -> None:
        self.ckpt, self.dirpath, self.leave, self.done = ckpt, dirpath, leave, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.done or self.ckpt.saves < 1:
            return
        self.ckpt.wait()  # the first save is durable
        free = shutil.disk_usage(self.dirpath).free
        with open(self.dirpath / "filler", "wb") as f:
            f.write(b"\0" * max(free - self.leave, 0))
        self.done = True


def _audit(ckdir: Path, good_step: int) -> list[str]:
    """Problems that lose data (each is one); the caller adds the ones that do not."""
    problems = []
    files = step_files(ckdir)
    newest = files[-1][0] if files else 0
    if newest != good_step or any(p.name.endswith("-exception.ckpt") for _, p in files):
        problems.append(f"checkpoints under final names: {[p.name for _, p in files]}, want the newest at {good_step}")
    for _, p in files:
        if loads(p) is None:
            problems.append(f"{p.name} does not load")
    last = ckdir / "last.ckpt"
    if good_step:
        if not last.exists() or loads(last) is None or loads(last)["global_step"] != good_step:
            problems.append("last.ckpt does not point at the previous complete checkpoint")
    elif os.path.lexists(last):
        problems.append("last.ckpt exists although no checkpoint was ever completed")
    leftovers = [p.name for p in (ckdir / ".writing").glob("*")] if (ckdir / ".writing").exists() else []
    if leftovers:
        problems.append(f"partial temporary files left behind: {leftovers}")
    return problems


def _run_until_full(tmp_path: Path, ckdir: Path, extra: list[Callback], ckpt: AsyncCheckpoint) -> BaseException | None:
    try:
        trainer(tmp_path, [ckpt, *extra], max_steps=STEPS).fit(
            TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(STEPS, 0))
        )
    except Exception as err:  # the run is expected to stop
        return err
    return None


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return res.returncode == 0


def test_disk_full_on_a_real_small_tmpfs(fault, tmp_path):
    fault("disk full (tmpfs)", "a 256 KiB tmpfs fills up after the first checkpoint; the next write fails")
    ckdir = tmp_path / "ck"
    if not _mount_tmpfs(ckdir, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root); test_enospc_injected covers the same path")
    try:
        ckpt = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=2, save_on_train_end=False)
        err = _run_until_full(tmp_path, ckdir, [FillDiskAfterFirstSave(ckpt, ckdir, leave=4096)], ckpt)
        (ckdir / "filler").unlink(missing_ok=True)
        problems = _audit(ckdir, good_step=2)
        lost = bool(problems)
        text = f"{err}\n{err.__cause__}" if err else ""
        if err is None:
            problems.append("training went on although no checkpoint could be written")
        elif "No space left on device" not in text and "ENOSPC" not in text:
            problems.append(f"the error does not say the disk is full: {err!r}")
        # space is back: the run resumes from the checkpoint that survived
        if loads(ckdir / "last.ckpt") is not None:
            t = trainer(tmp_path, [AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=2)], max_steps=STEPS)
            t.fit(TinyLM(dropout=0.0), train_dataloaders=Batches(random_batches(STEPS, 0)),
                  ckpt_path=str(ckdir / "last.ckpt"))
            if t.global_step != STEPS:
                problems.append(f"resumed run stopped at step {t.global_step}")
    finally:
        subprocess.run(["umount", "-l", str(ckdir)], capture_output=True)
    fault.trial(not problems, data_lost=lost, note="; ".join(problems))
    assert not problems, problems


def _enospc_save(monkeypatch, fail_at: int, fraction: float) -> None:
    real_save = torch.save
    calls = [0]

    def save(obj, f, *a, **k):
        calls[0] += 1
        if calls[0] < fail_at or not isinstance(f, (str, os.PathLike)):
            return real_save(obj, f, *a, **k)
        import io

        buf = io.BytesIO()
        real_save(obj, buf, *a, **k)
        with open(f, "wb") as fh:  # part of the file reaches the disk, then the disk is full
            fh.write(buf.getvalue()[: int(len(buf.getvalue()) * fraction)])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_enospc_injected(fault, tmp_path, monkeypatch, fail_at):
    what = "the first" if fail_at == 1 else "a later"
    fault(f"ENOSPC on {what} checkpoint", f"torch.save writes part of checkpoint {fail_at} then raises ENOSPC")
    _enospc_save(monkeypatch, fail_at, 0.4)
    ckdir = tmp_path / "ck"
    ckpt = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=2, save_on_train_end=False)
    err = _run_until_full(tmp_path, ckdir, [], ckpt)
    monkeypatch.undo()
    problems = _audit(ckdir, good_step=2 * (fail_at - 1))
    lost = bool(problems)
    if err is None:
        problems.append("training went on although no checkpoint could be written")
    elif "No space left on device" not in str(err) or "AsyncCheckpoint" not in str(err):
        problems.append(f"unclear error: {err!r}")
    if err is not None:
        fault.shown(str(err))
    fault.trial(not problems, data_lost=lost, note="; ".join(problems))
    assert not problems, problems
