"""CLT training throughput on 1 vs 2 GPUs with each lightning_opt strategy (same global batch).

A 12-layer CLT (d_model 768, k=200 active features per token over all layers, BatchTopK over the whole
batch) trains on random activations with a real ``Trainer`` (bf16-mixed, fused Adam, sparse decode), at
8192, 16384 and 32768 features per layer, 4096 tokens per optimizer step:

- ``ours_1gpu``: one GPU, the whole batch, local BatchTopK;
- ``ours_global_batchtopk_2gpu``: ``GlobalBatchTopKStrategy``, 2048 tokens per GPU, exact global BatchTopK;
- ``ours_decoder_sharding_2gpu``: ``DecoderShardingStrategy``, both GPUs see the 4096 tokens, each decodes
  half of d_model (encoders replicated);
- ``ours_decoder_sharding_sharded_encoder_2gpu``: the same with ``shard_encoder=True`` (each GPU encodes half
  of the features; sparse activations all-gathered);
- ``peer_crosslayer_coding_{1,2}gpu``: crosslayer-coding's model (tensor-parallel) when ``.peers/crosslayer-coding``
  and ``benchmarks/peers/clt_tp_runner.py`` exist.

Reported per variant: median step time (interval between batch starts, CUDA events), tokens/s, speedup over
the 1-GPU run of the same size, mean active features per token over the global batch (must be k), bytes moved
by our collectives per step (measured at the Python collectives) plus DDP's gradient all-reduce payload
(computed), and peak memory. Each variant runs in fresh processes; one failing variant is recorded and the
others still run.

    python benchmarks/clt_scaling.py            # 2 CUDA GPUs, about 3-4 minutes on H100s (2 launches)
    python benchmarks/clt_scaling.py --smoke    # CPU + gloo, 2 processes, under a minute
    # the short re-run (about 1.5 minutes on 2 GPUs): 1 GPU vs sharded encoders at two sizes
    python benchmarks/clt_scaling.py --features 8192 16384 --variants ours_1gpu \\
        ours_decoder_sharding_sharded_encoder_2gpu --out benchmarks/results/clt_scaling_short.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from clt_common import write_result  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ByteCounter:
    """Counts payload bytes of the Python-level collectives (ours); DDP's C++ reducer is not seen here."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = 0
        self._dist = dist
        self._orig: dict[str, Any] = {}
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast"):
            fn = getattr(dist, name, None)
            if fn is not None:
                self._orig[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def close(self) -> None:
        for name, fn in self._orig.items():
            setattr(self._dist, name, fn)

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):
                self.bytes += first.numel() * first.element_size()
            elif isinstance(first, list):
                self.bytes += sum(t.numel() * t.element_size() for t in first)
            return fn(*args, **kwargs)

        return counted


class _Phases:
    """Per-phase times of each step on this rank: CUDA events (GPU timeline) and host clock side by side.

    A phase's GPU time is the interval between the events recorded at its start and end marks, so it
    includes GPU idle time (e.g. waiting for the host after a sync). A phase whose host time is close to
    its GPU time is bound by the host (Python and kernel launches), not by the GPU.
    """

    def __init__(self, device_type: str, enabled: bool) -> None:
        self.device_type, self.enabled = device_type, enabled
        self.steps: list[list[tuple[str, Any, float]]] = []

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        import time

        if name == "start":
            self.steps.append([])
        if not self.steps:
            return
        event = None
        if self.device_type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.steps[-1].append((name, event, time.perf_counter()))

    def summary(self, warmup: int) -> dict[str, dict[str, float]]:
        """Median GPU and host milliseconds per phase over the measured steps (``between_steps``: the
        interval from one step's last mark to the next step's start)."""
        if not self.enabled or len(self.steps) <= warmup + 1:
            return {}
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        gpu: dict[str, list[float]] = {}
        host: dict[str, list[float]] = {}
        steps = self.steps[warmup:]
        for i, marks in enumerate(steps):
            pairs = list(zip(marks[:-1], marks[1:]))
            if i + 1 < len(steps) and steps[i + 1]:
                pairs.append((marks[-1], ("between_steps", *steps[i + 1][0][1:])))
            for (_, ea, ta), (name, eb, tb) in pairs:
                gpu.setdefault(name, []).append(ea.elapsed_time(eb) if ea is not None else (tb - ta) * 1e3)
                host.setdefault(name, []).append((tb - ta) * 1e3)
        return {
            "clock": "cuda_events" if self.device_type == "cuda" else "host",
            "gpu_ms": {k: statistics.median(v) for k, v in gpu.items()},
            "host_ms": {k: statistics.median(v) for k, v in host.items()},
        }


def _build_module(
    args: argparse.Namespace, n_features: int, tokens_per_rank: int, device_type: str, phases: _Phases
) -> Any:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from lightning_opt.models.clt import CLT, CLTConfig
    from lightning_opt.ops.global_topk import batch_topk_threshold_sparse

    class _Steps(Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> int:
            return i

    class BenchCLT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = CLTConfig(
                n_layers=args.layers,
                d_model=args.d_model,
                n_features=n_features,
                activation="batchtopk_global",
                k=args.k,
            )
            self.clt = CLT(cfg)
            self.l0: list[float] = []

        def setup(self, stage: str) -> None:
            # A pool of random activations on the device; each step reads a window (no loader cost).
            gen = torch.Generator(device="cpu").manual_seed(1234 + self.global_rank)
            pool = 2 * tokens_per_rank
            self.register_buffer(
                "pool_x",
                torch.randn(pool, args.layers, args.d_model, generator=gen).to(self.device),
                persistent=False,
            )
            self.register_buffer(
                "pool_y",
                torch.randn(pool, args.layers, args.d_model, generator=gen).to(self.device),
                persistent=False,
            )

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            start = (batch_idx % 2) * tokens_per_rank
            x = self.pool_x[start : start + tokens_per_rank]
            y = self.pool_y[start : start + tokens_per_rank]
            clt = self.clt
            N = x.shape[0]
            phases.mark("lightning")  # batch start -> training_step: zero_grad, hooks, the strategy's wrapper
            if "forward" in vars(clt):  # a strategy replaced the forward (feature-sharded encoders)
                out = clt(x, dense=False)  # marks encode, select, gather, decode (strategy.phase_hook)
                idx, recon = out.indices, out.recon
            else:
                pre = clt.encode(x)
                phases.mark("encode")
                L, _, nf = pre.shape
                idx, vals = batch_topk_threshold_sparse(pre.reshape(N, L * nf), args.k, clt.topk_group)
                phases.mark("select")
                recon = clt.decode_sparse(idx, F.relu(vals), N)
                phases.mark("decode")
            if clt.d_out_slice is not None:
                y = y[..., clt.d_out_slice[0] : clt.d_out_slice[1]]
            self.l0.append(idx.numel() / N)  # idx.numel() is known on the host (nonzero sized it)
            loss = F.mse_loss(recon.float(), clt.normalize_targets(y).float())
            phases.mark("loss")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4, fused=device_type == "cuda")

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_Steps(), batch_size=1)

    return BenchCLT()


class _StepTimer:
    def __init__(
        self,
        device_type: str,
        warmup: int,
        counter: _ByteCounter | None = None,
        phases: _Phases | None = None,
    ) -> None:
        import lightning.pytorch as pl

        outer = self
        mark = phases.mark if phases is not None else (lambda name: None)

        class Cb(pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                outer.mark()
                mark("start")

            def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
                mark("loss_reduce")  # training_step return -> backward: the strategy's loss all-reduce

            def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
                mark("backward")  # incl. collectives inside autograd and DDP's un-overlapped all-reduce

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                mark("post_backward")  # the strategy's post_backward (e.g. 2D grad all-reduce), clipping

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
                mark("optimizer")

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                outer.mark()

        self.callback = Cb()
        self.device_type = device_type
        self.warmup = warmup
        self.counter = counter
        self.events: list[Any] = []
        self.bytes: list[int] = []

    def bytes_per_step(self) -> float:
        """Bytes our collectives moved per measured step (setup broadcasts and warm-up excluded)."""
        if not self.bytes or len(self.bytes) <= self.warmup + 1:
            return 0.0
        return (self.bytes[-1] - self.bytes[self.warmup]) / (len(self.bytes) - 1 - self.warmup)

    def mark(self) -> None:
        self.bytes.append(self.counter.bytes if self.counter else 0)
        if self.device_type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
        else:
            import time

            self.events.append(time.perf_counter())

    def step_ms(self) -> float:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in zip(self.events[:-1], self.events[1:])]
        else:
            times = [(b - a) * 1e3 for a, b in zip(self.events[:-1], self.events[1:])]
        return statistics.median(times[self.warmup :])


def _run_ours(
    variant: str, rank: int, world: int, args: argparse.Namespace, n_features: int
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_opt.strategies import DecoderShardingStrategy, GlobalBatchTopKStrategy

    device_type = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if variant == "ours_global_batchtopk_2gpu":
        strategy: Any = GlobalBatchTopKStrategy()
        tokens_per_rank = args.tokens // world
    elif variant == "ours_global_batchtopk_bf16grad_2gpu":
        # bf16 gradient all-reduce: half the bytes, but rounded gradients (not bit-comparable to 1 GPU)
        # (fp16 in the CPU smoke run: torch's bf16 hook needs NCCL)
        strategy = GlobalBatchTopKStrategy(grad_compression="fp16" if device_type == "cpu" else "bf16")
        tokens_per_rank = args.tokens // world
    elif variant == "ours_decoder_sharding_2gpu":
        strategy = DecoderShardingStrategy()
        tokens_per_rank = args.tokens
    elif variant == "ours_decoder_sharding_sharded_encoder_2gpu":
        strategy = DecoderShardingStrategy(shard_encoder=True)
        tokens_per_rank = args.tokens
    elif variant == _AB_VARIANT:  # A/B: Lightning's own per-step SIGTERM broadcast on the GPU (+ .item())
        strategy = DecoderShardingStrategy(shard_encoder=True, cpu_sigterm_check=False)
        tokens_per_rank = args.tokens
    elif variant == _AB_SELECT:  # A/B: the general selection path (tie counts, then a gather of kept entries)
        import lightning_opt.strategies.decoder_sharding as ds

        ds._POOL_SELECT = False
        strategy = DecoderShardingStrategy(shard_encoder=True)
        tokens_per_rank = args.tokens
    else:
        strategy, tokens_per_rank = "auto", args.tokens
    # Parameters are created on the device: initialising billions of them on the CPU takes long.
    # every rank records its phases (the same host work on each): rank 1's show where rank 0 waits for it
    phases = _Phases(device_type, enabled=True)
    if hasattr(strategy, "phase_hook"):
        strategy.phase_hook = phases.mark
    with torch.device(f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu"):
        module = _build_module(args, n_features, tokens_per_rank, device_type, phases)
    counter = _ByteCounter() if world > 1 else None
    timer = _StepTimer(device_type, args.warmup, counter, phases)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        accelerator="gpu" if device_type == "cuda" else "cpu",
        devices=world,
        strategy=strategy,
        precision="bf16-mixed" if device_type == "cuda" else "32-true",
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer.callback],
    )
    try:
        trainer.fit(module)
    finally:
        if counter is not None:
            counter.close()
        import lightning_opt.strategies.decoder_sharding as ds

        ds._POOL_SELECT = True
    step_ms = timer.step_ms()
    n_params = sum(p.numel() for p in module.parameters())
    l0 = module.l0[-1]
    data_parallel = variant.startswith("ours_global_batchtopk")
    if data_parallel:
        t = torch.tensor([l0 * tokens_per_rank], dtype=torch.float64, device=trainer.strategy.root_device)
        dist.all_reduce(t)  # global active entries / global tokens
        l0 = float(t) / args.tokens
    ours_bytes = timer.bytes_per_step()
    summaries: list[Any] = [phases.summary(args.warmup)]
    if world > 1:
        gathered: list[Any] = [None] * world
        try:
            dist.all_gather_object(gathered, summaries[0])
            summaries = gathered
        except Exception as err:  # diagnostics only: the timing row must survive
            summaries.append({"error": f"{type(err).__name__}: {err}"})
    ddp_bytes = n_params * (2 if "bf16grad" in variant else 4) if data_parallel else 0
    return {
        "variant": variant,
        "features_per_layer": n_features,
        "world": world,
        "tokens_per_step": args.tokens,
        "tokens_per_rank": tokens_per_rank,
        "note": "collective_bytes_per_step_ours includes the bf16 hook's all-reduce (a Python-level call)"
        if "bf16grad" in variant
        else "",
        "phases_rank0": summaries[0],
        **({"phases_rank1": summaries[1]} if world > 1 else {}),
        "step_ms": step_ms,
        "tokens_per_s": args.tokens / (step_ms / 1e3),
        "active_per_token": l0,
        "collective_bytes_per_step_ours": ours_bytes,
        "ddp_grad_allreduce_bytes_per_step": ddp_bytes,
        "params": n_params,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else None,
    }


def _run_peer(rank: int, world: int, args: argparse.Namespace, n_features: int) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(HERE, "..", ".peers", "crosslayer-coding"))
    from benchmarks.peers.clt_tp_runner import peer_step_times

    res = peer_step_times(
        n_features=n_features, tokens=args.tokens, k=args.k, n_layers=args.layers, d_model=args.d_model,
        steps=args.steps, warmup=args.warmup, smoke=args.smoke,
    )  # fmt: skip
    res.update(variant=f"peer_crosslayer_coding_{world}gpu", features_per_layer=n_features, world=world)
    res.setdefault("tokens_per_step", args.tokens)
    if "step_ms" in res:
        res["tokens_per_s"] = args.tokens / (res["step_ms"] / 1e3)
    return res


_AB_VARIANT = "ours_decoder_sharding_sharded_encoder_gpu_sigterm_2gpu"
_AB_SELECT = "ours_decoder_sharding_sharded_encoder_general_select_2gpu"
_ALL_VARIANTS = (
    "ours_1gpu",
    "peer_crosslayer_coding_1gpu",
    "ours_global_batchtopk_2gpu",
    "ours_global_batchtopk_bf16grad_2gpu",
    "ours_decoder_sharding_2gpu",
    "ours_decoder_sharding_sharded_encoder_2gpu",
    _AB_VARIANT,
    _AB_SELECT,
    "peer_crosslayer_coding_2gpu",
)


def _runs(args: argparse.Namespace, variants: list[str]) -> list[tuple[int, str]]:
    """(features per layer, variant) in run order; the peer only at ``--peer-features`` (it is slow), the
    SIGTERM A/B only at the smallest size (where fixed per-step costs weigh most)."""
    return [
        (f, v)
        for f in args.features
        for v in variants
        if (not v.startswith("peer") or f in args.peer_features)
        and (v not in (_AB_VARIANT, _AB_SELECT) or f == args.features[0])
    ]


def _worker(
    rank: int, world: int, port: int, variants: list[str], args: argparse.Namespace, out_dir: str
) -> None:
    """Run every size x variant one after the other in these processes (start-up is paid once).

    Rank 0 writes one JSON per run.
    """
    import gc

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(world), NODE_RANK="0",
    )  # fmt: skip
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and not args.smoke
    if use_cuda:
        torch.cuda.set_device(rank)
    backend = "nccl" if use_cuda else "gloo"
    kw = {"device_id": torch.device("cuda", rank)} if use_cuda else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120), **kw)
    for n_features, variant in _runs(args, variants):
        try:
            if variant.startswith("peer"):
                result = _run_peer(rank, world, args, n_features)
            else:
                result = _run_ours(variant, rank, world, args, n_features)
        except Exception as err:  # recorded; the other variants still run
            result = {"variant": variant, "features_per_layer": n_features, "world": world}
            result["error"] = f"{type(err).__name__}: {err}"
            result["traceback"] = traceback.format_exc(limit=6)
        if rank == 0:
            with open(os.path.join(out_dir, f"{variant}_{n_features}.json"), "w") as f:
                json.dump(result, f)
        gc.collect()
        if use_cuda:
            torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CLT on CPU with 2 gloo processes")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/clt_scaling.json)")
    parser.add_argument("--features", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip crosslayer-coding")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help=f"run only these variants (default: all): {', '.join(_ALL_VARIANTS)}; keep ours_1gpu for the "
        "same-run baseline of the ratios",
    )  # fmt: skip
    parser.add_argument(
        "--peer-features", type=int, nargs="+", default=[8192, 16384],
        help="sizes at which crosslayer-coding runs (its 32768 run alone takes about a minute)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.smoke:
        args.features, args.tokens, args.k, args.layers, args.d_model = [64, 128], 64, 4, 3, 16
        args.peer_features = [64, 128]
        args.steps, args.warmup = 2, 1
    gpus = torch.cuda.device_count() if not args.smoke else 2
    peer_ok = (
        not args.no_peer
        and os.path.isdir(os.path.join(HERE, "..", ".peers", "crosslayer-coding"))
        and os.path.exists(os.path.join(HERE, "peers", "clt_tp_runner.py"))
    )
    one = ["ours_1gpu"] + (["peer_crosslayer_coding_1gpu"] if peer_ok else [])
    two = [v for v in _ALL_VARIANTS if v.endswith("2gpu") and not v.startswith("peer")]
    two += ["peer_crosslayer_coding_2gpu"] if peer_ok else []
    if args.variants:
        unknown = sorted(set(args.variants) - set(_ALL_VARIANTS))
        if unknown:
            parser.error(f"unknown --variants {unknown}; choose from {list(_ALL_VARIANTS)}")
        one = [v for v in one if v in args.variants]
        two = [v for v in two if v in args.variants]
    launches = [(w, names) for w, names in [(1, one), (2, two)] if names and (w == 1 or gpus >= 2)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, names in launches:
            try:
                mp.spawn(_worker, args=(world, _free_port(), names, args, tmp), nprocs=world, join=True)
            except Exception as err:  # a crashed launch: its runs without a result get this error
                launch_error = f"{type(err).__name__}: {str(err)[-2000:]}"
            else:
                launch_error = "no result written"
            for n_features, variant in _runs(args, names):
                path = os.path.join(tmp, f"{variant}_{n_features}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        row = json.load(f)
                else:
                    row = {"variant": variant, "features_per_layer": n_features, "world": world}
                    row["error"] = launch_error
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:  # speedup over the 1-GPU run of the same code and size
        base_name = "peer_crosslayer_coding_1gpu" if row["variant"].startswith("peer") else "ours_1gpu"
        base = next(
            (
                r
                for r in rows
                if r["variant"] == base_name and r["features_per_layer"] == row["features_per_layer"]
            ),
            None,
        )
        if base and "tokens_per_s" in base and "tokens_per_s" in row:
            row["speedup_vs_1gpu"] = row["tokens_per_s"] / base["tokens_per_s"]
    out = write_result("clt_scaling", args, rows, gpus=gpus)
    print(
        f"\n{'variant':56} {'F/layer':>8} {'step ms':>9} {'tok/s':>10} {'x 1gpu':>7} {'L0':>7} {'our MB':>8} {'DDP MB':>8}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:56} {r['features_per_layer']:>8} ERROR {r['error'][:80]}")
            continue
        print(
            f"{r['variant']:56} {r['features_per_layer']:>8} {r['step_ms']:9.2f} {r['tokens_per_s']:10.0f} "
            f"{r.get('speedup_vs_1gpu', float('nan')):7.2f} {r.get('active_per_token', float('nan')):7.1f} "
            f"{r.get('collective_bytes_per_step_ours', 0) / 1e6:8.2f} "
            f"{r.get('ddp_grad_allreduce_bytes_per_step', 0) / 1e6:8.1f}"
        )
    _print_phases(rows)
    print(f"wrote {out}")


def _print_phases(rows: list[dict[str, Any]]) -> None:
    """Median GPU ms per phase on rank 0 (and rank 1 below it); ``h``: host time at least 80% of it."""
    names = [
        "lightning", "encode", "select", "gather", "decode", "loss", "loss_reduce", "backward",
        "post_backward", "optimizer", "between_steps",
    ]  # fmt: skip
    print(
        f"\nper-phase GPU ms on rank 0, rank 1 below (h = host time >= 80% of it)\n{'variant':56} {'F/layer':>8} "
        + " ".join(f"{n[:9]:>10}" for n in names)
    )
    for r in rows:
        for key, label in (("phases_rank0", r["variant"]), ("phases_rank1", "  same, rank 1")):
            ph = r.get(key) or {}
            gpu, host = ph.get("gpu_ms", {}), ph.get("host_ms", {})
            if not gpu:
                continue
            cells = []
            for n in names:
                g = gpu.get(n)
                h = host.get(n, 0.0)
                bound = ph.get("clock") == "cuda_events" and g is not None and g > 0.05 and h >= 0.8 * g
                cells.append(f"{'-':>10}" if g is None else f"{g:9.2f}{'h' if bound else ' '}")
            print(f"{label:56} {r['features_per_layer']:>8} " + " ".join(cells))


if __name__ == "__main__":
    main()
