"""2D layout (2 data groups x 2 decoder shards) on 4 gloo ranks equals one process with the 2x batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from _clt_helpers import TinyCLTModule, assert_states_close, fit_single, free_port

WORLD = 4


def _worker(rank: int, port: int, out: str, shard_encoder: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(WORLD), NODE_RANK="0",
    )  # fmt: skip
    import lightning.pytorch as pl
    import torch.distributed as dist
    from _clt_helpers import trainer_kwargs

    from lightning_opt.strategies import DecoderShardingStrategy

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    module = TinyCLTModule(loss="fvu", batch_size=8)
    strategy = DecoderShardingStrategy(model_parallel_size=2, shard_encoder=shard_encoder)
    pl.Trainer(strategy=strategy, devices=WORLD, **trainer_kwargs(out)).fit(module)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, Path(out) / "state.pt")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shard_encoder", [False, True])
def test_data_by_decoder_groups_match_single_process(tmp_path: Path, shard_encoder: bool) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path), shard_encoder), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "state.pt", weights_only=False)
    assert_states_close(got, fit_single(TinyCLTModule(loss="fvu", batch_size=16), tmp_path))
