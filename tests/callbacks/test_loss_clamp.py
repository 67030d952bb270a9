from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_opt.callbacks import LossClamp, NaNSkip
from tests.callbacks.conftest import (
    ManualModule,
    SyncErrorWindow,
    TinyModule,
    WindowProbe,
    assert_same,
    make_batches,
    make_trainer,
    snapshot,
)


def _grad_after(cb: LossClamp, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (w * w).sum() * scale
    cb.on_before_backward(None, None, loss)  # type: ignore[arg-type]
    loss.backward()
    return loss.detach(), w.grad


def test_zero_mode_clamps_value_and_zeroes_gradient():
    loss, grad = _grad_after(LossClamp(max=20.0), scale=10.0)  # loss 50 > 20
    assert loss.item() == 20.0
    assert torch.equal(grad, torch.zeros(2))
    loss, grad = _grad_after(LossClamp(max=20.0), scale=1.0)  # loss 5: untouched
    assert loss.item() == 5.0
    assert torch.equal(grad, torch.tensor([2.0, 4.0]))


def test_scale_mode_keeps_direction_scaled_by_bound_over_loss():
    loss, grad = _grad_after(LossClamp(max=20.0, gradient="scale"), scale=10.0)
    assert loss.item() == pytest.approx(20.0)
    assert torch.allclose(grad, torch.tensor([20.0, 40.0]) * (20.0 / 50.0))


def test_scale_mode_below_min_clamps():
    loss, grad = _grad_after(LossClamp(min=10.0, max=20.0, gradient="scale"), scale=1.0)  # loss 5 < 10
    assert loss.item() == 10.0
    assert torch.equal(grad, torch.zeros(2))


def test_nan_loss_stays_nan():
    loss, _ = _grad_after(LossClamp(), scale=float("nan"))
    assert torch.isnan(loss)


@pytest.mark.parametrize("module_cls", [TinyModule, ManualModule])
def test_counts_clamped_batches_in_training(tmp_path, module_cls):
    batches = make_batches(6)
    for i in (1, 4):  # two batches with a huge loss
        x, y = batches[i]
        batches[i] = (x, y + 100.0)
    cb = LossClamp(max=20.0)
    trainer = make_trainer(tmp_path, [cb], log_every_n_steps=3)
    trainer.fit(module_cls(batches=batches))
    assert cb.clamped_total == 2
    assert cb.metrics["loss_clamp/clamped"] >= 1  # logged lazily: the copy from the previous log step


def test_config_is_validated():
    with pytest.raises(ValueError, match="min < max"):
        LossClamp(min=5.0, max=1.0)
    with pytest.raises(ValueError, match="gradient"):
        LossClamp(gradient="straight")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max > 0"):
        LossClamp(min=-2.0, max=-1.0, gradient="scale")


def _with_target_shift(batches, at: int, shift: float):
    out = list(batches)
    x, y = out[at]
    out[at] = (x, y + shift)
    return out


class _LossProbe(Callback):
    """The loss value handed to backward, per batch, after the callbacks listed before it."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx

    def on_before_backward(self, trainer, pl_module, loss):
        self.seen[self.batch_idx] = float(loss.detach())


@pytest.mark.parametrize("accumulate", [1, 4])
def test_bounds_are_in_training_step_units_under_accumulation(tmp_path, accumulate):
    """Lightning divides the loss by accumulate_grad_batches before backward; the bounds still
    apply to what training_step returned (a loss of about 50 is clamped to 20 at any accumulation)."""
    batches = _with_target_shift(make_batches(8), 5, 7.0)  # loss ~50 at batch 5, ~1 elsewhere
    clamp, probe = LossClamp(max=20.0), _LossProbe()
    m = TinyModule(batches=batches)
    make_trainer(tmp_path, [clamp, probe], accumulate_grad_batches=accumulate).fit(m)
    assert m.losses[5] > 40.0 and max(m.losses[:5] + m.losses[6:]) < 20.0
    assert clamp.clamped_total == 1
    assert probe.seen[5] * accumulate == pytest.approx(20.0)
    assert probe.seen[4] * accumulate == pytest.approx(m.losses[4])


def _window(bad: int, accumulate: int) -> range:
    start = bad - bad % accumulate
    return range(start, start + accumulate)


def _fit_and_reference(tmp_path, batches, bad, accumulate, callbacks):
    window = _window(bad, accumulate)
    probe = WindowProbe(window[0], window[-1])
    m = TinyModule(batches=batches)
    t1 = make_trainer(tmp_path, [*callbacks, probe], accumulate_grad_batches=accumulate)
    t1.fit(m)
    ref = TinyModule(batches=[b for i, b in enumerate(batches) if i not in window])
    t2 = make_trainer(tmp_path, [], accumulate_grad_batches=accumulate)
    t2.fit(ref)
    return probe, snapshot(m, t1), snapshot(ref, t2)


@pytest.mark.parametrize("nan_skip_first", [True, False])
@pytest.mark.parametrize("accumulate", [1, 4])
def test_skip_step_when_clamped_leaves_params_and_moments_unchanged(tmp_path, nan_skip_first, accumulate):
    batches = _with_target_shift(make_batches(8), 5, 100.0)  # a finite loss ~1e4 > max
    clamp, skip = LossClamp(max=20.0, skip_step_when_clamped=True), NaNSkip()
    callbacks = [skip, clamp] if nan_skip_first else [clamp, skip]
    probe, got, want = _fit_and_reference(tmp_path, batches, 5, accumulate, callbacks)
    probe.assert_unchanged()  # params, AdamW step/exp_avg/exp_avg_sq
    assert_same(got, want)  # and the LR schedule did not advance
    assert skip.skipped_total == 1 and clamp.clamped_total == 1


@pytest.mark.parametrize("nan_skip_first", [True, False])
@pytest.mark.parametrize("accumulate", [1, 4])
def test_inf_loss_is_skipped_by_nan_skip_in_any_order(tmp_path, nan_skip_first, accumulate):
    # (pred - 1e20)^2 overflows to inf in float32; clamped, its gradient is 0 (finite), so only the
    # loss check can catch it.
    batches = _with_target_shift(make_batches(8), 5, 1e20)
    clamp, skip = LossClamp(max=20.0), NaNSkip()
    callbacks = [skip, clamp] if nan_skip_first else [clamp, skip]
    probe, got, want = _fit_and_reference(tmp_path, batches, 5, accumulate, callbacks)
    probe.assert_unchanged()
    assert_same(got, want)
    assert skip.skipped_total == 1


def test_clamped_step_without_skip_still_moves_adam(tmp_path):
    """gradient='zero' zeroes the batch's gradient but AdamW still steps with its decayed moments."""
    batches = _with_target_shift(make_batches(8), 5, 100.0)
    probe = WindowProbe(5, 5)
    clamp = LossClamp(max=20.0)
    make_trainer(tmp_path, [clamp, NaNSkip(), probe]).fit(TinyModule(batches=batches))
    assert clamp.clamped_total == 1
    probe.assert_changed()


def test_skip_step_when_clamped_needs_nan_skip(tmp_path):
    trainer = make_trainer(tmp_path, [LossClamp(skip_step_when_clamped=True)])
    with pytest.raises(ValueError, match="add NaNSkip"):
        trainer.fit(TinyModule(batches=make_batches(2)))


def test_bounds_are_in_training_step_units_with_a_grad_scaler(tmp_path):
    """A GradScaler multiplies the loss by its scale (1024 here) before backward; the bounds follow."""
    from lightning.pytorch.plugins import MixedPrecision

    batches = _with_target_shift(make_batches(8), 5, 7.0)  # loss ~50 at batch 5, ~1 elsewhere
    clamp, probe = LossClamp(max=20.0), _LossProbe()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = make_trainer(tmp_path, [clamp, probe], plugins=[plugin], accumulate_grad_batches=2)
    trainer.fit(TinyModule(batches=batches))
    assert clamp.clamped_total == 1
    assert probe.seen[5] == pytest.approx(20.0 * 1024 / 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nan_skip_first", [True, False])
def test_skip_step_when_clamped_does_not_sync_on_cuda(tmp_path, nan_skip_first):
    """set_sync_debug_mode("error") from batch start to batch end after the first optimizer step
    (decided on the host: its optimizer state does not exist yet); fused AdamW, accumulation 2."""

    batches = _with_target_shift(make_batches(8), 5, 100.0)
    clamp, skip = LossClamp(max=20.0, skip_step_when_clamped=True), NaNSkip()
    callbacks = [skip, clamp] if nan_skip_first else [clamp, skip]
    m = TinyModule(batches=batches, fused=True, record_losses=False)
    t1 = make_trainer(
        tmp_path, [*callbacks, SyncErrorWindow(from_batch=2)], accelerator="gpu", accumulate_grad_batches=2, log_every_n_steps=1000
    )
    t1.fit(m)
    assert skip.skipped_total == 1 and clamp.clamped_total == 1
    ref = TinyModule(batches=[b for i, b in enumerate(batches) if i not in (4, 5)], fused=True)
    t2 = make_trainer(tmp_path, [], accelerator="gpu", accumulate_grad_batches=2)
    t2.fit(ref)
    assert_same(snapshot(m, t1), snapshot(ref, t2))


def test_clamp_skips_count_towards_max_consecutive_skips(tmp_path):
    batches = make_batches(6)
    for i in (2, 3):
        batches = _with_target_shift(batches, i, 100.0)
    callbacks = [LossClamp(max=20.0, skip_step_when_clamped=True), NaNSkip(max_consecutive_skips=2)]
    with pytest.raises(RuntimeError, match=r"2 consecutive .*last reason: loss clamped by LossClamp"):
        make_trainer(tmp_path, callbacks).fit(TinyModule(batches=batches))
