"""The callbacks log like Lightning callbacks: through ``pl_module.log`` (so ``ModelCheckpoint`` and
``EarlyStopping`` can monitor their keys), once per optimizer step, and with per-setting checkpoint state."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_opt.callbacks import (
    AsyncCheckpoint,
    CudaMemoryHygiene,
    EvalThrottle,
    LossClamp,
    NaNSkip,
    SpeedMonitor,
)
from tests.callbacks.conftest import TinyModule, make_batches, make_trainer

TOKENS_PER_BATCH = 8  # make_batches: float [8, 16] inputs count their 8 rows


class RecordingModule(TinyModule):
    """Records every ``self.log`` name with the hook it was logged from."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged: list[tuple[str, str | None, int]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.logged.append((name, self._current_fx_name, self.trainer.global_step))
        super().log(name, value, *args, **kwargs)


class RecordingLogger(Logger):
    """A logger that keeps what Lightning writes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_speed_monitor_logs_once_per_optimizer_step_under_accumulation(tmp_path):
    module = RecordingModule(batches=make_batches(16))
    logger = RecordingLogger()
    trainer = make_trainer(tmp_path, [SpeedMonitor()], accumulate_grad_batches=4, log_every_n_steps=1,
                           logger=logger)
    trainer.fit(module)
    assert trainer.global_step == 4
    calls = [(fx, step) for name, fx, step in module.logged if name == "speed/tokens_per_sec"]
    assert calls == [("on_train_batch_end", s) for s in (1, 2, 3, 4)]
    written = [step for step, metrics in logger.rows if "speed/tokens_per_sec" in metrics]
    assert written == [0, 1, 2, 3]  # Lightning writes step metrics at the step count before the increment
    assert float(trainer.callback_metrics["speed/total_tokens"]) == 16 * TOKENS_PER_BATCH


def test_every_callback_logs_once_per_optimizer_step(tmp_path):
    module = RecordingModule(batches=make_batches(8))
    callbacks = [SpeedMonitor(), NaNSkip(), LossClamp(min=0.0, max=1e6), CudaMemoryHygiene(),
                 EvalThrottle(every_n_steps=100)]
    trainer = make_trainer(tmp_path, callbacks, accumulate_grad_batches=2, log_every_n_steps=1)
    trainer.fit(module)
    assert trainer.global_step == 4
    per_name = Counter(name for name, fx, _ in module.logged if fx == "on_train_batch_end")
    for name in ("speed/tokens_per_sec", "nan_skip/skipped_steps", "eval_throttle/val_runs"):
        assert per_name[name] == 4, (name, per_name)
    # LossClamp reads its device counter one log interval late: the first log step starts the copy.
    assert per_name["loss_clamp/clamped"] == 3


def test_model_checkpoint_monitors_a_speed_monitor_key(tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="speed/total_tokens", mode="max", save_top_k=1,
                           every_n_train_steps=2)
    trainer = make_trainer(tmp_path, [SpeedMonitor(log_every_n_steps=1), ckpt], enable_checkpointing=True,
                           log_every_n_steps=1)
    trainer.fit(TinyModule(batches=make_batches(6)))
    assert ckpt.best_model_score is not None
    assert float(ckpt.best_model_score) == 6 * TOKENS_PER_BATCH
    assert ckpt.best_model_path.endswith("step=6.ckpt")


def test_early_stopping_on_a_speed_monitor_key(tmp_path):
    stop = EarlyStopping(monitor="speed/total_tokens", mode="max", stopping_threshold=3 * 4 * TOKENS_PER_BATCH - 1,
                         check_on_train_epoch_end=True)
    trainer = make_trainer(tmp_path, [SpeedMonitor(log_every_n_steps=1), stop], max_epochs=10, log_every_n_steps=1)
    trainer.fit(TinyModule(batches=make_batches(4)))
    # The threshold is passed at the end of the third epoch (4 batches each): training stops there.
    assert trainer.current_epoch == 3
    assert stop.stopped_epoch == 2
    assert float(trainer.callback_metrics["speed/total_tokens"]) == 3 * 4 * TOKENS_PER_BATCH


def test_eval_throttle_validation_metrics_reach_callback_metrics(tmp_path):
    throttle = EvalThrottle(every_n_steps=2)
    trainer = make_trainer(tmp_path, [throttle], limit_val_batches=2, log_every_n_steps=1)
    trainer.fit(TinyModule(batches=make_batches(4)))
    assert throttle.val_runs == 2  # step 2, and step 4 (the last: a full validation)
    assert float(trainer.callback_metrics["eval_throttle/val_runs"]) == throttle.val_runs


def _callback_states(path: str) -> dict[str, Any]:
    return torch.load(path, weights_only=False)["callbacks"]


def test_two_speed_monitors_keep_separate_state_through_a_checkpoint(tmp_path):
    fast, slow = SpeedMonitor(log_every_n_steps=1), SpeedMonitor(log_every_n_steps=4, window=10)
    trainer = make_trainer(tmp_path, [fast, slow], max_steps=6)
    trainer.fit(TinyModule(batches=make_batches(8)))
    assert (fast.total_tokens, slow.total_tokens) == (6 * TOKENS_PER_BATCH, 4 * TOKENS_PER_BATCH)
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)
    states = _callback_states(path)
    assert fast.state_key != slow.state_key
    assert states[fast.state_key]["total_tokens"] == 6 * TOKENS_PER_BATCH
    assert states[slow.state_key]["total_tokens"] == 4 * TOKENS_PER_BATCH

    fast2, slow2 = SpeedMonitor(log_every_n_steps=1), SpeedMonitor(log_every_n_steps=4, window=10)
    resumed = make_trainer(tmp_path, [slow2, fast2], max_steps=6)  # order does not matter
    resumed.fit(TinyModule(batches=make_batches(8)), ckpt_path=path)
    assert (fast2.total_tokens, slow2.total_tokens) == (6 * TOKENS_PER_BATCH, 4 * TOKENS_PER_BATCH)


def test_two_async_checkpoints_keep_separate_state_through_a_checkpoint(tmp_path):
    a = AsyncCheckpoint(dirpath=str(tmp_path / "a"), every_n_steps=2, save_on_train_end=False, prewarm=False)
    b = AsyncCheckpoint(dirpath=str(tmp_path / "b"), every_n_steps=3, save_on_train_end=False, prewarm=False)
    trainer = make_trainer(tmp_path, [a, b], max_steps=6)
    trainer.fit(TinyModule(batches=make_batches(8)))
    assert (a.saves, b.saves) == (3, 2)
    path = str(tmp_path / "both.ckpt")
    trainer.save_checkpoint(path)
    states = _callback_states(path)
    assert states[a.state_key]["saves"] == 3 and states[b.state_key]["saves"] == 2

    a2 = AsyncCheckpoint(dirpath=str(tmp_path / "a"), every_n_steps=2, save_on_train_end=False, prewarm=False)
    b2 = AsyncCheckpoint(dirpath=str(tmp_path / "b"), every_n_steps=3, save_on_train_end=False, prewarm=False)
    make_trainer(tmp_path, [b2, a2], max_steps=6).fit(TinyModule(batches=make_batches(8)), ckpt_path=path)
    assert (a2.saves, a2.last_saved_step) == (3, 6)
    assert (b2.saves, b2.last_saved_step) == (2, 6)


def test_state_saved_under_the_class_name_still_loads_into_a_single_instance(tmp_path):
    trainer = make_trainer(tmp_path, [SpeedMonitor(log_every_n_steps=1)], max_steps=3)
    trainer.fit(TinyModule(batches=make_batches(8)))
    path = str(tmp_path / "old.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("SpeedMonitor")]
    checkpoint["callbacks"] = {"SpeedMonitor": checkpoint["callbacks"][key]}
    torch.save(checkpoint, path)

    other_settings = SpeedMonitor(log_every_n_steps=5)
    make_trainer(tmp_path, [other_settings], max_steps=3).fit(TinyModule(batches=make_batches(8)), ckpt_path=path)
    assert other_settings.total_tokens == 3 * TOKENS_PER_BATCH


def test_state_key_follows_the_settings():
    for make in (SpeedMonitor, NaNSkip, CudaMemoryHygiene, lambda: EvalThrottle(every_n_steps=5)):
        assert make().state_key == make().state_key
        assert make().state_key.startswith(type(make()).__qualname__ + "{")
    assert EvalThrottle(every_n_steps=5).state_key != EvalThrottle(every_n_steps=6).state_key
