from __future__ import annotations

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_opt.callbacks import NaNSkip
from tests.callbacks.conftest import (
    ManualModule,
    SyncErrorWindow,
    TinyModule,
    WindowProbe,
    assert_same,
    make_batches,
    make_trainer,
    optimizer_state,
    snapshot,
)


def _fit(tmp_path, module, callbacks):
    trainer = make_trainer(tmp_path, callbacks)
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("mode", ["device", "host"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [0, 3])
def test_skip_is_bit_identical_to_never_taking_the_step(tmp_path, mode, fused, bad):
    batches = make_batches(6)
    skip = NaNSkip(mode=mode)
    poisoned = TinyModule(batches=batches, fused=fused, nan_at=(bad,))
    t1 = _fit(tmp_path, poisoned, [skip])
    without = [b for i, b in enumerate(batches) if i != bad]
    reference = TinyModule(batches=without, fused=fused)
    t2 = _fit(tmp_path, reference, [])
    # Scheduler not advanced on the skipped step: both have stepped len(without) times.
    assert_same(snapshot(poisoned, t1), snapshot(reference, t2))
    assert skip.skipped_total == 1
    assert skip.steps_seen == len(batches)


def test_nan_gradient_with_finite_loss_is_skipped(tmp_path):
    batches = make_batches(5)
    skip = NaNSkip()
    m = TinyModule(batches=batches, grad_nan_at=(2,))
    t1 = _fit(tmp_path, m, [skip])
    ref = TinyModule(batches=[b for i, b in enumerate(batches) if i != 2])
    t2 = _fit(tmp_path, ref, [])
    assert_same(snapshot(m, t1), snapshot(ref, t2))
    assert skip.skipped_total == 1
    assert all(p.isfinite().all() for p in m.parameters())


@pytest.mark.parametrize("mode", ["device", "host"])
def test_manual_optimization(tmp_path, mode):
    batches = make_batches(5)
    skip = NaNSkip(mode=mode)
    m = ManualModule(batches=batches, nan_at=(1,))
    t1 = _fit(tmp_path, m, [skip])
    ref = ManualModule(batches=[b for i, b in enumerate(batches) if i != 1])
    t2 = _fit(tmp_path, ref, [])
    assert_same(snapshot(m, t1), snapshot(ref, t2))
    assert skip.skipped_total == 1


def test_max_consecutive_skips_names_steps_and_batches(tmp_path):
    m = TinyModule(batches=make_batches(8), nan_at=(2, 3, 4))
    with pytest.raises(
        RuntimeError, match=r"3 consecutive .*global steps \[2, 3, 4\], batch indices \[2, 3, 4\]"
    ):
        _fit(tmp_path, m, [NaNSkip(max_consecutive_skips=3)])


def test_loss_spike_is_skipped(tmp_path):
    batches = make_batches(30)
    x, y = batches[25]
    batches[25] = (x, y * 1e4)  # a loss many standard deviations above the running mean
    skip = NaNSkip(spike_zscore=6.0, spike_warmup=10, spike_window=10)
    _fit(tmp_path, TinyModule(batches=batches, lr=1e-3), [skip])
    assert skip.skipped_total == 1
    assert list(skip._recent)[25] is True


def test_state_dict_round_trip_and_logged_keys(tmp_path):
    skip = NaNSkip()
    t = make_trainer(tmp_path, [skip], logger=CSVLogger(tmp_path), log_every_n_steps=2)
    t.fit(TinyModule(batches=make_batches(4), nan_at=(1,)))
    assert skip.metrics["nan_skip/skipped_steps"] == 1
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "nan_skip/skipped_steps" in logged
    other = NaNSkip()
    other.load_state_dict(skip.state_dict())
    assert other.state_dict() == skip.state_dict()


def test_config_is_validated():
    with pytest.raises(ValueError, match="mode"):
        NaNSkip(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        NaNSkip(max_consecutive_skips=0)
    with pytest.raises(ValueError, match="nothing to check"):
        NaNSkip(check_loss=False, check_grads=False)


def test_optimizer_step_is_unwrapped_after_fit(tmp_path):
    m = TinyModule(batches=make_batches(2))
    t = _fit(tmp_path, m, [NaNSkip()])
    assert "step" not in t.optimizers[0].__dict__ or not hasattr(
        t.optimizers[0].step, "_lightning_opt_nan_skip"
    )
    assert torch.isfinite(next(m.parameters())).all()


def test_gradient_accumulation_skips_the_whole_window(tmp_path):
    batches = make_batches(8)
    skip = NaNSkip()
    m = TinyModule(batches=batches, nan_at=(3,))  # window (2, 3) holds the NaN
    t1 = make_trainer(tmp_path, [skip], accumulate_grad_batches=2)
    t1.fit(m)
    ref = TinyModule(batches=[b for i, b in enumerate(batches) if i not in (2, 3)])
    t2 = make_trainer(tmp_path, [], accumulate_grad_batches=2)
    t2.fit(ref)
    assert_same(snapshot(m, t1), snapshot(ref, t2))
    assert skip.skipped_total == 1 and skip.steps_seen == 4


@pytest.mark.parametrize("fused", [False, True])
def test_previous_decision_is_read_after_backward_is_queued(tmp_path, fused):
    """In device mode step t's decision is read inside step t+1 only after its backward: reading
    it before would drain the device queue every step (a sync in effect: +2.5% on GPT-2 124M)."""
    from lightning.pytorch import Callback

    seen: list[tuple[int, int, int]] = []  # (batch, decided at on_after_backward, at batch end)

    class Probe(Callback):
        def on_after_backward(self, trainer, pl_module):
            self.at_backward = skip.steps_seen

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((batch_idx, self.at_backward, skip.steps_seen))

    skip = NaNSkip()
    m = TinyModule(batches=make_batches(5), fused=fused, nan_at=(2,))
    _fit(tmp_path, m, [skip, Probe()])
    # Step 0 (no optimizer state yet) is decided on the host at once; from step 1 on, step t-1's
    # decision is still pending after step t's backward and read before step t's update.
    assert seen == [(0, 0, 1), (1, 1, 1), (2, 1, 2), (3, 2, 3), (4, 3, 4)]
    assert skip.skipped_total == 1 and skip.steps_seen == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False])
def test_device_mode_does_not_sync_on_cuda(tmp_path, fused):
    """set_sync_debug_mode("error") from batch start to batch end, after the first step (whose
    optimizer state does not exist yet and is decided on the host). fused=False uses a
    capturable (device-side step count) foreach AdamW: the snapshot path."""
    batches = make_batches(6)
    skip = NaNSkip()
    m = TinyModule(batches=batches, nan_at=(3,), fused=fused, capturable=not fused, record_losses=False)
    # Guard after NaNSkip so that NaNSkip's batch-end hook runs inside the guarded window.
    t1 = make_trainer(tmp_path, [skip, SyncErrorWindow(from_batch=1)], accelerator="gpu", log_every_n_steps=1000)
    t1.fit(m)
    assert skip.skipped_total == 1
    ref = TinyModule(
        batches=[b for i, b in enumerate(batches) if i != 3],
        fused=fused,
        capturable=not fused,
        record_losses=False,
    )
    t2 = make_trainer(tmp_path, [], accelerator="gpu")
    t2.fit(ref)
    assert_same(snapshot(m, t1), snapshot(ref, t2))


class _CountingMomentum(torch.optim.Optimizer):
    """Momentum SGD that keeps a Python int in its state (like some third-party optimizers)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["n"] = 0
                    state["buf"] = torch.zeros_like(p)
                state["n"] += 1
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] / state["n"] ** 0.5)
        return loss


class _CountingModule(TinyModule):
    def configure_optimizers(self):
        return _CountingMomentum(self.parameters())


def test_optimizer_with_host_numbers_in_state_falls_back_to_host(tmp_path):
    batches = make_batches(6)
    m = _CountingModule(batches=batches, nan_at=(3,))
    t1 = make_trainer(tmp_path, [NaNSkip()])
    with pytest.warns(UserWarning, match="host numbers"):
        t1.fit(m)
    ref = _CountingModule(batches=[b for i, b in enumerate(batches) if i != 3])
    make_trainer(tmp_path, []).fit(ref)
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert [s["n"] for s in t1.optimizers[0].state.values()] == [5] * 4


class _TwoOptimizerModule(TinyModule):
    """Manual optimization, one loss, two AdamW (first layer / last layer), each with a step schedule;
    gradients accumulated over ``accumulate`` batches. ``constant_nan_at``: batches whose loss is NaN
    while every gradient stays finite (a NaN constant added to the loss); ``grad_nan_at``: batches
    whose loss is finite but whose last-layer gradient (the second optimizer's) is NaN.
    ``alternate``: backward and step the first optimizer, then backward again and step the second
    (the NaN constant, if any, only in the second loss)."""

    def __init__(self, accumulate=1, constant_nan_at=(), grad_nan_at=(), alternate=False, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.accumulate = accumulate
        self.constant_nan_at = set(constant_nan_at)
        self.second_grad_nan_at = set(grad_nan_at)
        self.alternate = alternate

    def _loss(self, batch, batch_idx, poison):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if poison and batch_idx in self.constant_nan_at:
            loss = loss + torch.tensor(float("nan"))
        if batch_idx in self.second_grad_nan_at:  # value stays finite, d/dw = 0 * inf = NaN
            loss = loss + 0.0 * torch.sqrt(self.net[3].weight.sum() * 0.0)
        return loss

    def training_step(self, batch, batch_idx):
        opts, scheds = self.optimizers(), self.lr_schedulers()
        if self.alternate:
            for i, (opt, sched) in enumerate(zip(opts, scheds)):
                opt.zero_grad()
                self.manual_backward(self._loss(batch, batch_idx, poison=i == 1))
                opt.step()
                sched.step()
            return None
        loss = self._loss(batch, batch_idx, poison=True)
        if batch_idx % self.accumulate == 0:
            for opt in opts:
                opt.zero_grad()
        self.manual_backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            for opt, sched in zip(opts, scheds):
                opt.step()
                sched.step()
        return loss

    def configure_optimizers(self):
        out = []
        for layer in (self.net[0], self.net[3]):
            opt = torch.optim.AdamW(layer.parameters(), lr=self.lr)
            out.append((opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))))
        return [o for o, _ in out], [s for _, s in out]


def _assert_same_run(t1, t2):
    for a, b in zip(optimizer_state(t1), optimizer_state(t2), strict=True):
        assert torch.equal(a, b)
    assert [c.scheduler.last_epoch for c in t1.lr_scheduler_configs] == [
        c.scheduler.last_epoch for c in t2.lr_scheduler_configs
    ]


@pytest.mark.parametrize("mode", ["device", "host"])
@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("fault", ["nan_loss", "nan_grad_of_second"])
def test_one_decision_covers_every_optimizer_of_the_step(tmp_path, mode, accumulate, fault):
    """A NaN loss with finite gradients, or a NaN gradient of the second optimizer only, skips both
    optimizers of the training step; both end bit-identical to a run that never saw that window."""
    batches = make_batches(8)
    bad = 5
    window = range(bad - bad % accumulate, bad - bad % accumulate + accumulate)
    poison = {"constant_nan_at": (bad,)} if fault == "nan_loss" else {"grad_nan_at": (bad,)}
    skip = NaNSkip(mode=mode)
    probe = WindowProbe(window[0], window[-1])
    m = _TwoOptimizerModule(accumulate=accumulate, batches=batches, **poison)
    t1 = _fit(tmp_path, m, [skip, probe])
    probe.assert_unchanged()
    assert skip.skipped_total == 2  # one skipped step of each optimizer
    ref = _TwoOptimizerModule(
        accumulate=accumulate, batches=[b for i, b in enumerate(batches) if i not in window]
    )
    _assert_same_run(t1, _fit(tmp_path, ref, []))


def test_flag_raised_after_the_first_optimizer_stepped_skips_the_later_one_alone(tmp_path):
    """Alternating updates: the second loss of batch 3 is NaN after the first optimizer has stepped;
    only the second optimizer's step is skipped."""
    batches = make_batches(6)
    skip = NaNSkip()
    m = _TwoOptimizerModule(alternate=True, batches=batches, constant_nan_at=(3,))
    _fit(tmp_path, m, [skip])
    assert skip.skipped_total == 1
    assert list(skip._recent) == [False] * 7 + [True] + [False] * 4
