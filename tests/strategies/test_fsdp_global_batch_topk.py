"""FSDPGlobalBatchTopKStrategy on 2 gloo ranks: FSDP2 shards the CLT, the BatchTopK stays the global one (L0 exactly
k per token), training matches DDP's GlobalBatchTopKStrategy, distributed checkpoints resume and load."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _clt_helpers import D_MODEL, N_FEATURES, N_LAYERS, K, TinyCLTModule, free_port, loader, trainer_kwargs

from tests._fork import fork_ranks

WORLD = 2


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state on every rank (a collective for FSDP2's sharded parameters)."""
    return {k: _full(v) for k, v in module.state_dict().items()}


class Probe(TinyCLTModule):
    """TinyCLTModule (Adam) that records, per step, the kept entries over all ranks and tokens, and the parameter
    types its CLT's forward sees."""

    def __init__(self) -> None:
        super().__init__(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
        self.kept: list[tuple[int, int]] = []  # (entries kept on all ranks, tokens on all ranks)
        self.forward_param_types: set[str] = set()
        self.sharded_param_types: set[str] = set()
        self.clt.register_forward_pre_hook(self._types)
        self.clt.register_forward_hook(self._count)
        self._kept_here = 0

    def _types(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_param_types |= {type(p.data).__name__ for p in module.parameters()}

    def _count(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._kept_here = out.indices.numel()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import torch.distributed as dist

        # between steps (before the forward's all-gather) every parameter is this rank's DTensor shard
        self.sharded_param_types |= {type(p).__name__ for p in self.clt.parameters()}
        loss = super().training_step(batch, batch_idx)
        counts = torch.tensor([self._kept_here, batch[0].shape[0]])
        dist.all_reduce(counts)
        self.kept.append((int(counts[0]), int(counts[1])))
        return loss


def _fit(module: Any, strategy: Any, root: Path, **kw: Any) -> Any:
    import lightning.pytorch as pl

    ckpt_path = kw.pop("ckpt_path", None)
    data = kw.pop("train_dataloaders", None)
    trainer = pl.Trainer(strategy=strategy, devices=WORLD, **trainer_kwargs(root, **kw))
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    return trainer


def _scenarios(root: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_opt.strategies import FSDPGlobalBatchTopKStrategy, GlobalBatchTopKStrategy
    from lightning_opt.strategies.fsdp_global_batch_topk import consolidate_checkpoint

    out: dict[str, Any] = {}

    ddp = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
    _fit(ddp, GlobalBatchTopKStrategy(), root)
    out["ddp"] = {"state": _full_state(ddp), "losses": ddp.losses}

    for reshard in (False, True):
        m = Probe()
        strategy = FSDPGlobalBatchTopKStrategy(reshard_after_forward=reshard)
        _fit(m, strategy, root)
        out[f"fsdp_reshard{int(reshard)}"] = {
            "state": _full_state(m), "losses": m.losses, "kept": m.kept, "topk_modules": strategy.topk_modules,
            "forward_types": m.forward_param_types, "sharded_types": m.sharded_param_types,
            "local_numel": {n: p.to_local().numel() for n, p in m.clt.named_parameters()},
            "optim_state_numel": sum(v.to_local().numel() for s in m.trainer.optimizers[0].state.values()
                                     for k, v in s.items() if k != "step"),
            "topk_after": m.clt.topk_group,
        }

    # pooled FVU through the strategies' loss_sum / data_sum (a ratio loss: the big-batch ratio on every rank)
    for name, strategy in (("fvu_ddp", GlobalBatchTopKStrategy()), ("fvu_fsdp", FSDPGlobalBatchTopKStrategy())):
        m = TinyCLTModule(loss="fvu", optimizer="adam", lr=0.01, batch_size=8)
        _fit(m, strategy, root)
        out[name] = {"state": _full_state(m)}

    # distributed checkpoint at step 2, resumed to step 3 (compared with the uninterrupted run above)
    ckpt = ModelCheckpoint(dirpath=root / "fsdp_ckpt", every_n_train_steps=2, save_top_k=-1)
    first = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
    _fit(first, FSDPGlobalBatchTopKStrategy(), root, callbacks=[ckpt], enable_checkpointing=True, max_steps=2)
    path = next((root / "fsdp_ckpt").glob("*step=2.ckpt"))  # one batch per epoch: epoch=1
    step2 = _full_state(first)
    resumed = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
    _fit(resumed, FSDPGlobalBatchTopKStrategy(), root, ckpt_path=str(path))
    out["resume"] = {"state": _full_state(resumed), "step2": step2, "is_dir": path.is_dir(),
                     "files": sorted(p.name for p in path.iterdir())}

    # the project's CLTModule with the terms that read the CLT's parameters outside its forward (sparsity penalty,
    # AuxK): trained 2 steps like under DDP; its directory checkpoint consolidated and loaded in one process
    def clt_module() -> Any:
        from lightning_opt.models.clt import CLTConfig
        from lightning_opt.modules.clt import CLTModule

        torch.manual_seed(0)
        cfg = CLTConfig(n_layers=N_LAYERS, d_model=D_MODEL, n_features=N_FEATURES, activation="batchtopk_global", k=K)
        return CLTModule(clt=cfg, eval_replacement=False, sparsity_coef=0.1, aux_coef=0.1, aux_k=2, aux_max_dead=None,
                         dead_tokens=4)

    data = loader(4, WORLD, dist.get_rank())
    reference = clt_module()
    _fit(reference, GlobalBatchTopKStrategy(), root, max_steps=2, limit_val_batches=0, train_dataloaders=data)
    module = clt_module()
    ckpt = ModelCheckpoint(dirpath=root / "clt_module", every_n_train_steps=2, save_top_k=-1)
    _fit(module, FSDPGlobalBatchTopKStrategy(), root, callbacks=[ckpt], enable_checkpointing=True, max_steps=2,
         limit_val_batches=0, train_dataloaders=data)
    trained = {k: _full(v) for k, v in module.model.named_parameters()}
    ddp_trained = {k: _full(v) for k, v in reference.model.named_parameters()}
    if dist.get_rank() == 0:
        from lightning_opt.modules.clt import CLTModule

        file = consolidate_checkpoint(next((root / "clt_module").glob("*step=2.ckpt")))
        loaded = CLTModule.load_from_checkpoint(file, map_location="cpu")
        raw = torch.load(file, weights_only=True)
        out["clt_module"] = {
            "trained": trained, "ddp": ddp_trained, "dead_after": int(module.tokens_since_fired.ge(4).sum()),
            "loaded": {k: v.detach().clone() for k, v in loaded.model.named_parameters()},
            "global_step": raw["global_step"], "optimizer_states": len(raw["optimizer_states"]),
        }
    dist.barrier()
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), NODE_RANK="0")
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        result = {"ok": True, **_scenarios(Path(out_dir))}
    except Exception:
        result = {"ok": False, "error": f"rank {rank}: {traceback.format_exc()}"}
    if rank == 0 or not result["ok"]:
        torch.save(result, Path(out_dir) / f"fsdp.rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp_runs")
    fork_ranks(_worker, (free_port(), str(out)), WORLD)
    results = [torch.load(p, weights_only=False) for p in sorted(out.glob("fsdp.rank*.pt"))]
    errors = [r["error"] for r in results if not r["ok"]]
    if errors:
        pytest.fail("\n".join(errors))
    return results[0]


@pytest.mark.parametrize("reshard", [0, 1])
def test_fsdp_trains_like_ddp_global_batchtopk(runs: dict, reshard: int) -> None:
    got, ddp = runs[f"fsdp_reshard{reshard}"], runs["ddp"]
    assert got["topk_modules"] == 1 and got["topk_after"] is None
    assert len(got["losses"]) == 3
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
    assert set(got["state"]) == set(ddp["state"])
    for name, value in ddp["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # the training moved the parameters (the comparison is not of two initial states)
    init = TinyCLTModule().state_dict()
    assert not torch.allclose(got["state"]["clt.W_enc"], init["clt.W_enc"])


@pytest.mark.parametrize("reshard", [0, 1])
def test_l0_is_exactly_k_per_token_over_the_global_batch(runs: dict, reshard: int) -> None:
    kept = runs[f"fsdp_reshard{reshard}"]["kept"]
    assert len(kept) == 3
    for entries, tokens in kept:
        assert tokens == 16 and entries == K * tokens


@pytest.mark.parametrize("reshard", [0, 1])
def test_parameters_and_optimizer_state_are_sharded_and_forward_sees_plain_tensors(runs: dict, reshard: int) -> None:
    got = runs[f"fsdp_reshard{reshard}"]
    assert got["sharded_types"] == {"DTensor"}
    assert "DTensor" not in got["forward_types"] and got["forward_types"] <= {"Tensor", "Parameter"}
    full = {n.removeprefix("clt."): v.numel() for n, v in got["state"].items() if n.startswith("clt.")}
    for name, n in got["local_numel"].items():
        assert n == full[name] // WORLD, name  # every tiny-CLT dimension sharded on divides by 2
    params = sum(got["local_numel"].values())
    assert got["optim_state_numel"] == 2 * params  # Adam's two moments of this rank's shard only


def test_fvu_through_loss_sum_matches_ddp(runs: dict) -> None:
    for name, value in runs["fvu_ddp"]["state"].items():
        torch.testing.assert_close(runs["fvu_fsdp"]["state"][name], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_distributed_checkpoint_is_a_directory_and_resumes(runs: dict) -> None:
    res = runs["resume"]
    assert res["is_dir"] and "meta.pt" in res["files"] and len(res["files"]) > 1
    uninterrupted = runs["fsdp_reshard0"]["state"]
    for name, value in uninterrupted.items():
        torch.testing.assert_close(res["state"][name], value, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.allclose(res["step2"]["clt.W_enc"], uninterrupted["clt.W_enc"])


def test_clt_module_with_sparsity_and_auxk_trains_like_ddp(runs: dict) -> None:
    # the penalty and AuxK read the gathered parameters after forward (reshard_after_forward=False)
    got = runs["clt_module"]
    assert got["dead_after"] > 0  # AuxK had dead features to work on
    for name, value in got["ddp"].items():
        torch.testing.assert_close(got["trained"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_consolidated_checkpoint_loads_into_clt_module(runs: dict) -> None:
    got = runs["clt_module"]
    assert got["global_step"] == 2 and got["optimizer_states"] == 1
    assert set(got["loaded"]) == set(got["trained"])
    for name, value in got["trained"].items():
        torch.testing.assert_close(got["loaded"][name], value, rtol=0, atol=0)
