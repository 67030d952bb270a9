"""Bytes each CLT strategy hands to collectives per training step: measured on CPU (gloo) vs the formulas.

    python -m benchmarks.comm_bytes            # 2 and 4 processes, writes benchmarks/results/comm_bytes_cpu.json
    python -m benchmarks.comm_bytes --smoke    # smaller shapes (the test runs this)

Each variant runs three training steps of a CLT (MSE loss, Adam) under a Lightning ``Trainer`` with the
strategy, in ``world`` spawned CPU processes joined by gloo. This process (not the library) wraps
``torch.distributed``'s collective functions (``all_reduce``, ``all_gather_into_tensor``, ``all_gather``,
``broadcast``, ``reduce_scatter_tensor``, ``all_gather_single``, ``reduce_scatter_single`` (FSDP2's) and DDP's ``_broadcast_coalesced`` of module buffers) and registers a DDP
communication hook that counts every gradient bucket. The count covers the third step, from the end of the
second step to the end of the third (the per-step SIGTERM flag included), on rank 0. Bytes are the payload
a rank hands to a collective: the tensor for ``all_reduce``/``broadcast``, its own input for ``all_gather``;
what travels on the wire depends on the algorithm (a ring all-reduce sends about ``2 (W-1)/W`` times the payload).

:func:`predicted_bytes` is the table of docs/strategies.md ("Several machines") as code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import command_line, environment, write_result

RESULTS = Path(__file__).resolve().parent / "results" / "comm_bytes_cpu.json"

# name -> (world, strategy class, strategy kwargs)
VARIANTS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "global_batchtopk_2": (2, "GlobalBatchTopKStrategy", {}),
    "global_batchtopk_4": (4, "GlobalBatchTopKStrategy", {}),
    "decoder_sharding_2": (2, "DecoderShardingStrategy", {}),
    "decoder_sharding_shard_encoder_2": (2, "DecoderShardingStrategy", {"shard_encoder": True}),
    "decoder_sharding_shard_encoder_4": (4, "DecoderShardingStrategy", {"shard_encoder": True}),
    "decoder_sharding_2d_m2_d2": (4, "DecoderShardingStrategy", {"model_parallel_size": 2}),
    "decoder_sharding_2d_m2_d2_shard_encoder": (4, "DecoderShardingStrategy",
                                                {"model_parallel_size": 2, "shard_encoder": True}),
    "fsdp_global_batchtopk_2": (2, "FSDPGlobalBatchTopKStrategy", {}),
    "fsdp_global_batchtopk_reshard_4": (4, "FSDPGlobalBatchTopKStrategy", {"reshard_after_forward": True}),
}


# ----------------------------------------------------------------------------------------------- formulas
def _sample_rank(s: int, frac: float) -> int:
    """The candidate step's sampled rank (lightning_opt.ops.topk._sample_rank): 1.1 x mean + 4 sigma + 16."""
    mean = s * frac
    return min(s, int(math.ceil(1.1 * mean + 4.0 * math.sqrt(mean) + 16)))


def clt_params(L: int, D: int, F: int) -> int:
    """Parameters of an untied CLT: W_enc [L, D, F], b_enc [L, F], W_dec[s] [F, L - s, D], b_dec [L, D]."""
    return L * D * F + L * F + F * D * L * (L + 1) // 2 + L * D


def clt_param_shapes(L: int, D: int, F: int) -> list[tuple[int, ...]]:
    """Shapes of an untied CLT's parameters (W_enc, b_enc, W_dec[0..L-1], b_dec)."""
    return [(L, D, F), (L, F), *[(F, L - s, D) for s in range(L)], (L, D)]


def fsdp_padded_params(L: int, D: int, F: int, N: int) -> int:
    """Elements FSDP2 all-gathers and reduce-scatters for a CLT over N ranks: every parameter sharded on its largest
    dimension (strategies.fsdp_global_batch_topk.largest_dim_placement), that dimension padded to a multiple of N."""
    total = 0
    for shape in clt_param_shapes(L, D, F):
        big = max(shape)
        total += -(-big // N) * N * (math.prod(shape) // big)
    return total


def _general_topk(n_local: int, frac: float) -> int:
    """Bytes of one exact selection over a group (ops.global_topk._select), one rank: the bound or the
    token/size/bound gather (counted by the caller), candidate counts (8), candidate values (4 x C_max, C_max
    estimated as the sampled rank: about 1.1 K / W), tie counts (16)."""
    c_max = _sample_rank(min(n_local, 1 << 18), frac) * n_local // min(n_local, 1 << 18)
    return 8 + 4 * c_max + 16


def predicted_bytes(strategy: str, *, F: int, T: int, L: int, D: int, k: int, N: int,
                    M: int | None = None, shard_encoder: bool = False,
                    reshard_after_forward: bool = False) -> dict[str, int]:
    """Bytes one rank hands to collectives per training step (float32 CLT, MSE loss), by term.

    F features per layer, T tokens per optimizer step (all ranks), L layers, D d_model, k active features per
    token, N ranks; decoder sharding: M ranks per decoder group (default N), D_data = N / M data groups.
    """
    P = clt_params(L, D, F)
    K = k * T
    out: dict[str, int] = {"sigterm_flag": 8}  # the per-step SIGTERM flag (int64) over the gloo group
    if strategy == "GlobalBatchTopKStrategy":
        n = (T // N) * L * F
        out["ddp_gradients"] = 4 * P
        out["ddp_buffers"] = 4 * 4 * L * D  # DDP broadcasts the normalisation buffers every forward
        out["topk_head"] = 24  # tokens, entries, sampled bound (float64 x 3)
        out["topk_select"] = _general_topk(n, k / (L * F))
        return out
    if strategy == "FSDPGlobalBatchTopKStrategy":
        padded = fsdp_padded_params(L, D, F, N)
        out["fsdp_all_gather"] = (2 if reshard_after_forward else 1) * 4 * padded // N
        out["fsdp_reduce_scatter"] = 4 * padded
        out["topk_head"] = 24
        out["topk_select"] = _general_topk((T // N) * L * F, k / (L * F))
        return out
    M = M or N
    Dd = N // M
    tokens = T // Dd  # each decoder group's tokens
    out["loss"] = 4  # mean of the slice means over the decoder group
    if shard_encoder and Dd == 1:
        n = tokens * L * F // M
        s = min(n, 1 << 18)
        cap = min(n, int(1.3 * _sample_rank(s, K / (n * M)) / s * n) + 1024)
        isz = 4 if L * tokens * F < 2**31 else 8
        out["bound_and_counts"] = 4 + 8
        out["pool_gather"] = cap * (isz + 4)
        out["pool_grad"] = M * cap * 4  # gloo: an all-reduce of the whole pool (NCCL: reduce-scatter, 1/M)
    elif shard_encoder:
        n = tokens * L * F // M
        out["token_count"] = 4
        out["bound"] = 4
        out["topk_select"] = _general_topk(n, K / (n * N))
        kept = K // N  # entries each rank keeps (on average)
        out["kept_gather"] = kept * 12  # int64 index + float32 value
        out["kept_grad"] = M * kept * 4
    else:
        nnz = k * tokens  # kept entries of the decoder group's tokens
        out["values_grad"] = 4 * nnz  # sum of the sparse activations' gradient over the decoder group
        if Dd > 1:
            out["topk_head"] = 24
            out["topk_select"] = _general_topk(tokens * L * F, k / (L * F))
    if Dd > 1:
        sharded = (F * D * L * (L + 1) // 2 + L * D) // M
        local = sharded + ((L * D * F + L * F) // M if shard_encoder else L * D * F + L * F)
        out["data_gradients"] = 4 * local
    return out


# ----------------------------------------------------------------------------------------------- counting
class _Counter:
    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, int]] = []

    def add(self, op: str, nbytes: int) -> None:
        if self.on:
            self.calls.append((op, int(nbytes)))


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def install_shim(counter: _Counter) -> None:
    """Wrap torch.distributed's collectives in this process so every call is counted (payload bytes)."""
    import torch.distributed as dist

    payload = {  # op -> which argument is this rank's payload
        "all_reduce": 0, "broadcast": 0, "all_gather_into_tensor": 1, "all_gather": 1,
        "reduce_scatter_tensor": 1, "all_gather_single": 1, "reduce_scatter_single": 1, "_broadcast_coalesced": 1,
    }
    for op, pos in payload.items():
        fn = getattr(dist, op, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Any = fn, _op: str = op, _pos: int = pos, **kwargs: Any) -> Any:
            arg = args[_pos] if len(args) > _pos else kwargs.get({0: "tensor", 1: "input_tensor"}[min(_pos, 1)])
            if arg is None and _pos == 1:
                arg = kwargs.get("input")  # reduce_scatter_single(output=, input=) as FSDP2 calls it
            if _op == "all_gather" and len(args) > 1:
                arg = args[1]
            counter.add(_op, _nbytes(arg))
            return _fn(*args, **kwargs)

        setattr(dist, op, wrapped)


def _worker(rank: int, world: int, port: int, name: str, shape: dict[str, int], out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from benchmarks.dist_launch import init_group
    from lightning_opt import strategies
    from lightning_opt.models.clt import CLT, CLTConfig

    counter = _Counter()
    install_shim(counter)
    init_group(rank, world, port, smoke=True, timeout_s=120)
    _, cls_name, kwargs = VARIANTS[name]
    strategy = getattr(strategies, cls_name)(**kwargs)
    L, D, nf, k, T = shape["L"], shape["D"], shape["F"], shape["k"], shape["T"]
    M = kwargs.get("model_parallel_size") or world
    data_groups = world // M if cls_name == "DecoderShardingStrategy" else world
    per_rank = T // data_groups

    class Bench(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.clt = CLT(CLTConfig(n_layers=L, d_model=D, n_features=nf, activation="batchtopk_global", k=k))

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            data_rank = self.global_rank // M if cls_name == "DecoderShardingStrategy" else self.global_rank
            gen = torch.Generator().manual_seed(1000 * i + data_rank)
            x = torch.randn(per_rank, L, D, generator=gen)
            y = torch.randn(per_rank, L, D, generator=gen)
            out = self.clt(x, dense=False)
            if self.clt.d_out_slice is not None:
                y = y[..., self.clt.d_out_slice[0]: self.clt.d_out_slice[1]]
            return F.mse_loss(out.recon.float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(list(range(64)), batch_size=1)

    class Window(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            ddp = trainer.strategy.model
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations: none here
                    counter.add("ddp_bucket_all_reduce", _nbytes(bucket.buffer()))
                    was, counter.on = counter.on, False  # the hook's own all_reduce: counted above
                    try:
                        return default_hooks.allreduce_hook(state, bucket)
                    finally:
                        counter.on = was

                ddp.register_comm_hook(None, hook)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                counter.on = True
            elif trainer.global_step == 3:
                counter.on = False

    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Window()], num_sanity_val_steps=0)
    trainer.fit(Bench())
    if rank == 0:
        Path(out_dir, f"{name}.json").write_text(json.dumps(counter.calls))
    # Leave together and close the group: a gloo group left open at interpreter exit can abort the process
    # ("terminate called without an active exception") after its results are written.
    counter.on = False
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_variant(name: str, shape: dict[str, int], fork: bool = False) -> list[tuple[str, int]]:
    """One variant in ``world`` processes; ``fork`` (CPU only: no CUDA in the parent) saves each process the
    import of torch and Lightning."""
    import torch.multiprocessing as mp

    from benchmarks.dist_launch import free_port

    world = VARIANTS[name][0]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, free_port(), name, shape, tmp), nprocs=world, join=True,
                           start_method="fork" if fork else "spawn")
        return [tuple(c) for c in json.loads(Path(tmp, f"{name}.json").read_text())]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="smaller shapes; does not write the results file")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None, help=f"JSON output (default: {RESULTS}, not with --smoke)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = ({"L": 2, "D": 16, "F": 256, "k": 8, "T": 128} if args.smoke
             else {"L": 3, "D": 32, "F": 1024, "k": 16, "T": 512})
    rows = []
    for name in args.variants:
        world, cls_name, kwargs = VARIANTS[name]
        calls = run_variant(name, shape, fork=args.smoke and not torch.cuda.is_available())
        measured = sum(b for _, b in calls)
        terms = predicted_bytes(cls_name, F=shape["F"], T=shape["T"], L=shape["L"], D=shape["D"], k=shape["k"],
                                N=world, M=kwargs.get("model_parallel_size"),
                                shard_encoder=kwargs.get("shard_encoder", False),
                                reshard_after_forward=kwargs.get("reshard_after_forward", False))
        predicted = sum(terms.values())
        rows.append({"variant": name, "strategy": cls_name, "kwargs": kwargs, "world": world,
                     "predicted_bytes": predicted, "measured_bytes": measured, "ratio": measured / predicted,
                     "predicted_terms": terms, "measured_calls": calls})
        if os.environ.get("COMM_BYTES_CALLS"):
            print(name, calls, terms, flush=True)
        print(f"{name:42s} W={world}  predicted {predicted:>10,d}  measured {measured:>10,d}  "
              f"ratio {measured / predicted:.3f}", flush=True)
    result = {"shape": shape, "rows": rows}
    out = args.out or (None if args.smoke else str(RESULTS))
    if out:
        write_result(out, benchmark="comm_bytes", env={**environment(on_gpu=False), "collectives": "gloo"},
                     command=command_line(argv), baseline=None, results=result)
    return result


if __name__ == "__main__":
    main()
