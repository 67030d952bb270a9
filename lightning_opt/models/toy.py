"""Toy targets for SPD: toy models of superposition (TMS) and residual MLPs, with their own trainers.

TMS (Elhage et al., 2022): ``x_hat = ReLU(W^T W x + b)`` with ``W [n_hidden, n_features]``, optionally
with fixed identity hidden layers in between. ResidMLP (Braun et al., 2025): features embedded by a
fixed random unit-norm ``W_E``, MLP blocks added to the residual, read off by ``W_U = W_E^T``;
trained to compute ``relu(x) + x`` for far more features than MLP neurons.

Both are trained here in seconds on CPU, so the SPD recipe needs no downloaded checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import IterableDataset

from lightning_opt.optim.schedules import ScheduleConfig


def sparse_feature_batch(
    batch_size: int,
    n_features: int,
    feature_probability: float,
    value_range: tuple[float, float] = (0.0, 1.0),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Each feature is on with probability ``feature_probability``, with a value ~ U(value_range)."""
    lo, hi = value_range
    on = torch.rand(batch_size, n_features, generator=generator, device=device) < feature_probability
    vals = torch.rand(batch_size, n_features, generator=generator, device=device) * (hi - lo) + lo
    return vals * on


class SparseFeatureDataset(IterableDataset):
    """An endless stream of sparse-feature batches (use with ``DataLoader(ds, batch_size=None)``)."""

    def __init__(
        self,
        n_features: int,
        feature_probability: float,
        batch_size: int,
        value_range: tuple[float, float] = (0.0, 1.0),
        seed: int = 0,
    ) -> None:
        if not 0 < feature_probability <= 1:
            raise ValueError(f"feature_probability={feature_probability} must be in (0, 1]")
        if batch_size <= 0 or n_features <= 0:
            raise ValueError(f"batch_size={batch_size} and n_features={n_features} must be positive")
        self.n_features = n_features
        self.feature_probability = feature_probability
        self.batch_size = batch_size
        self.value_range = tuple(value_range)
        self.seed = seed

    def __iter__(self) -> Iterator[Tensor]:
        info = torch.utils.data.get_worker_info()
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        g = torch.Generator().manual_seed(self.seed + 1000 * rank + (info.id if info else 0))
        while True:
            yield sparse_feature_batch(self.batch_size, self.n_features, self.feature_probability, self.value_range, g)


# --------------------------------------------------------------------------------------------------
# TMS
# --------------------------------------------------------------------------------------------------


@dataclass
class TMSConfig:
    """Toy model of superposition.

    Args:
        n_features / n_hidden: 5-2 and 40-10 are the paper's settings.
        n_hidden_layers: fixed identity layers between ``linear1`` and ``linear2`` (the "+ID" models).
        tied: train with ``linear2.weight = linear1.weight^T`` (the paper's models); after training the
            two are stored as separate frozen ``nn.Linear`` weights.
        init_bias_to_zero: start ``linear2.bias`` at 0 (used for 40-10).
    """

    n_features: int = 5
    n_hidden: int = 2
    n_hidden_layers: int = 0
    tied: bool = True
    init_bias_to_zero: bool = False

    def __post_init__(self) -> None:
        if self.n_features <= 0 or self.n_hidden <= 0 or self.n_hidden_layers < 0:
            raise ValueError(f"TMSConfig sizes must be positive (got {self})")


class TMSModel(nn.Module):
    """``ReLU(linear2(hidden_layers(linear1(x))))`` with ``linear1`` bias-free."""

    def __init__(self, config: TMSConfig | None = None, **kwargs: int | bool) -> None:
        super().__init__()
        self.config = config or TMSConfig(**kwargs)
        c = self.config
        self.linear1 = nn.Linear(c.n_features, c.n_hidden, bias=False)
        self.hidden_layers = nn.ModuleList(nn.Linear(c.n_hidden, c.n_hidden, bias=False) for _ in range(c.n_hidden_layers))
        for layer in self.hidden_layers:
            with torch.no_grad():
                layer.weight.copy_(torch.eye(c.n_hidden))
            layer.weight.requires_grad_(False)
        self.linear2 = nn.Linear(c.n_hidden, c.n_features, bias=True)
        if c.init_bias_to_zero:
            nn.init.zeros_(self.linear2.bias)
        self._tied = c.tied
        if self._tied:
            self.linear2.weight.requires_grad_(False)

    def untie_(self) -> TMSModel:
        """Copy ``linear1.weight^T`` into ``linear2.weight`` and stop tying (done after training)."""
        if self._tied:
            with torch.no_grad():
                self.linear2.weight.copy_(self.linear1.weight.t())
            self._tied = False
        return self

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        for layer in self.hidden_layers:
            h = layer(h)
        if self._tied:
            return F.relu(F.linear(h, self.linear1.weight.t(), self.linear2.bias))
        return F.relu(self.linear2(h))

    def feature_directions(self) -> Tensor:
        """``W^T [n_features, n_hidden]``: the direction each feature is written to."""
        w = self.linear1.weight.detach()
        # nn.Linear stores [n_hidden, n_features]; an SPD component layer that replaced it stores [d_in, d_out]
        return w.t() if isinstance(self.linear1, nn.Linear) else w


def train_tms(
    config: TMSConfig,
    steps: int = 10_000,
    batch_size: int = 1024,
    lr: float = 5e-3,
    feature_probability: float = 0.05,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> TMSModel:
    """Train a TMS model to reconstruct its inputs (AdamW, constant lr), then untie and freeze it."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TMSModel(config).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        x = sparse_feature_batch(batch_size, config.n_features, feature_probability, (0.0, 1.0), g).to(device)
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.untie_().requires_grad_(False).eval()
    return model


# --------------------------------------------------------------------------------------------------
# Residual MLP
# --------------------------------------------------------------------------------------------------


@dataclass
class ResidMLPConfig:
    """Residual MLP toy model (defaults: the paper's 1-layer model, 100 features in 50 neurons)."""

    n_features: int = 100
    d_embed: int = 1000
    d_mlp: int = 50
    n_layers: int = 1
    act: str = "relu"
    in_bias: bool = False
    out_bias: bool = False

    def __post_init__(self) -> None:
        if min(self.n_features, self.d_embed, self.d_mlp, self.n_layers) <= 0:
            raise ValueError(f"ResidMLPConfig sizes must be positive (got {self})")
        if self.act not in ("relu", "gelu"):
            raise ValueError(f"ResidMLPConfig.act={self.act!r}; choose 'relu' or 'gelu'")


class ResidMLPBlock(nn.Module):
    def __init__(self, c: ResidMLPConfig) -> None:
        super().__init__()
        self.mlp_in = nn.Linear(c.d_embed, c.d_mlp, bias=c.in_bias)
        self.mlp_out = nn.Linear(c.d_mlp, c.d_embed, bias=c.out_bias)
        self.act = F.relu if c.act == "relu" else F.gelu

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp_out(self.act(self.mlp_in(x)))


class ResidMLP(nn.Module):
    """``W_U(resid)`` where ``resid = W_E x + sum of MLP blocks``; ``W_E`` fixed random unit rows."""

    def __init__(self, config: ResidMLPConfig | None = None, seed: int = 0, **kwargs: int | bool | str) -> None:
        super().__init__()
        self.config = config or ResidMLPConfig(**kwargs)
        c = self.config
        g = torch.Generator().manual_seed(seed)
        w_e = torch.randn(c.n_features, c.d_embed, generator=g)
        w_e = w_e / w_e.norm(dim=-1, keepdim=True)
        self.register_buffer("W_E", w_e)
        self.layers = nn.ModuleList(ResidMLPBlock(c) for _ in range(c.n_layers))
        for layer in self.layers:  # Kaiming-normal fan-in init, as for the paper's targets
            with torch.no_grad():
                layer.mlp_in.weight.normal_(0, math.sqrt(2.0 / c.d_embed))
                layer.mlp_out.weight.normal_(0, math.sqrt(1.0 / c.d_mlp))

    def forward(self, x: Tensor) -> Tensor:
        resid = x @ self.W_E
        for layer in self.layers:
            resid = resid + layer(resid)
        return resid @ self.W_E.t()


def resid_mlp_labels(x: Tensor, act: str = "relu") -> Tensor:
    """``act(x) + x``: the function the residual MLP learns (unit label coefficients)."""
    return (F.relu(x) if act == "relu" else F.gelu(x)) + x


def train_resid_mlp(
    config: ResidMLPConfig,
    steps: int = 1000,
    batch_size: int = 2048,
    lr: float = 3e-3,
    feature_probability: float = 0.01,
    weight_decay: float = 0.01,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> ResidMLP:
    """Train the MLP weights (AdamW, cosine to 0) on ``relu(x) + x`` with x ~ sparse U(-1, 1)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = ResidMLP(config, seed=seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ScheduleConfig(name="cosine", total_steps=steps, min_ratio=0.0))
    for _ in range(steps):
        x = sparse_feature_batch(batch_size, config.n_features, feature_probability, (-1.0, 1.0), g).to(device)
        loss = ((model(x) - resid_mlp_labels(x, config.act)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.requires_grad_(False).eval()
