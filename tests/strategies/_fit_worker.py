"""Scenarios run on 2 gloo ranks in one spawn (process start-up dominates a CPU test's time).

Each rank sets the variables a launcher like torchrun sets, so ``Trainer(devices=2)`` joins the 2 processes
instead of starting new ones. Results and errors go to ``out_dir/<scenario>.pt`` (rank 0) for the tests.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

WORLD = 2
CLIP = 0.02  # small enough that norm clipping acts on every step


def _fit(module: Any, strategy: Any, root: Path, **kw: Any) -> Any:
    import lightning.pytorch as pl
    from _clt_helpers import trainer_kwargs

    ckpt_path = kw.pop("ckpt_path", None)
    trainer = pl.Trainer(strategy=strategy, devices=WORLD, **trainer_kwargs(root, **kw))
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _state(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _model_shard_checks(rank: int) -> dict[str, Any]:
    """A CLT sharded by its spec on this rank (no Trainer) against the whole CLT in this process."""
    import torch.distributed as dist
    from _clt_helpers import D_MODEL, N_FEATURES, make_clt, make_data

    from lightning_opt.models.clt import CLT, CLTShardSpec, clip_grad_norm_

    x, _ = make_data()
    w = torch.randn(x.shape[0], x.shape[1], D_MODEL, generator=torch.Generator().manual_seed(3))
    cols = (rank * D_MODEL // WORLD, (rank + 1) * D_MODEL // WORLD)
    checks: dict[str, Any] = {}
    features_here = (rank * N_FEATURES // WORLD, (rank + 1) * N_FEATURES // WORLD)
    for name, features in (("replicated", None), ("features", features_here)):
        full, part = make_clt(), make_clt()
        before = list(part.parameters())
        spec = CLTShardSpec(d_out=cols, features=features, model_group=dist.group.WORLD, model_size=WORLD,
                            model_rank=rank)
        part.shard_(spec)
        out_full, out = full(x), part(x)
        (out_full.recon * w).sum().backward()
        (out.recon * w[..., cols[0] : cols[1]]).sum().backward()  # each rank's columns: the ranks' sum is the loss
        err = (out.recon - out_full.recon[..., cols[0] : cols[1]]).abs().max()
        for (n, p_full), p in zip(full.named_parameters(), part.parameters()):
            start, stop = cols if n.startswith(("W_dec", "b_dec")) else (features or (0, N_FEATURES))
            sliced = p_full.grad[..., start:stop] if p.shape != p_full.shape else p_full.grad
            err = torch.maximum(err, (p.grad - sliced).abs().max())
        total = torch.nn.utils.clip_grad_norm_(list(full.parameters()), 1e-3)
        total_part = clip_grad_norm_(part, list(part.parameters()), 1e-3)
        with torch.no_grad():
            part.shard = CLTShardSpec(**{**vars(spec), "gather_output": True})
            gathered = part(x).recon
        checks[name] = {
            "max_err": float(err),
            "norm_err": float((total - total_part).abs()),
            "gathered_err": float((gathered - out_full.recon).abs().max()),
            "own_methods": [k for k in ("forward", "decode", "decode_sparse", "encode") if k in vars(part)],
            "forward_is_the_class": type(part).forward is CLT.forward,
            "new_parameters": all(p is not q for p in part.sharded_parameters() for q in before),
            "shapes": [tuple(p.shape) for p in part.sharded_parameters()],
        }
        part.unshard_()
        checks[name]["whole_again"] = part.shard is None and all(
            torch.equal(a, b) for a, b in zip(part.state_dict().values(), make_clt().state_dict().values())
        )
    return checks


def scenarios(root: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    from _clt_helpers import TinyCLTModule
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_global_batch_topk import run_counts, run_equivalence

    from lightning_opt.strategies import DecoderShardingStrategy, GlobalBatchTopKStrategy

    def _adam_module() -> TinyCLTModule:
        return TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)

    def global_mse() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", batch_size=8)
        strategy = GlobalBatchTopKStrategy()
        _fit(m, strategy, root)
        topk_after = m.clt.topk_group
        return {"state": _state(m), "topk_modules": strategy.topk_modules, "topk_after": topk_after}

    def global_fp16() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", batch_size=8)
        _fit(m, GlobalBatchTopKStrategy(grad_compression="fp16"), root)  # bf16 hook: NCCL only
        return {"state": _state(m)}

    def sigterm_on_cpu() -> dict[str, Any]:
        import torch.distributed as dist
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        out = {}
        for name, strategy in (
            ("global", GlobalBatchTopKStrategy()),
            ("sharded", DecoderShardingStrategy(shard_encoder=True)),
        ):
            trainer = _fit(_adam_module(), strategy, root, max_steps=2)
            check = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
            check()  # no signal: returns on every rank
            trainer._signal_connector.received_sigterm = dist.get_rank() == 0  # only rank 0 got the signal
            try:
                check()
            except SIGTERMException:
                stopped = True
            else:
                stopped = False
            out[name] = {"installed": check.__name__, "stopped": stopped}
        flags = [None] * WORLD
        dist.all_gather_object(flags, out)
        return {"per_rank": flags}

    def global_fvu() -> dict[str, Any]:
        m = TinyCLTModule(loss="fvu", batch_size=8)
        _fit(m, GlobalBatchTopKStrategy(), root)
        return {"state": _state(m)}

    def model_owns_its_shard() -> dict[str, Any]:
        import torch.distributed as dist

        per_rank: list[Any] = [None] * WORLD
        dist.all_gather_object(per_rank, _model_shard_checks(dist.get_rank()))
        return {"per_rank": per_rank}

    def sharded_mse_consolidated() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
        ckpt = ModelCheckpoint(dirpath=root / "consolidated", every_n_train_steps=2, save_top_k=-1)
        _fit(m, DecoderShardingStrategy(), root, callbacks=[ckpt], enable_checkpointing=True)
        return {
            "state": _state(m),
            "ckpt": str(root / "consolidated" / "epoch=0-step=2.ckpt"),
            "val_shapes": m.val_shapes,
            "overrides": m.overrides,
        }

    def sharded_encoder() -> dict[str, Any]:
        m = _adam_module()
        ckpt = ModelCheckpoint(dirpath=root / "encoder", every_n_train_steps=2, save_top_k=-1)
        _fit(
            m, DecoderShardingStrategy(shard_encoder=True), root, callbacks=[ckpt], enable_checkpointing=True
        )
        return {
            "state": _state(m),
            "ckpt": str(root / "encoder" / "epoch=0-step=2.ckpt"),
            "val_shapes": m.val_shapes,
            "overrides": m.overrides,
        }

    def sharded_encoder_fallback() -> dict[str, Any]:
        # the padded pool's capacity forced below the candidate count: every step detects it at the decode's
        # bounds sync and redoes the selection on the synced path (whose sampled bound then admits too few
        # candidates: its own exact fallback runs too); the result must not change
        from lightning_opt.models import clt as clt_model
        from lightning_opt.ops import global_topk

        calls = {"n": 0}
        original = clt_model.shard_candidates  # the synced candidate step, as the model calls it

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return original(*args, **kwargs)

        saved = global_topk._sample_rank, clt_model.shard_candidates
        global_topk._sample_rank, clt_model.shard_candidates = (lambda s, frac: 1), counted
        try:
            m = _adam_module()
            _fit(m, DecoderShardingStrategy(shard_encoder=True), root)
        finally:
            global_topk._sample_rank, clt_model.shard_candidates = saved
        return {"state": _state(m), "synced_selections": calls["n"]}

    def sharded_fvu() -> dict[str, Any]:
        m = TinyCLTModule(loss="fvu", batch_size=8)
        _fit(m, DecoderShardingStrategy(), root, gradient_clip_val=CLIP)
        return {"state": _state(m), "overrides": m.overrides}

    def clipping_needs_the_hook() -> dict[str, Any]:
        import lightning.pytorch as pl

        class DefaultClipping(TinyCLTModule):
            configure_gradient_clipping = pl.LightningModule.configure_gradient_clipping

        try:
            _fit(DefaultClipping(loss="fvu"), DecoderShardingStrategy(), root, gradient_clip_val=CLIP)
        except ValueError as err:
            return {"error_message": str(err)}
        return {"error_message": None}

    def sharded_checkpoint_resume() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
        ckpt = ModelCheckpoint(dirpath=root / "sharded", every_n_train_steps=2, save_top_k=-1)
        strategy = DecoderShardingStrategy(checkpoint_format="sharded")
        _fit(m, strategy, root, callbacks=[ckpt], enable_checkpointing=True, max_steps=2)
        path = root / "sharded" / "epoch=0-step=2.ckpt"
        resumed = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
        _fit(resumed, DecoderShardingStrategy(checkpoint_format="sharded"), root, ckpt_path=str(path))
        return {"state": _state(resumed), "files": sorted(p.name for p in path.iterdir())}

    def data_parallel_via_sharding_strategy() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", batch_size=8)
        _fit(m, DecoderShardingStrategy(model_parallel_size=1), root)
        return {"state": _state(m)}

    def clt_module(strategy_name: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            import torch.distributed as dist
            from _clt_helpers import loader, make_clt_module, params_of

            module = make_clt_module()
            if strategy_name == "global":
                strategy, data = GlobalBatchTopKStrategy(), loader(8, WORLD, dist.get_rank())
            else:
                strategy, data = DecoderShardingStrategy(shard_encoder=strategy_name == "encoder"), loader(8)
            import lightning.pytorch as pl
            from _clt_helpers import trainer_kwargs

            trainer = pl.Trainer(
                strategy=strategy, devices=WORLD, **trainer_kwargs(root, limit_val_batches=0)
            )
            trainer.fit(module, train_dataloaders=data)
            return {"params": params_of(module)}

        return run

    return {
        "equivalence": lambda: run_equivalence(),
        "counts": lambda: run_counts(),
        "sigterm_on_cpu": sigterm_on_cpu,
        "global_fp16": global_fp16,
        "clt_module_global": clt_module("global"),
        "clt_module_sharded": clt_module("sharded"),
        "clt_module_sharded_encoder": clt_module("encoder"),
        "sharded_encoder": sharded_encoder,
        "sharded_encoder_fallback": sharded_encoder_fallback,
        "global_mse": global_mse,
        "global_fvu": global_fvu,
        "model_owns_its_shard": model_owns_its_shard,
        "sharded_mse_consolidated": sharded_mse_consolidated,
        "sharded_fvu": sharded_fvu,
        "sharded_checkpoint_resume": sharded_checkpoint_resume,
        "data_parallel_via_sharding_strategy": data_parallel_via_sharding_strategy,
        "clipping_needs_the_hook": clipping_needs_the_hook,
    }


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        NODE_RANK="0",
    )
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    root = Path(out_dir)
    for name, fn in scenarios(root).items():
        try:
            result = {"ok": True, **(fn() or {})}
        except Exception:  # recorded for the test of this scenario; the others still run
            result = {"ok": False, "error": f"rank {rank}: {traceback.format_exc()}"}
        if rank == 0 or not result["ok"]:
            torch.save(result, root / f"{name}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()
