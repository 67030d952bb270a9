from __future__ import annotations

import time

import pytest
from lightning.pytorch import Callback

from lightning_opt.callbacks import EvalThrottle
from tests.callbacks.conftest import TinyModule, make_batches, make_trainer


class ValCounter(Callback):
    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []  # (global step, batches in that run)

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.runs.append((trainer.global_step, 0))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            step, n = self.runs[-1]
            self.runs[-1] = (step, n + 1)


def test_every_n_steps_with_cap_and_full_final_validation(tmp_path):
    counter = ValCounter()
    cb = EvalThrottle(every_n_steps=3, max_val_batches=1)
    trainer = make_trainer(tmp_path, [cb, counter], limit_val_batches=1.0, max_epochs=1)
    trainer.fit(TinyModule(batches=make_batches(10), val_batches=3))
    # Capped runs at steps 3, 6, 9; the end-of-training run is uncapped.
    assert counter.runs == [(3, 1), (6, 1), (9, 1), (10, 3)]
    assert cb.val_runs == 4
    assert trainer.limit_val_batches == 1.0  # restored


def test_validation_survives_epochs_and_max_steps(tmp_path):
    counter = ValCounter()
    trainer = make_trainer(
        tmp_path, [EvalThrottle(every_n_steps=4), counter], limit_val_batches=2, max_epochs=5, max_steps=9
    )
    trainer.fit(TinyModule(batches=make_batches(3)))
    assert [s for s, _ in counter.runs] == [4, 8, 9]


class Slow(TinyModule):
    def __init__(self, train_s: float, val_s: float, **kw):
        super().__init__(**kw)
        self.train_s, self.val_s = train_s, val_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.train_s)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        time.sleep(self.val_s)
        return super().validation_step(batch, batch_idx)


def test_every_seconds(tmp_path):
    counter = ValCounter()
    cb = EvalThrottle(every_seconds=0.2, decide_every_n_steps=1, final_full_validation=False)
    trainer = make_trainer(tmp_path, [cb, counter], limit_val_batches=1)
    trainer.fit(Slow(0.02, 0.0, batches=make_batches(40), val_batches=1))  # ~0.8 s of training
    assert 2 <= len(counter.runs) <= 5, counter.runs


def test_adaptive_fraction_keeps_validation_share_bounded(tmp_path):
    cb = EvalThrottle(max_fraction=0.2, decide_every_n_steps=2, final_full_validation=False)
    trainer = make_trainer(tmp_path, [cb], limit_val_batches=2)
    t0 = time.monotonic()
    trainer.fit(Slow(0.01, 0.05, batches=make_batches(80), val_batches=2))
    total = time.monotonic() - t0
    assert cb.val_runs >= 2
    assert cb.val_seconds / total < 0.3  # target 0.2, slack for a loaded CI machine
    assert "eval_throttle/val_time_fraction" in cb.metrics


def test_config_is_validated():
    with pytest.raises(ValueError, match="at most one"):
        EvalThrottle(every_n_steps=2, every_seconds=3.0)
    with pytest.raises(ValueError, match="max_fraction"):
        EvalThrottle(max_fraction=1.5)


def test_final_validation_is_full_even_when_it_is_the_first(tmp_path):
    counter = ValCounter()
    cb = EvalThrottle(every_n_steps=100, max_val_batches=1)
    trainer = make_trainer(tmp_path, [cb, counter], limit_val_batches=1.0)
    trainer.fit(TinyModule(batches=make_batches(4), val_batches=3))
    assert counter.runs == [(4, 3)]


@pytest.mark.parametrize("check_every_epoch", [False, True])
def test_without_a_mode_the_trainer_schedule_decides(tmp_path, check_every_epoch):
    """No every_n_steps / every_seconds / max_fraction: validation runs exactly when the Trainer's own
    val_check_interval says (what a run without the callback does), plus a final run when that is not one."""
    kw = dict(val_check_interval=3, check_val_every_n_epoch=None, max_steps=7) if not check_every_epoch else {}
    plain = ValCounter()
    make_trainer(tmp_path / "plain", [plain], limit_val_batches=1.0, max_epochs=2, **kw).fit(
        TinyModule(batches=make_batches(5), val_batches=3))
    counter = ValCounter()
    cb = EvalThrottle()
    make_trainer(tmp_path / "cb", [cb, counter], limit_val_batches=1.0, max_epochs=2, **kw).fit(
        TinyModule(batches=make_batches(5), val_batches=3))
    final = 7 if not check_every_epoch else 10
    assert counter.runs == [*plain.runs, *([(final, 3)] if plain.runs[-1][0] != final else [])], (plain.runs,
                                                                                                 counter.runs)
    assert cb.val_runs == len(counter.runs)
    same = ValCounter()
    make_trainer(tmp_path / "same", [EvalThrottle(final_full_validation=False), same], limit_val_batches=1.0,
                 max_epochs=2, **kw).fit(TinyModule(batches=make_batches(5), val_batches=3))
    assert same.runs == plain.runs


def test_without_a_mode_a_run_resumed_inside_an_epoch_validates_on_the_trainer_schedule(tmp_path):
    """A resume inside an epoch calls no on_train_epoch_start: the callback still learns the Trainer's
    val_check_batch (it crashed Lightning's val check, or would never validate, if it did not)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1.0)
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    make_trainer(tmp_path / "a", [EvalThrottle(final_full_validation=False), ck], max_steps=3,
                 enable_checkpointing=True, **kw).fit(TinyModule(batches=make_batches(12), val_batches=2))
    (path,) = (tmp_path / "ck").glob("*step=3*.ckpt")
    resumed, plain = ValCounter(), ValCounter()
    make_trainer(tmp_path / "b", [EvalThrottle(final_full_validation=False), resumed], max_steps=9, **kw).fit(
        TinyModule(batches=make_batches(12), val_batches=2), ckpt_path=str(path))
    make_trainer(tmp_path / "c", [plain], max_steps=9, **kw).fit(
        TinyModule(batches=make_batches(12), val_batches=2), ckpt_path=str(path))
    assert resumed.runs and resumed.runs == plain.runs, (resumed.runs, plain.runs)
