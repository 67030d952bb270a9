"""Which checkpoint a recipe run resumes from or loads, and that every load checks it.

Through the console scripts' entry functions (``lightning_opt.recipes.gpt2.main``, ``...sample.main``) on the
GPT-2 demo config shrunk by command-line overrides, with real files: ``--ckpt_path last`` resumes the newest
intact checkpoint of the newest earlier ``version_*`` folder bit for bit, or starts fresh saying so; a checkpoint with
flipped floats is replaced by the newest intact one of its folder (resume) or refused (sample,
``load_from_checkpoint``); a dangling ``last.ckpt`` is passed over; ``max_steps 0`` is refused before
training; a save under a file-size limit says what happened and keeps the previous checkpoint. No run
changes a byte of an earlier run's checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import resource
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_opt.callbacks import AsyncCheckpoint
from tests.recipes.test_resume import _GPT2_SHORT
from tests.reliability._harness import (
    Batches,
    TinyLM,
    join_or_kill,
    loads,
    random_batches,
    start,
    step_files,
    trainer,
)
from tests.reliability.test_bad_checkpoint import _flip_floats

ARGS = ["--config", "gpt2/demo", *_GPT2_SHORT, "--model.schedule.name", "constant",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger.init_args.name", "demo"]


def gpt2(cwd: Path, monkeypatch, *args: str) -> dict[str, Any]:
    from lightning_opt.recipes import gpt2 as recipe

    monkeypatch.chdir(cwd)
    return recipe.main([*ARGS, *args])


def ckdir(cwd: Path, version: int) -> Path:
    return cwd / "runs" / "demo" / f"version_{version}" / "checkpoints"


def fingerprint(d: Path) -> dict[str, str]:
    """sha256 of each file of a checkpoint folder (``last.ckpt`` by its link target's name)."""
    out = {}
    for p in sorted(d.iterdir()):
        if p.is_dir() and not p.is_symlink():  # .writing: temporary files of saves in progress
            continue
        out[p.name] = f"-> {os.readlink(p)}" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def diff(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths of everything that is not bit-identical between two nested structures of tensors."""
    if isinstance(a, dict) and isinstance(b, dict):
        # a param group's "differentiable" flag is filled in by torch when a state dict is loaded
        a, b = ({k: v for k, v in d.items() if k != "differentiable"} for d in (a, b))
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [where]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def exact(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What an exact resume reproduces: weights, optimizer and scheduler state, step, tokens, data position."""
    fit = ckpt["loops"]["fit_loop"]
    return {"weights": ckpt["state_dict"], "optimizers": ckpt["optimizer_states"], "schedulers": ckpt["lr_schedulers"], "global_step": ckpt["global_step"],
            "tokens_seen": ckpt.get("tokens_seen"), "batches": fit["epoch_loop.batch_progress"],
            "data": ckpt.get("TokenShardDataModule")}


def test_last_resumes_the_previous_version_exactly_and_leaves_it_unchanged(fault, tmp_path, monkeypatch, capsys):
    fault("--ckpt_path last in a recipe", "a second run with --ckpt_path last (a new version folder)")
    first, straight = tmp_path / "first", tmp_path / "straight"
    first.mkdir(), straight.mkdir()
    gpt2(first, monkeypatch, "--trainer.max_steps", "2")
    before = fingerprint(ckdir(first, 0))
    capsys.readouterr()
    metrics = gpt2(first, monkeypatch, "--trainer.max_steps", "4", "--ckpt_path", "last")
    said = capsys.readouterr().out
    straight_metrics = gpt2(straight, monkeypatch, "--trainer.max_steps", "4")
    resumed, reference = loads(ckdir(first, 1) / "last.ckpt"), loads(ckdir(straight, 0) / "last.ckpt")
    problems = [*diff(exact(resumed), exact(reference))]
    if metrics["final_val_loss"] != straight_metrics["final_val_loss"]:
        problems.append(f"val/loss {metrics['final_val_loss']} vs {straight_metrics['final_val_loss']}")
    if f"resuming from {ckdir(first, 0) / 'step=000000002.ckpt'}" not in said:
        problems.append(f"no line naming the checkpoint resumed: {said[-400:]}")
    if fingerprint(ckdir(first, 0)) != before:
        problems.append("the first run's checkpoint folder changed")
    fault.trial(not problems, data_lost=fingerprint(ckdir(first, 0)) != before, note="; ".join(problems)[:300])
    assert resumed["global_step"] == 4 and not problems, problems


def test_last_without_a_checkpoint_starts_fresh_and_says_so(fault, tmp_path, monkeypatch, capsys):
    fault("--ckpt_path last, nothing saved yet", "the first run of a name with --ckpt_path last")
    metrics = gpt2(tmp_path, monkeypatch, "--trainer.max_steps", "2", "--ckpt_path", "last")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "--ckpt_path last" in ln]
    ok = metrics["steps"] == 2 and len(lines) == 1 and "starting from scratch" in lines[0]
    fault.trial(ok, note=str(lines))
    fault.shown(lines[0] if lines else "")
    assert ok, lines


def test_fixed_folder_is_never_overwritten_or_pruned_by_a_later_run(fault, tmp_path, monkeypatch, capsys):
    """With one dirpath for every run: a fresh run is refused before it overwrites the earlier run's
    step files; ``--ckpt_path last`` resumes its newest and prunes only its own saves."""
    fault("a later run in a fixed checkpoint folder", "fresh run and --ckpt_path last into one dirpath")
    folder = tmp_path / "ck"
    fixed = ["--callbacks.async_checkpoint.dirpath", str(folder), "--callbacks.async_checkpoint.every_n_steps", "1",
             "--callbacks.async_checkpoint.keep_last_k", "2"]
    gpt2(tmp_path, monkeypatch, *fixed, "--trainer.max_steps", "3")
    before = {n: h for n, h in fingerprint(folder).items() if n != "last.ckpt"}
    with pytest.raises(ValueError, match="would overwrite them") as info:
        gpt2(tmp_path, monkeypatch, *fixed, "--trainer.max_steps", "3")
    refused_clean = fingerprint(folder) == {**before, "last.ckpt": "-> step=000000003.ckpt"}
    gpt2(tmp_path, monkeypatch, *fixed, "--trainer.max_steps", "6", "--ckpt_path", "last")
    after = fingerprint(folder)
    kept = all(after.get(n) == h for n, h in before.items())
    own = sorted(n for n in after if n.startswith("step=") and n.endswith(".ckpt") and n not in before)
    ok = refused_clean and kept and own == ["step=000000005.ckpt", "step=000000006.ckpt"]
    ok = ok and after["last.ckpt"] == "-> step=000000006.ckpt"
    fault.trial(ok, data_lost=not kept, note=f"refused clean {refused_clean}, kept {kept}, own {own}")
    fault.shown(str(info.value))
    assert ok, (before, after)


def test_damaged_checkpoint_of_another_version_folder_is_replaced_by_the_newest_intact_one(
    fault, tmp_path, monkeypatch
):
    fault("damaged --ckpt_path from another version", "1,000 floats flipped in version_0's last checkpoint")
    gpt2(tmp_path, monkeypatch, "--trainer.max_steps", "2", "--callbacks.async_checkpoint.every_n_steps", "1")
    old = ckdir(tmp_path, 0)
    damaged = old / "step=000000002.ckpt"
    _flip_floats(damaged)
    before = fingerprint(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpt2(tmp_path, monkeypatch, "--trainer.max_steps", "3", "--ckpt_path", str(old / "last.ckpt"))
    said = "\n".join(str(w.message) for w in caught if "damaged" in str(w.message))
    names_both = str(damaged) in said and str(old / "step=000000001.ckpt") in said
    resumed = loads(ckdir(tmp_path, 1) / "last.ckpt")
    # resumed at step 1: the second run wrote step 3 and trained steps 1..2 on its own (two validations)
    ok = names_both and resumed["global_step"] == 3 and fingerprint(old) == before
    fault.trial(ok, data_lost=fingerprint(old) != before, note=said[:300])
    fault.shown(said)
    assert ok, said


def test_sample_refuses_a_damaged_file_and_passes_over_a_dangling_last(fault, tmp_path, monkeypatch, capsys):
    fault("sample from a damaged or dangling checkpoint", "lightning-opt-sample on flipped floats / dangling last")
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
    from lightning_opt.recipes import sample

    gpt2(tmp_path, monkeypatch, "--trainer.max_steps", "2", "--callbacks.async_checkpoint.every_n_steps", "1",
         "--model.model_config.vocab_size", "256")  # byte tokens: every sampled id decodes
    folder = ckdir(tmp_path, 0)
    step1, step2 = folder / "step=000000001.ckpt", folder / "step=000000002.ckpt"
    common = ["--max_new_tokens", "4", "--prompt", "def", "--device", "cpu"]
    reference = sample.main(["--ckpt_path", str(step1), *common])
    _flip_floats(step2)
    with pytest.raises(ValueError, match="SHA-256 does not match") as refused:
        sample.main(["--ckpt_path", str(step2), *common])
    with pytest.raises(ValueError, match="SHA-256 does not match"):
        GPT2SpeedrunModule.load_from_checkpoint(step2, map_location="cpu")
    step2.unlink()  # last.ckpt now dangles; step=1 is beside it
    capsys.readouterr()
    texts = sample.main(["--ckpt_path", str(folder.parent), *common])
    note = capsys.readouterr().err
    ok = texts == reference and "points at a missing file" in note and str(step1) in note
    fault.trial(ok, note=note[:300])
    fault.shown(str(refused.value))
    assert ok, (texts, reference, note)


def test_max_steps_0_is_refused_before_training(fault, tmp_path, monkeypatch):
    fault("max_steps 0", "--trainer.max_steps 0 on a recipe")
    with pytest.raises(ValueError, match="max_steps") as info:
        gpt2(tmp_path, monkeypatch, "--trainer.max_steps", "0")
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")]
    ok = "positive" in str(info.value) and not left
    fault.trial(ok, note=f"left behind: {left}")
    fault.shown(str(info.value))
    assert ok, (str(info.value), left)


def _save_under_a_size_limit(folder: str, out: str) -> None:
    """Child: train with a checkpoint every 2 steps; after the first, limit file sizes to half of it."""
    from lightning.pytorch import Callback

    ckpt = AsyncCheckpoint(dirpath=folder, every_n_steps=2, save_on_train_end=False)

    class Limit(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if ckpt.saves == 1 and resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY:
                ckpt.wait()
                size = os.path.getsize(os.path.join(folder, "step=000000002.ckpt"))
                resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    try:
        trainer(Path(out).parent, [ckpt, Limit()], max_steps=8).fit(
            TinyLM(dropout=0.0, ballast=4096), train_dataloaders=Batches(random_batches(8, 0)))
        text = "no error"
    except Exception as err:  # the run is expected to stop: its message is the result
        text = str(err)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    Path(out).write_text(text)


def test_save_under_a_file_size_limit_says_so_and_keeps_the_previous_checkpoint(fault, tmp_path):
    fault("file-size limit / quota on save", "RLIMIT_FSIZE below a checkpoint's size after the first save")
    folder, out = tmp_path / "ck", tmp_path / "error.txt"
    proc = start(_save_under_a_size_limit, str(folder), str(out))
    assert join_or_kill(proc, 120), "the child did not finish"
    text = out.read_text()
    files = step_files(folder)
    kept = [s for s, _ in files] == [2] and loads(folder / "last.ckpt")["global_step"] == 2
    kept = kept and not any((folder / ".writing").glob("*"))
    clear = (str(folder / "step=000000004.ckpt") in text and "could not be written" in text
             and "file-size limit" in text and str(folder / "step=000000002.ckpt") in text)
    fault.trial(kept and clear, data_lost=not kept, note=text[:300])
    fault.shown(text, "could not be written")
    assert kept, files
    assert clear, text
