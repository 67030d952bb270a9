"""A run resumed with another length follows the learning-rate schedule of the new length.

Each recipe (GPT-2, CLT, SPD) trains a few steps through its own ``main(args)``, then resumes from the run's
``last.ckpt`` with a larger ``max_steps`` (GPT-2 also with a larger ``--train_tokens``). Checked, against a
multiplier computed here from the rule in docs/optim.md ("step k gets the multiplier that a run planned for the
new total has at step k"): the learning rate of every resumed step, that the weights move, and that exactly one
log line names the checkpoint's total, the new total and the step. A ``max_steps`` before the checkpoint's step
is refused and leaves the checkpoint as it was. Resuming with the same length is bit-exact
(``tests/recipes/test_resume.py``, ``tests/reliability/test_kill_resume.py``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import lightning_utilities.core.rank_zero as rank_zero
import pytest
import torch

from tests.recipes.test_resume import _args, _run_checkpoints, target_ckpt  # noqa: F401 - a fixture
from tests.reliability._recipes import recipe_main

torch.set_num_threads(1)


def wsd(k: int, total: int, warmup: int, decay_fraction: float, min_ratio: float) -> float:
    warmup = min(warmup, total)
    if k < warmup:
        return (k + 1) / warmup
    decay_start = total - int(decay_fraction * total)
    if k < decay_start:
        return 1.0
    return 1.0 - (1.0 - min_ratio) * min(1.0, (k - decay_start) / (total - decay_start))


def cosine(k: int, total: int, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, k / total)))


class _LRProbe(pl.Callback):
    """The learning rates each optimizer step applies (over the scheduler's base rates), and the weights.

    Read in a step pre-hook of every (inner) optimizer: ``NaNSkip`` defers a step's scheduler update until
    that step's check is decided, so the rates at ``on_train_batch_start`` may not be the ones applied."""

    def __init__(self) -> None:
        self.ratios: dict[int, list[float]] = {}
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

        def record(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            ratios = [float(g["lr"]) / g["initial_lr"] for g in optimizer.param_groups]
            self.ratios.setdefault(trainer.global_step, []).extend(ratios)

        for opt in trainer.optimizers:
            for inner in getattr(opt, "optimizers", None) or [opt]:
                inner.register_step_pre_hook(record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _resume(monkeypatch: pytest.MonkeyPatch, main: Any, args: list[str]) -> tuple[_LRProbe, list[str]]:
    """Run ``main(args)`` with the probe attached; returns it and the rank-zero info lines about the schedule."""
    probe, lines = _LRProbe(), []
    original = pl.Trainer.fit

    def fit(trainer: pl.Trainer, *a: Any, **k: Any) -> Any:
        trainer.callbacks.append(probe)
        return original(trainer, *a, **k)

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "schedule" in record.getMessage():
                lines.append(record.getMessage())

    handler = Lines()
    rank_zero.log.addHandler(handler)
    monkeypatch.setattr(pl.Trainer, "fit", fit)
    try:
        main(args)
    finally:
        monkeypatch.undo()
        rank_zero.log.removeHandler(handler)
    return probe, lines


def _check(probe: _LRProbe, lines: list[str], old: int, new: int, expected: dict[int, float]) -> None:
    assert sorted(probe.ratios) == list(range(old, new)), sorted(probe.ratios)
    for k, mult in expected.items():
        for got in probe.ratios[k]:
            assert math.isclose(got, mult, rel_tol=1e-9, abs_tol=1e-12), (k, got, mult)
    moved = [k for k in probe.start if probe.start[k].is_floating_point() and not torch.equal(probe.start[k],
                                                                                             probe.end[k])]
    assert moved, "no weight changed after the resume"
    replanned = [ln for ln in lines if "re-planned" in ln]
    assert len(replanned) == 1, lines
    assert f"planned for {old} steps" in replanned[0] and f"this one for {new}" in replanned[0], replanned[0]
    assert f"at step {old}:" in replanned[0], replanned[0]


_GPT2 = ["--model.model_config.n_layer", "2", "--model.model_config.n_embd", "64", "--model.model_config.n_head", "2",
         "--model.compile", "false", "--model.model_config.block_size", "64", "--data.seq_len", "64",
         "--data.batch_size", "2", "--data.val_tokens", "256", "--trainer.val_check_interval", "100",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _gpt2_base(tmp_path: Path) -> list[str]:
    from lightning_opt.recipes import CONFIGS

    return ["--config", str(CONFIGS / "gpt2" / "demo.yaml"), *_GPT2,
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]


def _demo_wsd(k: int, total: int) -> float:  # gpt2/demo.yaml: wsd, no warmup, decay_fraction 0.4, min_ratio 0
    return wsd(k, total, 0, 0.4, 0.0)


def test_gpt2_resumed_with_more_steps_follows_the_longer_schedule(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main, base = recipe_main("gpt2"), _gpt2_base(tmp_path)
    main([*base, "--trainer.max_steps", "4"])  # ends with the learning rate at min_ratio 0
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    probe, lines = _resume(monkeypatch, main, [*base, "--trainer.max_steps", "8", "--ckpt_path", str(last)])
    _check(probe, lines, 4, 8, {k: _demo_wsd(k, 8) for k in range(4, 8)})


def test_gpt2_resumed_with_more_train_tokens_follows_the_longer_schedule(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main, base = recipe_main("gpt2"), [*_gpt2_base(tmp_path), "--trainer.max_steps", "-1"]
    main([*base, "--train_tokens", str(5 * 2 * 64)])  # 2 x 64 tokens per step: 5 steps
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 5
    probe, lines = _resume(monkeypatch, main, [*base, "--train_tokens", str(12 * 2 * 64), "--ckpt_path", str(last)])
    _check(probe, lines, 5, 12, {k: _demo_wsd(k, 12) for k in range(5, 12)})


def test_gpt2_max_steps_before_the_checkpoint_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main, base = recipe_main("gpt2"), _gpt2_base(tmp_path)
    main([*base, "--trainer.max_steps", "4"])
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    before = last.resolve().read_bytes()
    with pytest.raises(ValueError, match=r"checkpoint is at step 4.*max_steps=2.*above 4"):
        main([*base, "--trainer.max_steps", "2", "--ckpt_path", str(last)])
    assert last.resolve().read_bytes() == before


def test_clt_resumed_with_more_steps_follows_the_longer_schedule(
    tmp_path, monkeypatch, target_ckpt  # noqa: F811 - the fixture imported above
) -> None:
    monkeypatch.chdir(tmp_path)
    main = recipe_main("clt")
    # clt_demo.yaml: wsd, decay_fraction 0.3, min_ratio 0; warmup 2 here
    base = [*_args("clt_demo.yaml", tmp_path, target_ckpt), "--model.schedule.warmup_steps", "2",
            "--trainer.val_check_interval", "100"]
    main([*base, "--trainer.max_steps", "4"])
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    probe, lines = _resume(monkeypatch, main, [*base, "--trainer.max_steps", "10", "--ckpt_path", str(last)])
    _check(probe, lines, 4, 10, {k: wsd(k, 10, 2, 0.3, 0.0) for k in range(4, 10)})


def test_spd_resumed_with_more_steps_follows_the_longer_schedule(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    main = recipe_main("spd")
    base = _args("spd_tms_5-2.yaml", tmp_path, "")  # cosine to final_lr_frac 0, no warmup
    main([*base, "--trainer.max_steps", "3"])
    last = _run_checkpoints(tmp_path, 0) / "last.ckpt"
    probe, lines = _resume(monkeypatch, main, [*base, "--trainer.max_steps", "7", "--ckpt_path", str(last)])
    _check(probe, lines, 3, 7, {k: cosine(k, 7, 0.0) for k in range(3, 7)})


def test_schedule_lr_replans_a_state_of_another_total_and_refuses_a_foreign_one() -> None:
    """In a plain loop: a state saved by a ``ScheduleLR`` of another total re-plans; the same total restores the
    rates as saved; a state another scheduler wrote (a ``LambdaLR``) is refused, naming what to do."""
    from torch.optim.lr_scheduler import LambdaLR

    from lightning_opt.optim.schedules import ScheduleConfig, ScheduleLR

    def trained(sched_cls: type, total: int, steps: int) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5)
        cfg = ScheduleConfig(name="wsd", decay_fraction=0.5, min_ratio=0.0, total_steps=total)
        sched = sched_cls(opt, cfg) if sched_cls is ScheduleLR else sched_cls(opt, lambda k: 1.0)
        for _ in range(steps):
            opt.step()
            sched.step()
        return opt, sched

    _, foreign = trained(LambdaLR, 4, 4)
    _, fresh = trained(ScheduleLR, 10, 0)
    with pytest.raises(ValueError, match="not written by ScheduleLR.*weights only"):
        fresh.load_state_dict(foreign.state_dict())

    for saved_by in (ScheduleLR,):
        opt, sched = trained(saved_by, 4, 4)
        assert opt.param_groups[0]["lr"] == 0.0  # the 4-step run ended at min_ratio 0
        opt2, sched2 = trained(ScheduleLR, 10, 0)
        opt2.load_state_dict(opt.state_dict())
        sched2.load_state_dict(sched.state_dict())
        assert sched2.replanned == (4, 10, 4)
        assert opt2.param_groups[0]["lr"] == sched2.get_last_lr()[0] == 0.5 * wsd(4, 10, 0, 0.5, 0.0) == 0.5
        for k in range(5, 10):
            opt2.step()
            sched2.step()
            assert math.isclose(opt2.param_groups[0]["lr"], 0.5 * wsd(k, 10, 0, 0.5, 0.0), abs_tol=1e-12)

    opt, sched = trained(ScheduleLR, 10, 7)
    opt2, sched2 = trained(ScheduleLR, 10, 0)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert sched2.replanned is None and sched2.replan_message() is None
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and sched2.last_epoch == 7
