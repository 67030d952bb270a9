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
the 1-GPU run of the same size and scaling efficiency (tokens/s at N / (N x tokens/s at 1)), mean active features per token over the global batch (must be k), bytes moved
by our collectives per step (measured at the Python collectives) plus DDP's gradient all-reduce payload
(computed), and peak memory. ``--profile`` adds, per rank, one profiled step after the timed ones: the split of
its device time into compute kernels, collective kernels only and idle (waiting for the host), host syncs and
the top 10 kernels (``benchmarks/timeline.py``). Each variant runs in fresh processes; one failing variant is recorded and the
others still run.

    python -m benchmarks.clt_scaling            # 2 CUDA GPUs, about 3-4 minutes on H100s (2 launches)
    python -m benchmarks.clt_scaling --smoke    # CPU + gloo, 2 processes, under a minute
    # the scaling run (4 or 8 GPUs): global BatchTopK, decoder sharding with sharded encoders and both on a
    # 2D mesh (decoder groups of --model-parallel ranks) at 1, 2, 4 (8) GPUs, 8192 and 32768 features per
    # layer, the same 4096 tokens per step; writes benchmarks/results/clt_scaling_<max>gpu.json
    python -m benchmarks.clt_scaling --gpus 1 2 4 --deadline-s 200
    python -m benchmarks.clt_scaling --smoke --gpus 1 2 4   # the same on CPU with 4 gloo processes
    # the 4-GPU call (under 6 minutes on H200s): decoder sharding at three sizes (strong scaling, the 4-GPU
    # runs profiled), data parallel with fp32 and bf16 gradient all-reduce at 8192 (strong, and weak: --tokens
    # per GPU, global batch --tokens x GPUs, rows with "scaling": "weak")
    python -m benchmarks.clt_scaling --gpus 1 2 4 --features 8192 16384 32768 --dp-features 8192 --weak \\
        --variants ours_1gpu ours_decoder_sharding_sharded_encoder ours_global_batchtopk \\
        ours_global_batchtopk_bf16grad --profile ours_decoder_sharding_sharded_encoder_4gpu --no-peer \\
        --deadline-s 300 --out $OUT/clt_scaling_4x-nvidia-h200.json
    python -m benchmarks.clt_scaling --smoke --weak --profile --gpus 1 2   # the same options on CPU (gloo)
    # the short re-run (about 1.5 minutes on 2 GPUs): 1 GPU vs sharded encoders at two sizes
    python -m benchmarks.clt_scaling --features 8192 16384 --variants ours_1gpu \\
        ours_decoder_sharding_sharded_encoder_2gpu --out benchmarks/results/clt_scaling_short.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from benchmarks._results import RESULTS, command_line, environment, write_result
from benchmarks.dist_launch import default_gpus, init_group, launch, seconds_left
from benchmarks.timeline import StepProfiler

HERE = os.path.dirname(os.path.abspath(__file__))


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

    def summary(self, warmup: int, steps: int) -> dict[str, dict[str, float]]:
        """Median GPU and host milliseconds per phase over the ``steps`` measured steps after ``warmup``
        (``between_steps``: the interval from one step's last mark to the next step's start)."""
        if not self.enabled or len(self.steps) <= warmup + 1:
            return {}
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        gpu: dict[str, list[float]] = {}
        host: dict[str, list[float]] = {}
        marked = self.steps[warmup : warmup + steps + 1]  # the step after the last one closes its between_steps
        for i, marks in enumerate(marked[:steps]):
            pairs = list(zip(marks[:-1], marks[1:]))
            if i + 1 < len(marked) and marked[i + 1]:
                pairs.append((marks[-1], ("between_steps", *marked[i + 1][0][1:])))
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
            if clt.shard is not None and clt.shard.features is not None:  # feature-sharded encoders
                out = clt(x, dense=False)  # marks encode, select, gather, decode (the spec's phase_hook)
                idx, recon = out.indices, out.recon
            else:
                pre = clt.encode(x)
                phases.mark("encode")
                _, idx, vals = clt.activate(pre)  # the product's selection: local, or exact global over the group
                phases.mark("select")
                recon = clt.decode_sparse(idx, vals, N)
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
    """Step times (batch start to batch start) of the ``steps`` steps after ``warmup``; with ``profiler``, one
    more step after them runs under it (not timed)."""

    def __init__(
        self,
        device_type: str,
        warmup: int,
        steps: int,
        counter: _ByteCounter | None = None,
        phases: _Phases | None = None,
        profiler: StepProfiler | None = None,
    ) -> None:
        import lightning.pytorch as pl

        outer = self
        mark = phases.mark if phases is not None else (lambda name: None)
        profiled = warmup + steps  # the batch index of the profiled step

        class Cb(pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                outer.mark()
                mark("start")
                if profiler is not None and batch_idx == profiled:
                    profiler.start()

            def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
                mark("loss_reduce")  # training_step return -> backward: the strategy's loss all-reduce

            def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
                mark("backward")  # incl. collectives inside autograd and DDP's un-overlapped all-reduce

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                mark("post_backward")  # the strategy's post_backward (e.g. 2D grad all-reduce), clipping

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                mark("optimizer")
                if profiler is not None and batch_idx == profiled:
                    profiler.stop()

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                outer.mark()

        self.callback = Cb()
        self.device_type = device_type
        self.warmup, self.steps = warmup, steps
        self.counter = counter
        self.events: list[Any] = []
        self.bytes: list[int] = []

    def bytes_per_step(self) -> float:
        """Bytes our collectives moved per measured step (setup broadcasts and warm-up excluded)."""
        end = min(len(self.bytes) - 1, self.warmup + self.steps)
        if end <= self.warmup:
            return 0.0
        return (self.bytes[end] - self.bytes[self.warmup]) / (end - self.warmup)

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
        return statistics.median(times[self.warmup : self.warmup + self.steps])


def _run_ours(
    variant: str, rank: int, world: int, args: argparse.Namespace, n_features: int, scaling: str = "strong"
) -> dict[str, Any]:
    """One variant at one size in this process group. ``scaling="weak"`` (data-parallel kinds): every rank
    gets ``args.tokens`` tokens, so the global batch is ``args.tokens * world``."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_opt.strategies import DecoderShardingStrategy, GlobalBatchTopKStrategy

    device_type = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    kind = _kind(variant)
    if scaling == "weak" and kind not in _DP_KINDS:
        raise ValueError(f"weak scaling runs the data-parallel kinds {_DP_KINDS}, not {kind}")
    mp_size = world  # ranks per decoder group (decoder sharding); the data-parallel size is world // mp_size
    dp_tokens = args.tokens if scaling == "weak" else args.tokens // world
    compression = "none"
    if kind in _DP_KINDS:
        if kind == "ours_global_batchtopk_bf16grad":
            # bf16 gradient all-reduce (torch's DDP comm hook): half the bytes, but rounded gradients (not
            # bit-comparable to 1 GPU); fp16 in the CPU smoke run: torch's bf16 hook needs NCCL
            compression = "fp16" if device_type == "cpu" else "bf16"
        # broadcast_buffers=False: DDP would otherwise broadcast rank 0's activation pools (module buffers,
        # hundreds of MB) before every forward, and every rank would train on rank 0's tokens
        strategy: Any = GlobalBatchTopKStrategy(grad_compression=compression, broadcast_buffers=False)
        tokens_per_rank = dp_tokens
    elif kind == "ours_decoder_sharding":
        strategy = DecoderShardingStrategy()
        tokens_per_rank = args.tokens
    elif kind == "ours_decoder_sharding_sharded_encoder":
        strategy = DecoderShardingStrategy(shard_encoder=True)
        tokens_per_rank = args.tokens
    elif kind == _KIND_2D:  # both: data groups of world // M ranks x decoder groups of M (global BatchTopK)
        mp_size = args.model_parallel
        strategy = DecoderShardingStrategy(model_parallel_size=mp_size, shard_encoder=True)
        tokens_per_rank = args.tokens // (world // mp_size)
    elif kind == _AB_KIND:  # A/B: Lightning's own per-step SIGTERM broadcast on the GPU (+ .item())
        strategy = DecoderShardingStrategy(shard_encoder=True, cpu_sigterm_check=False)
        tokens_per_rank = args.tokens
    elif kind == _AB_SYNCED_KIND:  # A/B: the candidate counts read on the host before the pool's gather
        strategy = DecoderShardingStrategy(shard_encoder=True, selection="synced_pool")
        tokens_per_rank = args.tokens
    elif kind == _AB_SELECT_KIND:
        # A/B: the general selection path (tie counts, then a gather of kept entries)
        strategy = DecoderShardingStrategy(shard_encoder=True, selection="general")
        tokens_per_rank = args.tokens
    else:
        strategy, tokens_per_rank = "auto", args.tokens
    # Parameters are created on the device: initialising billions of them on the CPU takes long.
    # every rank records its phases (the same host work on each): rank 1's show where rank 0 waits for it
    phases = _Phases(device_type, enabled=True)
    profiler = StepProfiler(device_type) if _profiled(args, variant) else None
    if hasattr(strategy, "phase_hook"):
        strategy.phase_hook = phases.mark
    with torch.device(f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu"):
        module = _build_module(args, n_features, tokens_per_rank, device_type, phases)
    counter = _ByteCounter() if world > 1 else None
    timer = _StepTimer(device_type, args.warmup, args.steps, counter, phases, profiler)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = pl.Trainer(
        accelerator="gpu" if device_type == "cuda" else "cpu",
        devices=world,
        strategy=strategy,
        precision="bf16-mixed" if device_type == "cuda" else "32-true",
        max_steps=args.warmup + args.steps + (1 if profiler is not None else 0),
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
    step_ms = timer.step_ms()
    n_params = sum(p.numel() for p in module.parameters())
    l0 = module.l0[-1]
    data_parallel = kind in _DP_KINDS
    if world > 1:
        # every rank holds tokens_per_rank tokens (ranks of a decoder group the same ones, with the same
        # count), so the mean over ranks is the global active entries / global tokens
        t = torch.tensor([l0], dtype=torch.float64, device=trainer.strategy.root_device)
        dist.all_reduce(t)
        l0 = float(t) / world
    ours_bytes = timer.bytes_per_step()
    mine = (phases.summary(args.warmup, args.steps), profiler.result if profiler is not None else None)
    per_rank: list[Any] = [mine]
    if world > 1:
        gathered: list[Any] = [None] * world
        try:
            dist.all_gather_object(gathered, mine)
            per_rank = gathered
        except Exception as err:  # diagnostics only: the timing row must survive
            per_rank.append(({"error": f"{type(err).__name__}: {err}"}, None))
    summaries = [p for p, _ in per_rank]
    ddp_bytes = n_params * (2 if compression != "none" else 4) if data_parallel else 0
    sharded = kind.startswith("ours_decoder") or kind == _KIND_2D
    tokens_per_step = tokens_per_rank * (world // mp_size if sharded else world if data_parallel else 1)
    return {
        "strategy": kind,
        "model_parallel_size": mp_size if sharded else 1,
        "data_parallel_size": world // mp_size if sharded else world,
        "grad_allreduce_bytes_per_step_2d": getattr(trainer.strategy, "grad_bytes_per_step", 0),
        "variant": variant,
        "features_per_layer": n_features,
        "world": world,
        "scaling": scaling,
        "grad_compression": compression if data_parallel else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_rank": tokens_per_rank,
        "note": "collective_bytes_per_step_ours includes the 16-bit hook's all-reduce (a Python-level call)"
        if compression != "none"
        else "",
        "phases_rank0": summaries[0],
        **({"phases_rank1": summaries[1]} if world > 1 else {}),
        **({"profile": [p for _, p in per_rank]} if profiler is not None else {}),
        "step_ms": step_ms,
        "tokens_per_s": tokens_per_step / (step_ms / 1e3),
        "active_per_token": l0,
        "l0_is_k": abs(l0 - args.k) < 1e-6,  # BatchTopK keeps k * tokens entries of the global batch
        "collective_bytes_per_step_ours": ours_bytes,
        # the bf16 hook's all-reduce is a Python-level call: already in ours_bytes
        "bytes_per_step_total": ours_bytes + (0 if compression != "none" else ddp_bytes),
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
    res.update(variant=f"peer_crosslayer_coding_{world}gpu", features_per_layer=n_features, world=world,
               scaling="strong")
    res.setdefault("tokens_per_step", args.tokens)
    if "step_ms" in res:
        res["tokens_per_s"] = args.tokens / (res["step_ms"] / 1e3)
    return res


_AB_KIND = "ours_decoder_sharding_sharded_encoder_gpu_sigterm"
_AB_SELECT_KIND = "ours_decoder_sharding_sharded_encoder_general_select"
# A/B: the pool selection with the synced candidate step (a host sync before the gather) instead of the padded one
_AB_SYNCED_KIND = "ours_decoder_sharding_sharded_encoder_synced_pool"
# DecoderShardingStrategy(model_parallel_size=M, shard_encoder=True) with D = N / M > 1 data groups
_KIND_2D = "ours_2d_sharded_encoder"
_AB_VARIANT = f"{_AB_KIND}_2gpu"
_AB_SELECT = f"{_AB_SELECT_KIND}_2gpu"
_AB_SYNCED = f"{_AB_SYNCED_KIND}_2gpu"
# The 1-vs-2 comparison (the default with 2 GPUs): every variant, the A/Bs included.
_ALL_VARIANTS = (
    "ours_1gpu",
    "peer_crosslayer_coding_1gpu",
    "ours_global_batchtopk_2gpu",
    "ours_global_batchtopk_bf16grad_2gpu",
    "ours_decoder_sharding_2gpu",
    "ours_decoder_sharding_sharded_encoder_2gpu",
    _AB_VARIANT,
    _AB_SELECT,
    _AB_SYNCED,
    "peer_crosslayer_coding_2gpu",
)
# Every strategy a variant name can carry (the name is ``<kind>_<N>gpu``).
_KINDS = (
    "ours", "peer_crosslayer_coding", "ours_global_batchtopk", "ours_global_batchtopk_bf16grad",
    "ours_decoder_sharding", "ours_decoder_sharding_sharded_encoder", _AB_KIND, _AB_SELECT_KIND, _AB_SYNCED_KIND,
    _KIND_2D,
)  # fmt: skip
# The scaling run (any --gpus other than 1 2): the three strategies of the scaling question at every size.
_SCALING_KINDS = ("ours_global_batchtopk", "ours_decoder_sharding_sharded_encoder", _KIND_2D)
# Kinds whose ranks split the batch (plain data parallelism): they also run at --dp-features only, and weakly
# (--tokens per GPU) with --weak.
_DP_KINDS = ("ours_global_batchtopk", "ours_global_batchtopk_bf16grad")


def _profiled(args: argparse.Namespace, variant: str) -> bool:
    """Whether ``--profile`` asks for this variant (no names: every variant)."""
    if args.profile is None:
        return False
    return not args.profile or variant in args.profile or _kind(variant) in args.profile


def _kind(variant: str) -> str:
    """``ours_global_batchtopk_4gpu`` -> ``ours_global_batchtopk``."""
    head, _, tail = variant.rpartition("_")
    return head if tail.endswith("gpu") and tail[:-3].isdigit() else variant


def _variants_for(world: int, args: argparse.Namespace, peer_ok: bool, scaling: bool) -> list[str]:
    """Variant names of one launch of ``world`` processes (``--variants`` takes names or kinds)."""
    if world == 1:  # in a scaling run the peer only runs when asked for (--variants): time
        kinds = ["ours"] + (["peer_crosslayer_coding"] if peer_ok and (not scaling or args.variants) else [])
    elif not scaling and world == 2:
        kinds = [_kind(v) for v in _ALL_VARIANTS if v.endswith("2gpu") and not v.startswith("peer")]
        kinds += ["peer_crosslayer_coding"] if peer_ok else []
    else:
        # the three strategies; with --variants any kind (the A/Bs, the peer) at every size it names
        kinds = [k for k in _KINDS if k != "ours"] if args.variants else list(_SCALING_KINDS)
        kinds = [k for k in kinds if peer_ok or not k.startswith("peer")]
    names = []
    for kind in kinds:
        if kind == _KIND_2D and (world % args.model_parallel or world // args.model_parallel < 2):
            continue  # the 2D mesh needs at least 2 data groups of model_parallel ranks
        name = f"{kind}_{world}gpu"
        if args.variants and name not in args.variants and kind not in args.variants:
            continue
        names.append(name)
    return names


def _runs(args: argparse.Namespace, variants: list[str]) -> list[tuple[int, str, str]]:
    """(features per layer, variant, scaling) in run order; the peer only at ``--peer-features`` (it is slow),
    the data-parallel kinds at ``--dp-features`` (strong, then weak with ``--weak``; not at 1 GPU, whose
    ``ours_1gpu`` row is the baseline of both), the A/Bs only at the smallest size (where fixed per-step
    costs weigh most)."""
    runs = []
    for f in args.features:
        for v in variants:
            kind = _kind(v)
            if v.startswith("peer") and f not in args.peer_features:
                continue
            if kind in (_AB_KIND, _AB_SELECT_KIND, _AB_SYNCED_KIND) and f != args.features[0]:
                continue
            if kind in _DP_KINDS and args.dp_features and f not in args.dp_features:
                continue
            runs.append((f, v, "strong"))
            if args.weak and kind in _DP_KINDS:
                runs.append((f, v, "weak"))
    return runs


def _result_name(variant: str, n_features: int, scaling: str) -> str:
    return f"{variant}_{n_features}{'_weak' if scaling == 'weak' else ''}.json"


def _worker(
    rank: int, world: int, port: int, variants: list[str], args: argparse.Namespace, out_dir: str
) -> None:
    """Run every size x variant one after the other in these processes (start-up is paid once).

    Rank 0 writes one JSON per run.
    """
    import gc

    import torch.distributed as dist

    use_cuda = init_group(rank, world, port, args.smoke, timeout_s=120)
    for n_features, variant, scaling in _runs(args, variants):
        path = os.path.join(out_dir, _result_name(variant, n_features, scaling))
        head = {"variant": variant, "features_per_layer": n_features, "world": world, "scaling": scaling}
        left = seconds_left(args.end_unix)  # the same decision on every rank
        if left < args.need_s:
            if rank == 0:
                with open(path, "w") as f:
                    json.dump({**head, "skipped": f"time budget: {left:.0f}s left, needs ~{args.need_s:.0f}s"}, f)
            continue
        started = time.perf_counter()
        try:
            if variant.startswith("peer"):
                result = _run_peer(rank, world, args, n_features)
            else:
                result = _run_ours(variant, rank, world, args, n_features, scaling)
        except Exception as err:  # recorded; the other variants still run
            result = {**head, "error": f"{type(err).__name__}: {err}"}
            result["traceback"] = traceback.format_exc(limit=6)
        result["run_s"] = time.perf_counter() - started  # set-up, warm-up and timed steps (plans time budgets)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(result, f)
        gc.collect()
        if use_cuda:
            torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """Speed-up and scaling efficiency of every row over the 1-GPU row of the same code and size.

    Efficiency at N GPUs = tokens/s at N / (N x tokens/s at 1), both measured in this run; the same formula
    for weak rows (N x the tokens per step at N GPUs: ideal tokens/s is N x the 1-GPU figure either way).
    """
    for row in rows:
        base_name = "peer_crosslayer_coding_1gpu" if row["variant"].startswith("peer") else "ours_1gpu"
        base = next(
            (
                r
                for r in rows
                if r["variant"] == base_name and r["features_per_layer"] == row["features_per_layer"]
            ),
            None,
        )
        if base and base.get("tokens_per_s") and row.get("tokens_per_s"):
            row["speedup_vs_1gpu"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["scaling_efficiency"] = row["speedup_vs_1gpu"] / row["world"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny CLT on CPU with gloo processes")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/clt_scaling.json)")
    parser.add_argument(
        "--gpus", type=int, nargs="+", default=None,
        help="process-group sizes to run, e.g. 1 2 4 8 (default: 1 and every power of two up to the GPU "
        "count; --smoke: 1 2). Other than '1 2' this is the scaling run: the three strategies at every size",
    )  # fmt: skip
    parser.add_argument(
        "--features",
        type=int,
        nargs="+",
        default=None,
        help="features per layer (default 8192 16384 32768; scaling run: 8192 32768)",
    )
    parser.add_argument(
        "--tokens", type=int, default=4096,
        help="tokens per optimizer step (all GPUs); with --weak also the tokens per GPU of the weak rows",
    )  # fmt: skip
    parser.add_argument(
        "--weak", action="store_true",
        help="also run every data-parallel kind (ours_global_batchtopk, ..._bf16grad) with --tokens tokens per "
        "GPU (global batch --tokens x GPUs); those rows carry scaling='weak' beside the strong ones",
    )  # fmt: skip
    parser.add_argument(
        "--dp-features", type=int, nargs="+", default=None,
        help="sizes at which the data-parallel kinds run (default: every --features size)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", nargs="*", default=None, metavar="NAME",
        help="after the timed steps, one more step per run under torch.profiler: per rank the split into compute "
        "kernels, collective kernels and device idle time, host syncs and the top 10 kernels (in the row's "
        "'profile'); names (variants or kinds) pick the runs, none: every run",
    )  # fmt: skip
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument(
        "--model-parallel",
        type=int,
        default=2,
        help="decoder-group size M of the 2D (data x model) variant; it runs where N/M >= 2",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip crosslayer-coding")
    parser.add_argument(
        "--variants", nargs="+", default=None, metavar="NAME",
        help=f"run only these variants (default: all): {', '.join(_ALL_VARIANTS)}, or kinds at every size: "
        f"{', '.join(_KINDS)}; keep ours_1gpu for the same-run baseline of the ratios",
    )  # fmt: skip
    parser.add_argument(
        "--peer-features", type=int, nargs="+", default=[8192, 16384],
        help="sizes at which crosslayer-coding runs (its 32768 run alone takes about a minute)",
    )  # fmt: skip
    parser.add_argument("--deadline-s", type=float, default=None, help="time budget of the whole call")
    parser.add_argument(
        "--end-unix", type=float, default=None, help="absolute end time (overrides --deadline-s)"
    )
    parser.add_argument(
        "--need-s", type=float, default=15.0, help="a run starts only with this much time left"
    )
    parser.add_argument(
        "--grace-s", type=float, default=20.0, help="a launch is killed this long after the end"
    )
    args = parser.parse_args()
    if args.end_unix is None and args.deadline_s is not None:
        args.end_unix = time.time() + args.deadline_s
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.smoke else 0
    if args.gpus is None:
        args.gpus = [1, 2] if args.smoke else default_gpus(gpus)
    bad = [w for w in args.gpus if w < 1 or (not args.smoke and w > max(gpus, 1))]
    if bad or len(set(args.gpus)) != len(args.gpus):
        parser.error(f"--gpus {args.gpus}: sizes must be distinct, >= 1 and at most the {gpus} GPUs present")
    args.gpus = sorted(args.gpus)
    scaling = args.gpus not in ([1, 2], [1], [2])
    if args.smoke:
        args.features = args.features or ([64, 128] if not scaling else [64])
        args.tokens, args.k, args.layers, args.d_model = 64, 4, 3, 16
        args.peer_features = [64, 128]
        args.dp_features = [f for f in args.features if not args.dp_features or f in args.dp_features] or None
        args.steps, args.warmup = 2, 1
    elif args.features is None:
        args.features = [8192, 32768] if scaling else [8192, 16384, 32768]
    known = set(_KINDS) | set(_ALL_VARIANTS)
    for flag, names in (("--variants", args.variants), ("--profile", args.profile)):
        unknown = sorted(v for v in names or [] if v not in known and _kind(v) not in _KINDS)
        if unknown:
            parser.error(f"unknown {flag} {unknown}; choose from {list(_ALL_VARIANTS)} or {list(_KINDS)}")
    if args.smoke:  # imported once here, inherited by the forked processes
        import lightning.pytorch  # noqa: F401

        import lightning_opt.models.clt  # noqa: F401
        import lightning_opt.strategies  # noqa: F401
    peer_ok = (
        not args.no_peer
        and os.path.isdir(os.path.join(HERE, "..", ".peers", "crosslayer-coding"))
        and os.path.exists(os.path.join(HERE, "peers", "clt_tp_runner.py"))
    )
    # 1 GPU first (the baseline of the ratios), then the largest sizes (the point of a scaling run) while the
    # time budget is fresh
    order = args.gpus[:1] + sorted(args.gpus[1:], reverse=True)
    launches = [(w, _variants_for(w, args, peer_ok, scaling)) for w in order]
    launches = [(w, names) for w, names in launches if names]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, names in launches:
            left = args.end_unix - time.time() if args.end_unix else float("inf")
            if left < args.need_s + 10:  # process start-up on top of one run
                launch_error = f"skipped: time budget ({left:.0f}s left)"
            else:
                launch_error = launch(_worker, (names, args, tmp), world, args.smoke, args.end_unix, args.grace_s)
            for n_features, variant, mode in _runs(args, names):
                path = os.path.join(tmp, _result_name(variant, n_features, mode))
                if os.path.exists(path):
                    with open(path) as f:
                        row = json.load(f)
                else:
                    row = {"variant": variant, "features_per_layer": n_features, "world": world, "scaling": mode}
                    row["skipped" if launch_error.startswith("skipped") else "error"] = launch_error
                rows.append(row)
                print(json.dumps(row), flush=True)
    add_scaling(rows)
    if args.out is None and not args.smoke and max(args.gpus) > 2:
        args.out = os.path.join(HERE, "results", f"clt_scaling_{max(args.gpus)}gpu.json")
    out = args.out or str(RESULTS / f"clt_scaling{'_smoke' if args.smoke else ''}.json")
    on_gpu = torch.cuda.is_available() and not args.smoke
    write_result(out, benchmark="clt_scaling", env=environment(on_gpu, gpus=gpus), command=command_line(),
                 baseline=None, results={"config": {k: v for k, v in vars(args).items() if k != "out"},
                                         "sizes": args.gpus, "scaling_run": scaling, "rows": rows})
    print(
        f"\n{'variant':56} {'F/layer':>8} {'step ms':>9} {'tok/s':>10} {'x 1gpu':>7} {'eff':>6} {'L0':>7} "
        f"{'our MB':>8} {'DDP MB':>8}"
    )
    for r in rows:
        label = _label(r)
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            print(f"{label:56} {r['features_per_layer']:>8} {'ERROR' if 'error' in r else 'SKIPPED'} {why[:80]}")
            continue
        print(
            f"{label:56} {r['features_per_layer']:>8} {r['step_ms']:9.2f} {r['tokens_per_s']:10.0f} "
            f"{r.get('speedup_vs_1gpu', float('nan')):7.2f} {r.get('scaling_efficiency', float('nan')):6.2f} "
            f"{r.get('active_per_token', float('nan')):7.1f} "
            f"{r.get('collective_bytes_per_step_ours', 0) / 1e6:8.2f} "
            f"{r.get('ddp_grad_allreduce_bytes_per_step', 0) / 1e6:8.1f}"
        )
    _print_phases(rows)
    _print_profiles(rows)
    print(f"wrote {out}")


def _label(row: dict[str, Any]) -> str:
    return f"{row['variant']} (weak)" if row.get("scaling") == "weak" else row["variant"]


def _print_profiles(rows: list[dict[str, Any]]) -> None:
    """The profiled step of each rank: where its window went, host syncs and the three largest kernels."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return
    print(f"\nprofiled step (ms; one step after the timed ones)\n{'variant / rank':60} {'F/layer':>8} {'window':>8} "
          f"{'compute':>8} {'coll.only':>9} {'idle':>8} {'coll.all':>8} {'syncs':>6}  top kernels")
    for r in profiled:
        for rank, p in enumerate(r["profile"]):
            if not p:
                continue
            top = "; ".join(f"{k['name'][:40]} {k['ms']:.2f}" for k in p["top_kernels"][:3])
            print(
                f"{_label(r) + f' / {rank}':60} {r['features_per_layer']:>8} {p['window_ms']:8.2f} {p['compute_ms']:8.2f} "
                f"{p['collective_only_ms']:9.2f} {p['idle_ms']:8.2f} {p['collective_ms']:8.2f} {p['host_syncs']:>6}  {top}"
            )


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
        for key, label in (("phases_rank0", _label(r)), ("phases_rank1", "  same, rank 1")):
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
