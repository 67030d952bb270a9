"""Step-time overhead of the six lightning_opt callbacks vs none vs Lightning's ThroughputMonitor.

GPT-2 124M (lightning_opt.models.gpt2), bf16-mixed, batch 16x1024, random tokens, fused AdamW,
real Trainer, no compile. Every variant runs in this one process on the same GPU; step time is
the median interval between CUDA events recorded at each batch start (no per-step sync of ours),
over ``--steps`` steps after ``--warmup``. Variants run in two rounds (ABC ABC) and the median of
the rounds is reported, to even out clock/thermal drift.

Also checks that the six callbacks issue no host-device sync inside the step
(``torch.cuda.set_sync_debug_mode("error")`` from batch start to the end of the optimizer step).

    python benchmarks/callbacks_overhead.py            # CUDA, ~2 min on an H100
    python benchmarks/callbacks_overhead.py --smoke    # CPU, seconds (checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import lightning
import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_opt.callbacks import (  # noqa: E402
    AsyncCheckpoint,
    CudaMemoryHygiene,
    EvalThrottle,
    LossClamp,
    NaNSkip,
    SpeedMonitor,
)
from lightning_opt.models.gpt2 import GPT, GPTConfig  # noqa: E402


def gpt_config(smoke: bool) -> GPTConfig:
    if smoke:
        return GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=64, block_size=32)
    return GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024)


class BenchModule(pl.LightningModule):
    """GPT-2 with fused AdamW and a per-step LR schedule; ``flops_per_batch`` set (6 N tokens)."""

    def __init__(self, cfg: GPTConfig, batch_size: int) -> None:
        super().__init__()
        self.model = GPT(cfg)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.flops_per_batch = 6 * n_params * batch_size * cfg.block_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(x, y)

    def configure_optimizers(self) -> Any:
        fused = torch.cuda.is_available()
        opt = torch.optim.AdamW(self.parameters(), lr=6e-4, weight_decay=0.1, fused=fused or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RandomTokens:
    """A fixed pool of random token batches, cycled (host memory, pinned on CUDA)."""

    def __init__(self, n_batches: int, batch_size: int, seq: int, vocab: int, pool: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        pin = torch.cuda.is_available()
        self.pool = []
        for _ in range(pool):
            t = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
            x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            self.pool.append((x.pin_memory(), y.pin_memory()) if pin else (x, y))
        self.n = n_batches

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield self.pool[i % len(self.pool)]


class StepTimer(pl.Callback):
    """CUDA events at each batch start; intervals read after fit (no per-step sync)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.events: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
        else:
            self.events.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            torch.cuda.synchronize()
        else:
            self.events.append(time.perf_counter())

    def step_ms(self, warmup: int) -> list[float]:
        ev = self.events[warmup:]
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(ev, ev[1:])]
        return [(b - a) * 1e3 for a, b in zip(ev, ev[1:])]


class SyncGuard(pl.Callback):
    """``set_sync_debug_mode("error")`` from batch start to this callback's batch-end hook.

    It is last in the callback list, so the other callbacks' batch-end hooks are inside the
    window too. Log steps (every ``log_every`` steps) are left out: reading counters there is
    allowed by design.
    """

    def __init__(self, after: int, log_every: int = 10) -> None:
        self.after, self.log_every = after, log_every
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.after and (trainer.global_step + 1) % self.log_every != 0:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.get_sync_debug_mode() != 0:
            torch.cuda.set_sync_debug_mode("default")
            self.checked += 1

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode("default")


def six_callbacks(tmpdir: str) -> list[pl.Callback]:
    return [
        NaNSkip(),
        LossClamp(),
        # No save inside the window (checkpoint_stall.py measures saves); no one-off buffer prewarm.
        AsyncCheckpoint(
            dirpath=os.path.join(tmpdir, "ck"),
            every_n_steps=10**9,
            save_on_train_end=False,
            save_on_exception=False,
            prewarm=False,
        ),
        EvalThrottle(every_n_steps=10**9),
        CudaMemoryHygiene(gc_every_n_steps=25),
        SpeedMonitor(log_every_n_steps=10),
    ]


def throughput_monitor() -> list[pl.Callback]:
    from lightning.pytorch.callbacks import ThroughputMonitor

    return [ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel())]


def run_variant(
    name: str,
    callbacks: list[pl.Callback],
    args: argparse.Namespace,
    tmpdir: str,
    extra: list[pl.Callback] = (),
) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    cfg = gpt_config(args.smoke)
    torch.manual_seed(0)
    module = BenchModule(cfg, args.batch_size)
    timer = StepTimer(cuda)
    n = args.warmup + args.steps
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=n,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=pl.loggers.CSVLogger(os.path.join(tmpdir, "logs"), name=name),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.Checkpoint) for c in callbacks),
        callbacks=[*callbacks, *extra, timer],
    )
    trainer.fit(
        module, train_dataloaders=RandomTokens(n + 1, args.batch_size, cfg.block_size, cfg.vocab_size)
    )
    ms = timer.step_ms(args.warmup)
    out: dict[str, Any] = {
        "median_step_ms": statistics.median(ms),
        "mean_step_ms": statistics.fmean(ms),
        "steps": len(ms),
    }
    speed = next((c for c in callbacks if isinstance(c, SpeedMonitor)), None)
    if speed is not None:
        out["speed_monitor_metrics"] = speed.metrics
    del trainer, module
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "callbacks_overhead.json"
        ),
    )
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.batch_size, args.rounds = 6, 2, 2, 1
        if args.out.endswith("callbacks_overhead.json"):
            args.out = args.out.replace(".json", "_smoke.json")
    elif not torch.cuda.is_available():
        sys.exit("callbacks_overhead: needs a CUDA GPU (or pass --smoke)")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True

    variants = {
        "none": lambda d: [],
        "ours_all6": six_callbacks,
        "lightning_throughput_monitor": lambda d: throughput_monitor(),
        "ours_all6_nanskip_host_mode": lambda d: [NaNSkip(mode="host"), *six_callbacks(d)[1:]],
    }
    results: dict[str, Any] = {name: {"rounds": []} for name in variants}
    with tempfile.TemporaryDirectory() as tmpdir:
        for _ in range(args.rounds):
            for name, make in variants.items():
                try:
                    results[name]["rounds"].append(run_variant(name, make(tmpdir), args, tmpdir))
                except Exception as err:  # one failing variant must not kill the others
                    results[name].setdefault("errors", []).append(
                        f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
                    )
        sync_check: dict[str, Any] = {}
        if torch.cuda.is_available():
            # "none" is the control: a sync there comes from Lightning or the model, not from us.
            for name, make in (("none", lambda d: []), ("ours_all6", six_callbacks)):
                guard = SyncGuard(after=args.warmup)
                try:
                    run_variant("sync_check", make(tmpdir), args, tmpdir, extra=[guard])
                    sync_check[name] = {"ok": True, "steps_checked": guard.checked}
                except Exception as err:
                    torch.cuda.set_sync_debug_mode("default")
                    sync_check[name] = {
                        "ok": False,
                        "error": f"{type(err).__name__}: {err}",
                        "trace": traceback.format_exc()[-3000:],
                    }

    base = None
    for name, r in results.items():
        meds = [x["median_step_ms"] for x in r["rounds"]]
        if meds:
            r["median_step_ms"] = statistics.median(meds)
        if name == "none":
            base = r.get("median_step_ms")
    for r in results.values():
        if base and "median_step_ms" in r:
            r["overhead_vs_none"] = r["median_step_ms"] / base - 1
    report = {
        "benchmark": "callbacks_overhead",
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "command": " ".join([sys.executable, *sys.argv]),
        "config": {
            "model": "GPT-2 124M" if not args.smoke else "tiny (smoke)",
            "batch": f"{args.batch_size}x{gpt_config(args.smoke).block_size}",
            "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "compile": False,
        },
        "baseline": "none",
        "results": results,
        "no_sync_check": sync_check,
        "target": "ours_all6 overhead_vs_none <= 0.01",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"\n{'variant':32s} {'median step ms':>15s} {'overhead':>10s}")
    for name, r in results.items():
        ms = r.get("median_step_ms")
        ov = r.get("overhead_vs_none")
        print(
            f"{name:32s} {ms if ms is None else f'{ms:15.2f}':>15} {'' if ov is None else f'{ov * 100:+9.2f}%':>10}"
            + ("  ERROR" if r.get("errors") else "")
        )
    for name, r in sync_check.items():
        print(
            f"no-sync check, {name} (set_sync_debug_mode('error') inside non-log steps): "
            f"{'ok' if r['ok'] else 'FAILED ' + r['error'][:200]}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
