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

    def sharded_mse_consolidated() -> dict[str, Any]:
        m = TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)
        ckpt = ModelCheckpoint(dirpath=root / "consolidated", every_n_train_steps=2, save_top_k=-1)
        _fit(m, DecoderShardingStrategy(), root, callbacks=[ckpt], enable_checkpointing=True)
        return {
            "state": _state(m),
            "ckpt": str(root / "consolidated" / "epoch=0-step=2.ckpt"),
            "val_shapes": m.val_shapes,
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
        }

    def sharded_encoder_fallback() -> dict[str, Any]:
        # the padded pool's capacity forced below the candidate count: every step detects it at the decode's
        # bounds sync and redoes the selection on the synced path (whose sampled bound then admits too few
        # candidates: its own exact fallback runs too); the result must not change
        from lightning_opt.ops import global_topk

        calls = {"n": 0}
        original = global_topk.shard_candidates

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return original(*args, **kwargs)

        saved = global_topk._sample_rank, global_topk.shard_candidates
        global_topk._sample_rank, global_topk.shard_candidates = (lambda s, frac: 1), counted
        try:
            m = _adam_module()
            _fit(m, DecoderShardingStrategy(shard_encoder=True), root)
        finally:
            global_topk._sample_rank, global_topk.shard_candidates = saved
        return {"state": _state(m), "synced_selections": calls["n"]}

    def sharded_fvu() -> dict[str, Any]:
        m = TinyCLTModule(loss="fvu", batch_size=8)
        _fit(m, DecoderShardingStrategy(), root, gradient_clip_val=CLIP)
        return {"state": _state(m)}

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
        "sharded_mse_consolidated": sharded_mse_consolidated,
        "sharded_fvu": sharded_fvu,
        "sharded_checkpoint_resume": sharded_checkpoint_resume,
        "data_parallel_via_sharding_strategy": data_parallel_via_sharding_strategy,
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
