from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from lightning_opt.optim.muon import Muon, newton_schulz
from lightning_opt.optim.schedules import ScheduleConfig


def test_newton_schulz_orthogonalises():
    g = torch.randn(64, 32)
    x = newton_schulz(g, steps=5).float()
    sv = torch.linalg.svdvals(x)
    # the quintic iteration pushes singular values into roughly [0.7, 1.2], not exactly 1
    assert sv.min() > 0.5 and sv.max() < 1.3


def test_muon_reduces_loss():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 16) * 0.1)
    target = torch.randn(16, 16)
    opt = Muon([w], lr=0.1)
    losses = []
    for _ in range(100):
        loss = (w - target).square().mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.2 * losses[0]


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="matrices only"):
        Muon([nn.Parameter(torch.zeros(4))])


def test_speedrun_split_covers_every_parameter_once():
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16, tie_embeddings=False,
                          n_value_embeds=1, unet_skips=True, qk_norm=True, norm="rmsnorm", bias=False))
    opts = build_optimizer(model, OptimConfig(name="muon"), hidden=model.hidden_matrices(),
                           head=[model.lm_head.weight])
    assert isinstance(opts[0], Muon) and isinstance(opts[1], torch.optim.AdamW)
    seen = [id(p) for o in opts for g in o.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    muon_ids = {id(p) for g in opts[0].param_groups for p in g["params"]}
    assert id(model.wte.weight) not in muon_ids and id(model.lm_head.weight) not in muon_ids


def test_adamw_groups_no_decay_on_vectors():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    (opt,) = build_optimizer(model, OptimConfig(name="adamw", weight_decay=0.1))
    for g in opt.param_groups:
        assert all(p.ndim >= 2 for p in g["params"]) == (g["weight_decay"] > 0)


def test_adamw8bit_falls_back_with_warning_on_cpu():
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="torch AdamW"):
        (opt,) = build_optimizer(model, OptimConfig(name="adamw8bit"))
    assert isinstance(opt, torch.optim.AdamW)


def test_combined_optimizer_roundtrip():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16))
    opt = CombinedOptimizer(build_optimizer(model, OptimConfig(name="muon"), hidden=model.hidden_matrices()))
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    opt.step()
    sd = opt.state_dict()
    opt2 = CombinedOptimizer(build_optimizer(model, OptimConfig(name="muon"), hidden=model.hidden_matrices()))
    opt2.load_state_dict(sd)
    for a, b in zip(opt.optimizers, opt2.optimizers):
        for p in a.state:
            for k, v in a.state[p].items():
                torch.testing.assert_close(b.state[p][k], v)
    with pytest.raises(ValueError, match="another optimizer"):
        CombinedOptimizer([torch.optim.SGD(model.parameters(), lr=0.1)]).load_state_dict(sd)


def test_schedules():
    cos = ScheduleConfig(name="cosine", warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    wsd = ScheduleConfig(name="wsd", warmup_steps=0, total_steps=100, decay_fraction=0.4, min_ratio=0.0)
    assert wsd(0) == 1.0 and wsd(59) == 1.0 and wsd(80) == pytest.approx(0.5) and wsd(100) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(name="sgd"), "unknown"), (dict(lr=-1.0), "positive"), (dict(betas=(0.9, 1.5)), "betas")],
)
def test_optim_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_schedule_config_errors():
    with pytest.raises(ValueError, match="unknown"):
        ScheduleConfig(name="linear")
    with pytest.raises(ValueError, match="warmup_steps"):
        ScheduleConfig(warmup_steps=20, total_steps=10)
