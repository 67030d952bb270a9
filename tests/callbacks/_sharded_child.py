"""One rank of the sharded (FSDP2 / ModelParallelStrategy) AsyncCheckpoint test; launched twice by
test_async_checkpoint.py with torchelastic-style environment variables (gloo on CPU)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from lightning_opt.callbacks import AsyncCheckpoint  # noqa: E402
from tests.callbacks.conftest import TinyModule, make_batches  # noqa: E402


class Sharded(TinyModule):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def trainer(root, callbacks, **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **kw,
    )


def main(root: str) -> None:
    batches = make_batches(6)
    full = Sharded(batches=batches)
    trainer(f"{root}/a", []).fit(full)
    first = Sharded(batches=batches)
    cb = AsyncCheckpoint(dirpath=f"{root}/ck", every_n_steps=2, keep_last_k=1, save_on_train_end=False)
    trainer(f"{root}/b", [cb], max_steps=5).fit(first)
    second = Sharded(batches=batches)
    t = trainer(
        f"{root}/c", [AsyncCheckpoint(dirpath=f"{root}/ck2", every_n_steps=100, save_on_train_end=False)]
    )
    t.fit(second, ckpt_path=f"{root}/ck/last.ckpt")
    losses = first.losses[:4] + second.losses == full.losses
    params = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(full.parameters(), second.parameters())
    )
    names = sorted(n for n in os.listdir(f"{root}/ck") if not n.startswith("."))
    print(
        f"RESULT rank={t.global_rank} losses_equal={losses} params_equal={params} names={names}", flush=True
    )


if __name__ == "__main__":
    main(sys.argv[1])
