"""SPD model pieces: sigmoids, masks, component layers, patterns, losses and metrics (plain torch)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_opt.models import spd as S
from lightning_opt.models.toy import TMSConfig, TMSModel

torch.set_num_threads(1)


def _cfg(**kw) -> S.SPDConfig:
    kw.setdefault("components", [{"pattern": "linear1", "C": 7}, {"pattern": "linear2", "C": 7}])
    return S.SPDConfig(**kw)


def _tms(**kw) -> TMSModel:
    torch.manual_seed(0)
    return TMSModel(TMSConfig(n_features=5, n_hidden=2, **kw)).untie_()


# -- sigmoids -----------------------------------------------------------------------------------------


def test_lower_leaky_hard_sigmoid_values_and_gradients():
    x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    y = S.lower_leaky_hard_sigmoid(x, 0.1)
    assert torch.equal(y.detach(), torch.tensor([0.0, 0.5, 1.0]))
    # upstream gradient -1 (the loss wants x larger): below 0 it leaks with slope alpha
    (g,) = torch.autograd.grad(y, x, torch.tensor([-1.0, -1.0, -1.0]))
    assert torch.allclose(g, torch.tensor([-0.1, -1.0, 0.0]))
    # upstream +1 (the loss wants x smaller): nothing flows below 0 or above 1
    (g,) = torch.autograd.grad(S.lower_leaky_hard_sigmoid(x, 0.1), x, torch.ones(3))
    assert torch.allclose(g, torch.tensor([0.0, 1.0, 0.0]))


def test_upper_leaky_hard_sigmoid_values_and_gradients():
    x = torch.tensor([-1.0, 0.5, 3.0], requires_grad=True)
    y = S.upper_leaky_hard_sigmoid(x, 0.1)
    assert torch.allclose(y, torch.tensor([0.0, 0.5, 1.2]))
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(g, torch.tensor([0.0, 1.0, 0.1]))


@pytest.mark.parametrize("sampling", ["continuous", "binomial"])
def test_stochastic_mask_lies_between_ci_and_one(sampling):
    torch.manual_seed(0)
    ci = torch.rand(512, 16)
    ci[:, 0] = 1.0
    m = S.stochastic_mask(ci, sampling)
    assert (m >= ci - 1e-6).all() and (m <= 1 + 1e-6).all()
    assert torch.allclose(m[:, 0], torch.ones(512))
    if sampling == "binomial":
        assert ((m - ci).abs() < 1e-6).logical_or((m - 1).abs() < 1e-6).all()
    else:
        assert (m - ci).std() > 0.05  # really random


# -- component layers and patterns ----------------------------------------------------------------------


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)
        transformers = pytest.importorskip("transformers")
        self.conv = transformers.pytorch_utils.Conv1D(4, 5)  # HF layout: weight [5, 4]
        nn.init.normal_(self.conv.bias)

    def forward(self, idx):
        return self.conv(torch.tanh(self.proj(self.emb(idx))))


def test_replacement_keeps_outputs_and_ones_masks_with_delta_reconstruct_exactly():
    torch.manual_seed(0)
    model = _Mixed()
    idx = torch.randint(0, 11, (3, 4))
    ref = model(idx)
    spd = S.SPDModel(model, S.SPDConfig(components=[{"pattern": "emb", "C": 3}, {"pattern": "proj", "C": 4}, {"pattern": "conv", "C": 2}]))
    assert {type(layer).__name__ for layer in spd.layers.values()} == {"ComponentLayer"}
    assert torch.allclose(spd(idx), ref, atol=1e-6)  # target path: unchanged
    out, inputs = spd.target_forward(idx)
    assert torch.allclose(out, ref, atol=1e-6) and set(inputs) == {"emb", "proj", "conv"}
    spd.refresh_delta_weights()
    ones = {n: torch.ones(*inputs[n].shape[:2], spd.module_to_c[n]) for n in spd.layer_names}
    dm = {n: torch.ones(3, 4) for n in spd.layer_names}
    # V U + 1 * (W - V U) = W: components plus the delta component give back the target
    assert torch.allclose(spd.masked_forward(idx, masks=ones, delta_masks=dm), ref, atol=1e-5)
    # without the delta, a random low-rank V U does not
    assert not torch.allclose(spd.masked_forward(idx, masks=ones), ref, atol=1e-3)


def test_component_layer_uses_its_weights_in_d_in_d_out_layout():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    layer = S.ComponentLayer("l", lin, 4, S.SPDRunState())
    assert layer.weight.shape == (3, 2) and torch.equal(layer.weight, lin.weight.t())
    x = torch.randn(5, 3)
    full = layer.masked_forward(x, torch.ones(5, 4), None, None)
    assert torch.allclose(full, x @ layer.V @ layer.U + lin.bias, atol=1e-6)
    only0 = layer.masked_forward(x, torch.tensor([1.0, 0, 0, 0]).expand(5, 4), None, None)
    assert torch.allclose(only0, torch.outer(x @ layer.V[:, 0], layer.U[0]) + lin.bias, atol=1e-6)


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match="matches no module"):
        S.SPDModel(_tms(), _cfg(components=[{"pattern": "linear9", "C": 3}]))


def test_module_matched_twice_is_an_error():
    with pytest.raises(ValueError, match="matched by both"):
        S.SPDModel(_tms(), _cfg(components=[{"pattern": "linear*", "C": 3}, {"pattern": "linear1", "C": 3}]))


def test_unsupported_module_and_bad_config_are_errors():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(TypeError, match="nn.Linear, nn.Embedding"):
        S.SPDModel(model, _cfg(components=[{"pattern": "1", "C": 2}]))
    with pytest.raises(ValueError, match="ci_fn"):
        _cfg(ci_fn="transformer")
    with pytest.raises(ValueError, match="C=0"):
        _cfg(components=[{"pattern": "a", "C": 0}])
    with pytest.raises(ValueError, match="only ci_fn='mlp'"):
        S.SPDModel(nn.Sequential(nn.Embedding(4, 2)), _cfg(components=[{"pattern": "0", "C": 2}], ci_fn="shared_mlp"))


@pytest.mark.parametrize("ci_fn", ["mlp", "vector_mlp", "shared_mlp"])
def test_ci_functions_shapes_and_ranges(ci_fn):
    spd = S.SPDModel(_tms(), _cfg(ci_fn=ci_fn, ci_hidden=[8, 4]))
    _, inputs = spd.target_forward(torch.rand(9, 5))
    ci = spd.causal_importances(inputs)
    for n in spd.layer_names:
        assert ci.lower[n].shape == (9, 7) and ci.upper[n].shape == (9, 7)
        assert ci.lower[n].min() >= 0 and ci.lower[n].max() <= 1
        assert ci.upper[n].min() >= 0
    loss = sum(g.sum() for g in ci.upper.values())
    loss.backward()
    assert all(p.grad is not None for p in spd.ci_parameters())


def test_subset_routes_pick_between_one_and_all_layers():
    torch.manual_seed(0)
    r = S.uniform_k_subset_routes(["a", "b", "c"], (1000,), torch.device("cpu"))
    k = sum(v.long() for v in r.values())
    assert k.min() == 1 and k.max() == 3
    assert set(k.unique().tolist()) == {1, 2, 3}


# -- losses ---------------------------------------------------------------------------------------------


def test_faithfulness_loss_hand_value():
    deltas = {"a": torch.full((2, 3), 2.0), "b": torch.zeros(4, 1)}
    assert math.isclose(float(S.faithfulness_loss(deltas)), 4.0 * 6 / 10, rel_tol=1e-6)


def test_importance_minimality_hand_values_and_log_term():
    ci = {"l": torch.tensor([[0.5, 0.0], [1.0, 0.0]])}
    assert math.isclose(float(S.importance_minimality_loss(ci, 1.0, eps=0.0)), 0.75)
    assert math.isclose(float(S.importance_minimality_loss(ci, 2.0, eps=0.0)), (0.25 + 1.0) / 2)
    with_log = float(S.importance_minimality_loss(ci, 1.0, beta=0.5, eps=0.0))
    assert math.isclose(with_log, 0.75 + 0.5 * 0.75 * math.log2(1 + 1.5), rel_tol=1e-6)
    # two layers add up
    two = {"l": ci["l"], "m": ci["l"]}
    assert math.isclose(float(S.importance_minimality_loss(two, 1.0, eps=0.0)), 1.5)


def test_p_annealing_is_linear_between_start_and_end():
    assert S.annealed_p(2.0, 0.3) == 2.0  # no final p: no annealing
    assert S.annealed_p(2.0, 0.1, start_frac=0.2, final_p=1.0, end_frac=0.6) == 2.0
    assert math.isclose(S.annealed_p(2.0, 0.4, start_frac=0.2, final_p=1.0, end_frac=0.6), 1.5)
    assert S.annealed_p(2.0, 0.9, start_frac=0.2, final_p=1.0, end_frac=0.6) == 1.0
    t = S.annealed_p(2.0, torch.tensor(0.4), start_frac=0.2, final_p=1.0, end_frac=0.6)
    assert torch.is_tensor(t) and math.isclose(float(t), 1.5, rel_tol=1e-6)


def test_recon_losses_hand_values():
    pred, tgt = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 4.0]])
    assert math.isclose(float(S.recon_loss(pred, tgt, "mse")), (1 + 4) / 2)
    logits = torch.randn(3, 4, 10)
    assert float(S.recon_loss(logits, logits, "kl")) < 1e-6
    p = torch.tensor([[0.0, math.log(3.0)]])  # target probs [1/4, 3/4]
    q = torch.tensor([[0.0, 0.0]])  # pred probs [1/2, 1/2]
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert math.isclose(float(S.recon_loss(q, p, "kl")), want, rel_tol=1e-5)


# -- metrics ------------------------------------------------------------------------------------------


def test_mmcs_ml2r_perfect_and_scaled_decomposition():
    torch.manual_seed(0)
    rows = torch.randn(5, 2)  # W^T of a TMS 5-2
    V = torch.zeros(5, 8)
    U = torch.randn(8, 2)
    for j in range(5):  # component j writes exactly row j
        V[j, j] = 1.0
        U[j] = rows[j]
    mmcs, ml2r = S.mmcs_ml2r(rows, V, U)
    assert math.isclose(float(mmcs), 1.0, rel_tol=1e-6) and math.isclose(float(ml2r), 1.0, rel_tol=1e-6)
    mmcs, ml2r = S.mmcs_ml2r(rows, V * 0.5, U)
    assert math.isclose(float(mmcs), 1.0, rel_tol=1e-6) and math.isclose(float(ml2r), 0.5, rel_tol=1e-6)


def test_identity_ci_error_counts_deviations_after_permutation():
    ci = torch.eye(4)[:, [2, 0, 3, 1]]
    ci = torch.cat([ci, torch.zeros(4, 3)], 1)
    assert S.identity_ci_error(ci) == 0
    ci[0, 5] = 0.5  # one feature also uses a second component
    assert S.identity_ci_error(ci) == 1
    ci[1] = 0.0  # one feature uses none
    assert S.identity_ci_error(ci) == 2
    parts = S.identity_ci_breakdown(ci)
    assert parts == {"off_diagonal": 1, "diagonal_misses": 1, "off_diagonal_max": 0.5, "off_diagonal_mean_active": 0.5}
    ci[2, 6] = 0.3
    ci[3, 4] = 0.05  # below the tolerance: neither counted nor averaged
    parts = S.identity_ci_breakdown(ci)
    assert parts["off_diagonal"] == 2 and S.identity_ci_error(ci) == 3
    assert parts["off_diagonal_mean_active"] == pytest.approx(0.4)


def test_ci_l0():
    ci = torch.tensor([[0.9, 0.05, 0.2], [0.0, 0.0, 0.0]])
    assert math.isclose(float(S.ci_l0(ci, 0.1)), 1.0)


# -- the pieces regional compilation compiles ----------------------------------------------------------------


def test_kl_sum_value_and_gradient_equal_the_log_softmax_kl():
    """KL(target || pred) from the target's logsumexp, with its gradient softmax(pred) - softmax(target), against
    the textbook log-softmax form in float64; zero for identical logits; a bf16 prediction gets a bf16 gradient."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    t = 5 * torch.randn(3, 4, 50, generator=g)
    s = (t + 0.5 * torch.randn(3, 4, 50, generator=g)).requires_grad_(True)
    tgt = S.recon_target(t, "kl")
    value = S.kl_sum(s, t, tgt.lse)
    value.backward()
    s64 = s.detach().double().requires_grad_(True)
    log_p = F.log_softmax(t.double(), -1)
    ref = (log_p.exp() * (log_p - F.log_softmax(s64, -1))).sum()
    ref.backward()
    assert float(value) == pytest.approx(float(ref), rel=1e-5)
    # float32 softmax from the saved logsumexp: within 1e-4 of the largest gradient entry
    assert float((s.grad.double() - s64.grad).abs().max()) <= 1e-4 * float(s64.grad.abs().max())
    assert float(S.kl_sum(t, t, tgt.lse)) == 0.0
    sb = s.detach().bfloat16().requires_grad_(True)
    S.kl_sum(sb, t, tgt.lse).backward()
    assert sb.grad.dtype == torch.bfloat16
    # recon_loss takes the prepared target or the tensor with its kind, with the same value
    assert float(S.recon_loss(s, tgt)) == float(S.recon_loss(s, t, "kl")) == pytest.approx(float(ref) / 12, rel=1e-5)
    with pytest.raises(ValueError, match="kind"):
        S.recon_loss(s, t)


def test_masked_linear_is_the_component_path_with_delta_and_bias():
    g = torch.Generator().manual_seed(0)
    x, V, U = torch.randn(2, 3, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(4, 6, generator=g)
    mask, dm = torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, generator=g)
    dw, b = torch.randn(5, 6, generator=g), torch.randn(6, generator=g)
    want = ((x @ V) * mask) @ U + dm[..., None] * (x @ dw) + b
    assert torch.allclose(S.masked_linear(x, V, U, mask, dm, dw, b), want, atol=1e-6)
    assert torch.allclose(S.masked_linear(x, V, U, None, None, None, None), x @ V @ U, atol=1e-6)


def test_weight_deltas_stay_float32_under_bf16_autocast():
    spd = S.SPDModel(_tms(), _cfg())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        deltas = spd.weight_deltas()
    for n, d in deltas.items():
        layer = spd.layers[n]
        assert d.dtype == torch.float32
        assert torch.allclose(d, layer.weight - layer.V @ layer.U, atol=1e-7)


def test_compile_region_keeps_compiling_past_dynamo_s_default_recompile_limit():
    """Ten shapes of one region compile ten graphs (dynamo's default limit of 8 would fall back to eager)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = S.compile_region(lambda a: a * 2 + 1, backend="eager", fullgraph=True)
    for n in range(1, 11):
        assert torch.equal(fn(torch.ones(n)), torch.full((n,), 3.0))
    assert counters["stats"]["unique_graphs"] == 10
    torch._dynamo.reset()
