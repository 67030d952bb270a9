from __future__ import annotations

import pytest
import torch

from lightning_opt.callbacks import LossClamp
from tests.callbacks.conftest import ManualModule, TinyModule, make_batches, make_trainer


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
