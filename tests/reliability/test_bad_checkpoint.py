"""Wrong, damaged or stale checkpoints: a clear error before training, and no good checkpoint harmed.

"Harmed" is checked byte for byte: every file in the checkpoint folder before the failed run is still
there, unchanged, afterwards, and ``last.ckpt`` still resolves.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import AsyncCheckpoint
from lightning_opt.data import TokenShardDataModule
from lightning_opt.models.gpt2 import GPTConfig
from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
from lightning_opt.optim.factory import OptimConfig
from tests.reliability._harness import BATCH, SEQ_LEN, TinyLM, loads, make_shard, step_files, trainer
from tests.reliability._recipes import COMMON, RECIPES, recipe_main, run_bad


def _fingerprint(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.ckpt")) if p.exists()}


def _dm(shard: Path, **kw) -> TokenShardDataModule:
    kw = {"seq_len": SEQ_LEN, "batch_size": BATCH, **kw}
    return TokenShardDataModule(str(shard), None, **kw)


def _gpt(n_embd: int = 32) -> GPT2SpeedrunModule:
    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=n_embd, block_size=SEQ_LEN)
    return GPT2SpeedrunModule(cfg, OptimConfig(name="adamw", lr=1e-3))


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return make_shard(tmp_path / "train.bin", 10 * BATCH * SEQ_LEN + 1)


def _first_run(tmp_path: Path, shard: Path, module, steps: int = 6) -> Path:
    ckdir = tmp_path / "ck"
    t = trainer(tmp_path, [AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=3, keep_last_k=2)], max_steps=steps, max_epochs=-1)
    t.fit(module, datamodule=_dm(shard))
    return ckdir


def _resume_fails(tmp_path: Path, shard: Path, module, ckpt_path: Path, ckdir: Path) -> tuple[BaseException | None, bool, int]:
    """Resume with an AsyncCheckpoint on the same folder; returns (error, folder untouched, steps done)."""
    before = _fingerprint(ckdir)
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1, keep_last_k=1)
    t = trainer(tmp_path / "again", [cb], max_steps=12, max_epochs=-1)
    err = None
    try:
        t.fit(module, datamodule=_dm(shard), ckpt_path=str(ckpt_path))
    except Exception as e:  # noqa: BLE001 - the test checks the error's text
        err = e
    untouched = _fingerprint(ckdir) == before and loads(ckdir / "last.ckpt") is not None
    return err, untouched, t.global_step


def test_checkpoint_of_another_config(fault, tmp_path, shard):
    fault("checkpoint of another config", "resume a GPT-2 with n_embd=64 from an n_embd=32 checkpoint")
    ckdir = _first_run(tmp_path, shard, _gpt(32))
    err, untouched, steps = _resume_fails(tmp_path, shard, _gpt(64), ckdir / "last.ckpt", ckdir)
    msg = str(err)
    clear = err is not None and "n_embd=32 vs 64" in msg and "another model" in msg and "model_config" in msg
    fault.trial(clear and untouched and steps == 0, data_lost=not untouched, note=msg[:200])
    fault.shown(msg)
    assert clear, msg
    assert untouched and steps == 0


def test_checkpoint_of_another_model(fault, tmp_path, shard):
    fault("checkpoint of another model", "resume a GPT-2 module from a checkpoint of a different LightningModule")
    ckdir = _first_run(tmp_path, shard, TinyLM())
    err, untouched, steps = _resume_fails(tmp_path, shard, _gpt(32), ckdir / "last.ckpt", ckdir)
    msg = str(err)
    # must say it is the wrong kind of checkpoint (not only list missing keys) and what to do
    clear = err is not None and ("another model" in msg or "not a GPT2SpeedrunModule" in msg)
    fault.trial(clear and untouched and steps == 0, data_lost=not untouched, note=msg[:200])
    fault.shown(msg)
    assert untouched and steps == 0
    assert clear, msg[:1000]


def test_truncated_checkpoint_is_refused(fault, tmp_path, shard):
    fault("truncated checkpoint file", "resume from a checkpoint cut short (e.g. an interrupted copy)")
    ckdir = _first_run(tmp_path, shard, TinyLM())
    damaged = tmp_path / "copied.ckpt"
    data = (ckdir / "last.ckpt").read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    err, untouched, steps = _resume_fails(tmp_path, shard, TinyLM(), damaged, ckdir)
    fault.trial(err is not None and untouched and steps == 0, data_lost=not untouched, note=str(err)[:200])
    assert err is not None and untouched and steps == 0


def test_truncated_checkpoint_in_the_recipe_names_the_file(fault, tmp_path, monkeypatch, capsys):
    """Through the GPT-2 recipe the user must learn which file is damaged (torch alone says
    "[Errno 22] Invalid argument" or "failed finding central directory")."""
    fault("truncated checkpoint file (recipe)", "--ckpt_path to a checkpoint cut in half, GPT-2 recipe")
    ckdir = _first_run(tmp_path, make_shard(tmp_path / "t.bin", 10 * BATCH * SEQ_LEN + 1), _gpt(32))
    data = (ckdir / "last.ckpt").read_bytes()
    words = ("damaged", "truncated", "incomplete", "corrupt", "not a complete")
    problems = []
    for fraction in (0.25, 0.5, 0.9):  # where the cut lands changes what torch raises
        damaged = tmp_path / f"copied_{int(fraction * 100)}.ckpt"
        damaged.write_bytes(data[: int(len(data) * fraction)])
        message, trained = run_bad("gpt2", ["--ckpt_path", str(damaged)], tmp_path, monkeypatch, capsys,
                                   when="trained")
        ok = damaged.name in message and any(w in message for w in words) and not trained
        fault.trial(ok, note=f"cut at {fraction}: {message[-250:]}")
        if not ok:
            problems.append(f"cut at {fraction}: {message[-300:]}")
    assert not problems, problems


def test_dangling_last_link_is_refused(fault, tmp_path, shard):
    fault("dangling last.ckpt", "last.ckpt points at a file someone deleted")
    ckdir = _first_run(tmp_path, shard, TinyLM())
    target = ckdir / os.readlink(ckdir / "last.ckpt")
    target.unlink()
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1, keep_last_k=1)
    with pytest.raises(FileNotFoundError) as info:
        trainer(tmp_path / "again", [cb], max_steps=12, max_epochs=-1).fit(TinyLM(), datamodule=_dm(shard),
                                                           ckpt_path=str(ckdir / "last.ckpt"))
    older = step_files(ckdir)
    ok = "last.ckpt" in str(info.value) and len(older) == 1 and loads(older[0][1]) is not None
    fault.trial(ok, data_lost=len(older) != 1, note=str(info.value)[:200])
    fault.shown(str(info.value))
    assert ok, (str(info.value), older)


def test_leftovers_of_a_crashed_save_do_not_break_the_next_run(fault, tmp_path, shard):
    fault("leftover temp files", "a partial .writing/archive.tmp and .last.ckpt.tmp from a killed run")
    ckdir = _first_run(tmp_path, shard, TinyLM())
    (ckdir / ".writing").mkdir(exist_ok=True)
    (ckdir / ".writing" / "archive.tmp").write_bytes(b"PK\x03\x04 half a zip")
    os.symlink("step=000000099.ckpt", ckdir / ".last.ckpt.tmp")
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=3, keep_last_k=2)
    t = trainer(tmp_path / "again", [cb], max_steps=12, max_epochs=-1)
    t.fit(TinyLM(), datamodule=_dm(shard), ckpt_path=str(ckdir / "last.ckpt"))
    last = loads(ckdir / "last.ckpt")
    ok = t.global_step == 12 and last is not None and last["global_step"] == 12
    fault.trial(ok, note=f"step {t.global_step}, last {None if last is None else last['global_step']}")
    assert ok


def test_fresh_run_into_a_folder_with_newer_checkpoints(fault, tmp_path, shard):
    """A restart that forgets ckpt_path writes step=3 next to an older run's step=9: neither the old
    run's checkpoints nor the new run's may vanish, and last.ckpt must resolve."""
    fault("fresh run into an old checkpoint folder", "restart without ckpt_path into a folder with newer steps")
    ckdir = _first_run(tmp_path, shard, TinyLM(), steps=9)
    old = _fingerprint(ckdir)
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=3, keep_last_k=2, save_on_train_end=False)
    trainer(tmp_path / "again", [cb], max_steps=3).fit(TinyLM(), datamodule=_dm(shard))
    last = ckdir / "last.ckpt"
    resolved = last.exists() and loads(last) is not None
    newest_written = resolved and loads(last)["global_step"] == 3
    old_kept = all(_fingerprint(ckdir).get(n) == h for n, h in old.items() if n != "last.ckpt")
    ok = resolved and newest_written and old_kept
    fault.trial(ok, data_lost=not (resolved and old_kept),
                note=f"last resolves: {resolved}, points at the new save: {newest_written}, old kept: {old_kept}")
    assert old_kept, "checkpoints of the earlier run were deleted"
    assert resolved and newest_written, "last.ckpt does not resolve to the save just written"


def test_fresh_run_never_overwrites_another_runs_checkpoint(fault, tmp_path, shard):
    """A plain Trainer restarted without ckpt_path into a folder holding the step it is about to save: it
    warns at the start, stops at that save with an error naming the file, and every file of the earlier run
    keeps its bytes."""
    fault("fresh run reaching another run's step", "restart without ckpt_path whose save would overwrite step=6")
    ckdir = _first_run(tmp_path, shard, TinyLM(), steps=9)  # keeps step=6 and step=9 (keep_last_k=2)
    old = _fingerprint(ckdir)
    assert "step=000000006.ckpt" in old
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=3, keep_last_k=2, save_on_train_end=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=r"step=000000006\.ckpt exists and another run wrote it") as err:
            trainer(tmp_path / "again", [cb], max_steps=9).fit(TinyLM(), datamodule=_dm(shard))
    warned = any("never overwrites them" in str(w.message) for w in caught)
    now = _fingerprint(ckdir)
    old_kept = all(now.get(n) == h for n, h in old.items() if n != "last.ckpt")  # last: the newest save
    own = "step=000000003.ckpt" in now and loads(ckdir / "step=000000003.ckpt")["global_step"] == 3
    ok = warned and old_kept and own
    fault.trial(ok, data_lost=not old_kept, note=f"warned {warned}, old kept {old_kept}, own step 3 {own}")
    fault.shown(str(err.value), "another run wrote it")
    assert old_kept, "a checkpoint of the earlier run was overwritten"
    assert warned and own, (warned, sorted(now))


def test_changed_data_layout_warns_that_resume_is_not_exact(fault, tmp_path, shard):
    fault("data layout changed on resume", "resume with another batch_size than the checkpoint's")
    ckdir = _first_run(tmp_path, shard, TinyLM())
    t = trainer(tmp_path / "again", [], max_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(TinyLM(), datamodule=_dm(shard, batch_size=2), ckpt_path=str(ckdir / "last.ckpt"))
    texts = [str(w.message) for w in caught]
    ok = any("batch_size=4" in m and "not an exact resume" in m for m in texts)
    fault.trial(ok, note="" if ok else f"warnings: {texts[:3]}")
    fault.shown("\n".join(texts), "not an exact resume")
    assert ok, texts


# -- the other recipes: resume with a config whose shapes differ ---------------------------------------


def _recipe_resume_with_other_config(tmp_path, monkeypatch, recipe: str, base: list[str], change: list[str]):
    monkeypatch.chdir(tmp_path)
    main = recipe_main(recipe)
    args = ["--config", str(RECIPES[recipe][1]), *COMMON, "--trainer.enable_checkpointing", "true",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *base]
    main(args)
    ckpts = sorted((tmp_path / "runs").rglob("*.ckpt"))
    assert ckpts, "the first run wrote no checkpoint"
    before = {p: p.read_bytes() for p in ckpts}
    err = None
    try:
        main([*args, *change, "--ckpt_path", str(ckpts[-1]), "--trainer.max_steps", "4"])
    except Exception as e:  # noqa: BLE001 - the test checks the error's text
        err = e
    untouched = all(p.exists() and p.read_bytes() == b for p, b in before.items())
    return err, untouched


def test_spd_checkpoint_of_another_config(fault, tmp_path, monkeypatch):
    fault("checkpoint of another config (SPD)", "resume SPD with C=10 components from a C=20 checkpoint")
    err, untouched = _recipe_resume_with_other_config(
        tmp_path, monkeypatch, "spd", ["--model.target.train_steps", "5"],
        ["--model.spd.components", "[{pattern: linear1, C: 10}, {pattern: linear2, C: 10}]"],
    )
    msg = str(err)
    # must name the config difference (C / components), not only tensor shapes, and say what to do
    clear = err is not None and "checkpoint" in msg and ("C=20" in msg or "components" in msg)
    fault.trial(clear and untouched, data_lost=not untouched, note=msg[:300])
    assert untouched
    assert clear, msg[:1500]


@pytest.mark.slow
def test_clt_checkpoint_of_another_config(fault, tmp_path, monkeypatch):
    """Slow: the demo target GPT is trained on first use (cached afterwards)."""
    fault("checkpoint of another config (CLT)", "resume a CLT with n_features=128 from a checkpoint of the demo config (256)")
    err, untouched = _recipe_resume_with_other_config(
        tmp_path, monkeypatch, "clt", ["--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2"],
        ["--model.clt.n_features", "128"],
    )
    msg = str(err)
    clear = err is not None and "checkpoint" in msg and "n_features" in msg
    fault.trial(clear and untouched, data_lost=not untouched, note=msg[:300])
    assert untouched
    assert clear, msg[:1500]


# -- a damaged checkpoint in the folder AsyncCheckpoint manages ------------------------------------------


def _flip_floats(path: Path, n: int = 1000) -> None:
    """Flip an exponent bit of ``n`` float32 values in the checkpoint's largest tensor record, in place:
    the zip stays valid and ``torch.load`` reads it without complaint."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        start = info.header_offset + 30 + name_len + extra_len
        count = min(n, info.file_size // 4)
        f.seek(start)
        values = bytearray(f.read(4 * count))
        for i in range(count):
            values[4 * i + 3] ^= 0x40
        f.seek(start)
        f.write(values)


class _StartStep(Callback):
    def __init__(self) -> None:
        self.step = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(fault, tmp_path, shard):
    fault("damaged checkpoint in the folder", "1,000 floats flipped in the newest checkpoint, resume from last.ckpt")
    ckdir = tmp_path / "ck"
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=3, keep_last_k=3)
    trainer(tmp_path, [cb], max_steps=9, max_epochs=-1).fit(TinyLM(), datamodule=_dm(shard))
    newest = ckdir / "step=000000009.ckpt"
    _flip_floats(newest)
    assert loads(newest) is not None  # torch alone does not notice
    reference = TinyLM()
    trainer(tmp_path / "ref", [], max_steps=7, max_epochs=-1).fit(reference, datamodule=_dm(shard))

    start_step = _StartStep()
    resumed = TinyLM()
    cb = AsyncCheckpoint(dirpath=str(ckdir), every_n_steps=1, keep_last_k=2)
    t = trainer(tmp_path / "again", [cb, start_step], max_steps=7, max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(resumed, datamodule=_dm(shard), ckpt_path=str(ckdir / "last.ckpt"))
    said = "\n".join(str(w.message) for w in caught)
    fault.shown(said, "damaged")
    named = "step=000000009.ckpt" in said and "damaged" in said and "step=000000006.ckpt" in said
    exact = start_step.step == 6 and all(
        torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters())
    )
    names = sorted(p.name for p in ckdir.glob("step=*.ckpt"))
    # step 3 is the first run's: a run prunes only its own saves
    kept = names == ["step=000000003.ckpt", "step=000000006.ckpt", "step=000000007.ckpt", "step=000000009.ckpt"]
    fault.trial(named and exact and kept, data_lost=not kept, note=said[:200])
    assert named, said
    assert exact, f"resumed at step {start_step.step}"
    assert kept, names  # the damaged file stays for inspection; it never counts as one of the K kept
