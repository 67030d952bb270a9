"""Toy SPD targets: sparse feature data, TMS and the residual MLP train and behave as specified."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.models.toy import (
    ResidMLP,
    ResidMLPConfig,
    SparseFeatureDataset,
    TMSConfig,
    TMSModel,
    resid_mlp_labels,
    sparse_feature_batch,
    train_resid_mlp,
    train_tms,
)

torch.set_num_threads(1)


def test_sparse_feature_batch_density_and_range():
    g = torch.Generator().manual_seed(0)
    x = sparse_feature_batch(20_000, 10, 0.05, (-1.0, 1.0), g)
    on = x != 0
    assert abs(on.float().mean().item() - 0.05) < 0.005
    assert x.min() >= -1 and x.max() <= 1 and (x[on] < 0).any()
    ds = SparseFeatureDataset(4, 0.5, 8, seed=1)
    a, b = next(iter(ds)), next(iter(ds))
    assert a.shape == (8, 4) and torch.equal(a, b)  # seeded: a fresh iterator repeats the stream
    with pytest.raises(ValueError, match="feature_probability"):
        SparseFeatureDataset(4, 0.0, 8)


def test_tms_tied_forward_equals_untied_and_identity_layers_are_fixed():
    torch.manual_seed(0)
    m = TMSModel(TMSConfig(5, 2, n_hidden_layers=1))
    x = torch.rand(7, 5)
    tied = m(x)
    m.untie_()
    assert torch.allclose(m(x), tied, atol=1e-6)
    assert torch.equal(m.hidden_layers[0].weight, torch.eye(2)) and not m.hidden_layers[0].weight.requires_grad
    assert torch.equal(m.feature_directions(), m.linear1.weight.t())


def test_train_tms_learns_to_reconstruct():
    m0 = TMSModel(TMSConfig(5, 2))
    x = sparse_feature_batch(4096, 5, 0.05, generator=torch.Generator().manual_seed(5))
    before = ((m0(x) - x) ** 2).mean()
    m = train_tms(TMSConfig(5, 2), steps=300, batch_size=256, lr=1e-2)
    after = ((m(x) - x) ** 2).mean()
    assert after < 0.5 * before
    assert not any(p.requires_grad for p in m.parameters())


def test_resid_mlp_embedding_and_training():
    cfg = ResidMLPConfig(n_features=20, d_embed=64, d_mlp=10)
    m = ResidMLP(cfg)
    assert torch.allclose(m.W_E.norm(dim=-1), torch.ones(20), atol=1e-5)
    x = torch.tensor([[-0.5, 0.5]])
    assert torch.allclose(resid_mlp_labels(x), torch.tensor([[-0.5, 1.0]]))
    g = torch.Generator().manual_seed(3)
    xb = sparse_feature_batch(2048, 20, 0.05, (-1.0, 1.0), g)
    before = ((m(xb) - resid_mlp_labels(xb)) ** 2).mean()
    trained = train_resid_mlp(cfg, steps=200, batch_size=512, feature_probability=0.05)
    after = ((trained(xb) - resid_mlp_labels(xb)) ** 2).mean()
    assert after < 0.7 * before
    with pytest.raises(ValueError, match="act"):
        ResidMLPConfig(act="tanh")


def test_feature_directions_survive_spd_module_replacement():
    from lightning_opt.models.spd import SPDConfig, SPDModel

    torch.manual_seed(0)
    tms = TMSModel(TMSConfig(n_features=5, n_hidden=2))
    before = tms.feature_directions().clone()
    assert before.shape == (5, 2)
    SPDModel(tms, SPDConfig(components=[{"pattern": "linear1", "C": 4}]))
    torch.testing.assert_close(tms.feature_directions(), before)
