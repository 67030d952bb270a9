from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from lightning_opt.optim.lion import Lion
from lightning_opt.optim.schedules import ScheduleConfig, cosine_interp
from tests._train import loss_drop


def _reference_lion(params, grads_per_step, lr, betas, wd):
    """The Lion paper's Algorithm 2, one parameter at a time."""
    params = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    beta1, beta2 = betas
    for grads in grads_per_step:
        for p, g, m in zip(params, grads, ms):
            c = m * beta1 + g * (1 - beta1)
            p.mul_(1 - lr * wd)
            p.sub_(torch.sign(c) * lr)
            m.mul_(beta2).add_(g * (1 - beta2))
    return params


@pytest.mark.parametrize("wd", [0.0, 0.5])
def test_lion_matches_the_reference_exactly_in_float64(wd):
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 3, 4)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads_per_step = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(6)]
    params = [nn.Parameter(p.clone()) for p in init]
    opt = Lion(params, lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    expected = _reference_lion(init, grads_per_step, 0.01, (0.9, 0.99), wd)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=0)
    assert all(not torch.equal(p.detach(), i) for p, i in zip(params, init))


def test_lion_tensor_lr_matches_float_lr():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    b.data.copy_(a.data)
    opt_a = Lion([a], lr=0.01, weight_decay=0.1)
    opt_b = Lion([b], lr=torch.tensor(0.01), weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(4, 4)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(b.detach(), a.detach())


def test_lion_through_the_factory_decays_only_matrices_and_trains_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16))
    (opt,) = build_optimizer(model, OptimConfig(name="lion", lr=3e-3, betas=(0.9, 0.99), weight_decay=0.5))
    assert isinstance(opt, Lion)
    for g in opt.param_groups:
        assert all(p.ndim >= 2 for p in g["params"]) == (g["weight_decay"] > 0)
    x = torch.randint(0, 64, (4, 16))
    first, last = loss_drop(model, opt, x, 30)
    assert last < first - 1.0
    assert set(opt.state[model.wte.weight]) == {"exp_avg"}  # one state tensor per parameter
    sd = opt.state_dict()
    (opt2,) = build_optimizer(model, OptimConfig(name="lion", lr=3e-3))
    opt2.load_state_dict(sd)
    torch.testing.assert_close(opt2.state[model.wte.weight]["exp_avg"], opt.state[model.wte.weight]["exp_avg"])


def test_lion_rejects_bad_settings():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        Lion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        Lion(p, lr=0.0)


def test_cosine_interp_end_points():
    assert cosine_interp(1.0, 0.1, 0.0) == 1.0
    assert cosine_interp(1.0, 0.1, 0.5) == pytest.approx(0.55)
    assert cosine_interp(1.0, 0.1, 1.0) == pytest.approx(0.1)
    assert cosine_interp(1.0, 0.1, 3.0) == pytest.approx(0.1)


def test_every_schedule_at_known_points():
    cos = ScheduleConfig(name="cosine", warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert [cos(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55)
    assert cos(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    wsd = ScheduleConfig(name="wsd", warmup_steps=5, total_steps=100, decay_fraction=0.4, min_ratio=0.0)
    assert wsd(0) == pytest.approx(0.2) and wsd(5) == 1.0 and wsd(59) == 1.0
    assert wsd(80) == pytest.approx(0.5) and wsd(100) == 0.0
    const = ScheduleConfig(name="constant", warmup_steps=4, total_steps=100)
    assert [const(s) for s in (0, 3, 4, 99, 1000)] == pytest.approx([0.25, 1.0, 1.0, 1.0, 1.0])
    one = ScheduleConfig(name="one_cycle", warmup_steps=11, total_steps=111, start_ratio=0.04, min_ratio=0.01)
    assert one(0) == pytest.approx(0.04) and one(5) == pytest.approx(0.52) and one(10) == pytest.approx(1.0)
    assert one(60) == pytest.approx(0.505) and one(110) == pytest.approx(0.01) and one(200) == pytest.approx(0.01)
    lin = ScheduleConfig(name="one_cycle", warmup_steps=11, total_steps=111, start_ratio=0.0, min_ratio=0.0,
                         anneal="linear")
    assert lin(0) == 0.0 and lin(5) == pytest.approx(0.5) and lin(10) == 1.0 and lin(35) == pytest.approx(0.75)


@pytest.mark.parametrize("anneal", ["cos", "linear"])
@pytest.mark.parametrize("warmup, total", [(30, 100), (25, 250), (2, 40)])
def test_one_cycle_matches_torch_one_cycle_lr(anneal, warmup, total):
    peak, div, final_div = 0.1, 25.0, 1e2
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=peak)
    ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=total, pct_start=warmup / total,
                                              anneal_strategy=anneal, div_factor=div, final_div_factor=final_div,
                                              cycle_momentum=False)
    cfg = ScheduleConfig(name="one_cycle", warmup_steps=warmup, total_steps=total, start_ratio=1 / div,
                         min_ratio=1 / (div * final_div), anneal=anneal)
    for step in range(total):
        assert peak * cfg(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        opt.step()
        ref.step()


def test_stretched_keeps_every_other_setting():
    cfg = ScheduleConfig(name="one_cycle", warmup_steps=50, total_steps=100, start_ratio=0.1, anneal="linear")
    short = cfg.stretched(20)
    assert (short.total_steps, short.warmup_steps, short.start_ratio, short.anneal) == (20, 20, 0.1, "linear")
    assert cfg.stretched(100) is cfg


def test_schedule_config_rejects_unknown_anneal_and_ratios():
    with pytest.raises(ValueError, match="anneal"):
        ScheduleConfig(name="one_cycle", anneal="exp")
    with pytest.raises(ValueError, match="start_ratio"):
        ScheduleConfig(name="one_cycle", start_ratio=2.0)


def test_schedule_lr_refuses_a_state_it_did_not_write():
    """A plain LambdaLR's state has no planned total: one error that says to load the weights only."""
    from lightning_opt.optim.schedules import ScheduleLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    plain = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    sched = ScheduleLR(opt, ScheduleConfig(name="constant", total_steps=10))
    with pytest.raises(ValueError, match="no total_steps: it was not written by ScheduleLR"):
        sched.load_state_dict(plain.state_dict())
    sched.load_state_dict(ScheduleLR(opt, ScheduleConfig(name="constant", total_steps=10)).state_dict())
