from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from lightning_opt.optim.muon import Muon, newton_schulz
from lightning_opt.optim.schedules import ScheduleConfig
from tests._train import loss_drop


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


def _reference_muon_step(params, grads, bufs, lr, momentum, splits):
    """Muon written per matrix, the plain way: the batched, split implementation must match it."""
    out = []
    for p, g, buf, sp in zip(params, grads, bufs, splits):
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum).reshape(g.shape[0], -1)
        parts = u.split(list(sp)) if sp else [u]
        ortho = [newton_schulz(b) * max(1.0, b.shape[0] / b.shape[1]) ** 0.5 for b in parts]
        out.append(p - lr * torch.cat(ortho).view(p.shape))
    return out


@pytest.mark.parametrize("batched", [True, False])
def test_muon_batched_split_matches_per_matrix_reference(batched):
    torch.manual_seed(0)
    shapes = [(12, 4), (4, 12), (12, 4), (4, 4), (6, 4)]
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    params[4].muon_row_splits = (2, 2, 2)  # a fused q/k/v of three 2x4 blocks
    splits = [None, None, None, None, (2, 2, 2)]
    ref_params = [p.detach().clone() for p in params]
    ref_bufs = [torch.zeros_like(p) for p in params]
    opt = Muon(params, lr=0.1, momentum=0.9, batched=batched)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref_params = _reference_muon_step(ref_params, grads, ref_bufs, 0.1, 0.9, splits)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r, atol=1e-5, rtol=1e-5)


def test_muon_split_changes_the_update_of_a_fused_matrix():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
    b.data.copy_(a.data)
    a.muon_row_splits = b.muon_row_splits = (2, 2, 2)
    g = torch.randn(6, 4)
    a.grad, b.grad = g.clone(), g.clone()
    Muon([a], lr=0.1, split_fused=True).step()
    Muon([b], lr=0.1, split_fused=False).step()
    assert not torch.allclose(a, b)
    bad = nn.Parameter(torch.randn(6, 4))
    bad.muon_row_splits = (2, 2)
    bad.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match="muon_row_splits"):
        Muon([bad]).step()


def test_muon_momentum_warmup_and_its_checkpoint():
    from lightning_opt.optim.muon import momentum_at

    assert momentum_at(0, 0.95, 0.85, 300) == pytest.approx(0.85)
    assert momentum_at(150, 0.95, 0.85, 300) == pytest.approx(0.90)
    assert momentum_at(1000, 0.95, 0.85, 300) == pytest.approx(0.95)
    assert momentum_at(5, 0.95, None, 300) == 0.95
    # the first step uses 0.85: buf = 0.15 g, update direction from g + 0.85 * (0.15 g - g) ...
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    opt = Muon([w], lr=0.1, momentum=0.95, momentum_start=0.85, momentum_warmup_steps=2)
    for _ in range(3):
        w.grad = torch.randn(4, 4)
        opt.step()
    assert opt.param_groups[0]["steps_done"] == 3
    opt2 = Muon([nn.Parameter(w.detach().clone())], lr=0.1, momentum=0.95, momentum_start=0.85,
                momentum_warmup_steps=2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["steps_done"] == 3
    with pytest.raises(ValueError, match="momentum_start"):
        Muon([nn.Parameter(torch.randn(2, 2))], momentum_start=1.5)


def test_muon_first_step_uses_the_warmup_start_momentum():
    torch.manual_seed(0)
    g = torch.randn(4, 4)
    w1, w2 = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4, 4))
    w1.grad, w2.grad = g.clone(), g.clone()
    Muon([w1], lr=0.1, momentum=0.95, momentum_start=0.5, momentum_warmup_steps=10).step()
    Muon([w2], lr=0.1, momentum=0.5).step()
    torch.testing.assert_close(w1.detach(), w2.detach())


def test_muon_refuses_a_state_without_its_group_options():
    """A state dict that lacks Muon's group options gets one error naming them, not a half-configured optimizer."""
    w = nn.Parameter(torch.randn(4, 4))
    other = Muon([w], lr=0.1)
    w.grad = torch.randn(4, 4)
    other.step()
    sd = other.state_dict()
    for g in sd["param_groups"]:
        for k in ("momentum_start", "steps_done"):
            g.pop(k)
    with pytest.raises(ValueError, match=r"lacks \['momentum_start', 'steps_done'\].*load the weights only"):
        Muon([w], lr=0.1).load_state_dict(sd)
    Muon([w], lr=0.1).load_state_dict(other.state_dict())  # its own state loads


def _spectrum_matrix(cond: float, m: int = 128, n: int = 384, seed: int = 0):
    """A wide matrix with singular values spread log-uniformly over [1 / cond, 1], and its polar factor."""
    import math

    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    sv = torch.logspace(0, -math.log10(cond), m)
    return u @ torch.diag(sv) @ v.T, u @ v.T


@pytest.mark.parametrize("cond", [10.0, 100.0, 1000.0])
def test_polar_express_coefficients_orthogonalise_closer_than_the_fixed_quintic(cond):
    g, polar = _spectrum_matrix(cond)
    dist = {c: float((newton_schulz(g, 5, coefficients=c) - polar).norm() / polar.norm())
            for c in ("jordan", "polar_express")}
    assert dist["polar_express"] < 0.8 * dist["jordan"], dist
    # and the same from a tall matrix (orthogonalised transposed)
    tall = {c: float((newton_schulz(g.T, 5, coefficients=c) - polar.T).norm() / polar.norm())
            for c in ("jordan", "polar_express")}
    assert tall["polar_express"] == pytest.approx(dist["polar_express"], rel=1e-3)


def test_polar_express_singular_values_end_near_one():
    from lightning_opt.optim.muon import polar_express_coefficients

    coeffs = polar_express_coefficients(5)
    assert len(coeffs) == 5 and coeffs[0][0] > coeffs[-1][0] > 1  # steep first, gentle last
    g, _ = _spectrum_matrix(100.0)
    sv = torch.linalg.svdvals(newton_schulz(g, 5, coefficients="polar_express"))
    assert 0.7 < float(sv.min()) and float(sv.max()) < 1.25
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(g, 5, coefficients="other")


def test_muon_with_polar_express_trains_and_is_configurable():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="muon_ns_coefficients"):
        OptimConfig(name="muon", muon_ns_coefficients="fast")
    with pytest.raises(ValueError, match="ns_coefficients"):
        Muon([nn.Parameter(torch.randn(4, 4))], ns_coefficients="fast")
    w = nn.Parameter(torch.randn(16, 32) * 0.1)
    target = torch.randn(16, 32)
    opt = Muon([w], lr=0.2, ns_coefficients="polar_express")
    first = None
    for _ in range(30):
        loss = (w - target).pow(2).mean()
        first = float(loss) if first is None else first
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(loss) < 0.5 * first
    assert opt.param_groups[0]["ns_coefficients"] == "polar_express"


def test_normuon_evens_out_neurons_and_keeps_the_update_norm():
    """First step: the bias-corrected second moment is the update's own, so every neuron (row of a tall or
    square matrix) ends with the same RMS, and the update keeps Muon's Frobenius norm."""
    torch.manual_seed(0)
    g = torch.randn(48, 32) * torch.linspace(0.1, 3.0, 48)[:, None]  # rows of very different size
    w_plain, w_norm = nn.Parameter(torch.zeros(48, 32)), nn.Parameter(torch.zeros(48, 32))
    plain, normed = Muon([w_plain], lr=1.0), Muon([w_norm], lr=1.0, normuon_beta2=0.95)
    for w, opt in ((w_plain, plain), (w_norm, normed)):
        w.grad = g.clone()
        opt.step()
    up_plain, up_norm = -w_plain.detach(), -w_norm.detach()
    row_rms = up_norm.pow(2).mean(1).sqrt()
    assert float(row_rms.std() / row_rms.mean()) < 1e-3 < float((up_plain.pow(2).mean(1).sqrt()).std())
    torch.testing.assert_close(up_norm.norm(), up_plain.norm(), rtol=1e-4, atol=0)
    assert normed.state[w_norm]["normuon_v"].shape == (48, 1)
    with pytest.raises(ValueError, match="normuon_beta2"):
        Muon([nn.Parameter(torch.randn(4, 4))], normuon_beta2=1.0)


def test_normuon_through_the_factory_trains_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, norm="rmsnorm", bias=False,
                          tie_embeddings=False))
    opt = CombinedOptimizer(build_optimizer(
        model, OptimConfig(name="muon", lr=3e-3, muon_lr=0.02, muon_normuon_beta2=0.95,
                           muon_ns_coefficients="polar_express"), hidden=model.hidden_matrices()))
    x = torch.randint(0, 64, (4, 16))
    first, last = loss_drop(model, opt, x, 30)
    assert last < first - 1.0


def test_muon_orthogonality_benchmark_writes_its_figures(tmp_path):
    from benchmarks.muon_orthogonality import main

    out = main(["--rows", "64", "--cols", "192", "--out", str(tmp_path / "m.json")])
    assert [r["cond"] for r in out["rows"]] == [10.0, 100.0, 1000.0]
    assert all(r["polar_express_over_jordan"] < 1 for r in out["rows"])
    assert (tmp_path / "m.json").exists()
