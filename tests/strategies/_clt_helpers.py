"""A tiny CLT LightningModule and data for the strategy tests (importable by spawned workers)."""

from __future__ import annotations

import os
import socket
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_opt.models.clt import CLT, CLTConfig, clip_grad_norm_

N_LAYERS, D_MODEL, N_FEATURES, K = 3, 8, 16, 4


def make_data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_LAYERS, D_MODEL, generator=gen)
    y = torch.randn(n, N_LAYERS, D_MODEL, generator=gen) + 0.5 * x
    return x, y


def make_clt(seed: int = 0, **overrides: Any) -> CLT:
    torch.manual_seed(seed)
    cfg = dict(n_layers=N_LAYERS, d_model=D_MODEL, n_features=N_FEATURES, activation="batchtopk_global", k=K)
    cfg.update(overrides)
    return CLT(CLTConfig(**cfg))


def make_clt_module() -> pl.LightningModule:
    """The project's CLTModule with a tiny CLT (same init on every rank)."""
    from lightning_opt.modules.clt import CLTModule

    torch.manual_seed(0)
    cfg = CLTConfig(
        n_layers=N_LAYERS, d_model=D_MODEL, n_features=N_FEATURES, activation="batchtopk_global", k=K
    )
    return CLTModule(clt=cfg, eval_replacement=False)


def loader(batch_size: int, replicas: int = 1, rank: int = 0) -> DataLoader:
    """In-order batches; with replicas > 1 this rank's share, as the strategy's sampler kwargs say."""
    data = TensorDataset(*make_data())
    sampler = (
        DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=False) if replicas > 1 else None
    )
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


class TinyCLTModule(pl.LightningModule):
    """MSE (mean over the local output columns) or pooled FVU through the strategy's loss hooks."""

    def __init__(
        self, loss: str = "mse", lr: float = 0.05, optimizer: str = "sgd", batch_size: int = 8
    ) -> None:
        super().__init__()
        self.clt = make_clt()
        self.loss_kind = loss
        self.lr = lr
        self.optimizer_kind = optimizer
        self.batch_size = batch_size
        self.losses: list[float] = []
        self.val_shapes: list[tuple[int, ...]] = []
        self.overrides: set[str] = set()  # instance attributes that shadow the CLT's or the plugin's methods

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        plugin = self.trainer.strategy.precision_plugin
        self.overrides |= {k for k in vars(self.clt) if callable(getattr(type(self.clt), k, None))}
        self.overrides |= {f"precision.{k}" for k in vars(plugin) if callable(getattr(type(plugin), k, None))}
        out = self.clt(x)
        if self.clt.d_out_slice is not None:
            start, stop = self.clt.d_out_slice
            y = y[..., start:stop]
        strategy = self.trainer.strategy
        if self.loss_kind == "fvu" and hasattr(strategy, "loss_sum"):
            n = strategy.data_sum(y.new_tensor(float(x.shape[0])))
            mean = strategy.data_sum(y.sum(0)) / n
            sst = strategy.loss_sum(((y - mean) ** 2).sum().detach())
            loss = strategy.loss_sum(((y - out.recon) ** 2).sum()) / sst
        elif self.loss_kind == "fvu":
            loss = ((y - out.recon) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
        else:
            loss = F.mse_loss(out.recon, y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        # Full-width targets: under DecoderShardingStrategy evaluation runs on the gathered module.
        x, y = batch
        self.val_shapes.append(tuple(self.clt(x).recon.shape))
        self.log("val_mse", F.mse_loss(self.clt(x).recon, y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*make_data()), batch_size=self.batch_size)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        # the documented hook: a sharded CLT clips with the norm of the whole model
        if gradient_clip_val and gradient_clip_algorithm != "value" and self.clt.shard is not None:
            clip_grad_norm_(self, (p for g in optimizer.param_groups for p in g["params"]), gradient_clip_val)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_kind == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        # In order (no shuffling), so the union of the ranks' batches is the single-process batch.
        data = TensorDataset(*make_data())
        kw = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = DistributedSampler(data, shuffle=False, **kw) if kw.get("num_replicas", 1) > 1 else None
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


def trainer_kwargs(tmp_path: Any, **overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        use_distributed_sampler=False,
        default_root_dir=str(tmp_path),
    )
    kw.update(overrides)
    return kw


def fit_single(module: pl.LightningModule, root: Any, **kw: Any) -> dict[str, torch.Tensor]:
    """Fit in this process (the big-batch reference) and return the final state."""
    pl.Trainer(devices=1, **trainer_kwargs(root, **kw)).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_close(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float = 1e-5
) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
