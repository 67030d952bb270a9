"""Step-time overhead of the six lightning_opt callbacks, alone and together, vs none.

GPT-2 124M (lightning_opt.models.gpt2), bf16-mixed, batch 16x1024, random tokens, fused AdamW
with a per-step LR schedule, real Trainer, no compile. Every variant runs in this one process on
the same GPU and the same model (built once; each run gets a fresh Trainer and optimizer). Step
time is the interval between CUDA events recorded at each batch start (no per-step sync of
ours), over ``--steps`` steps after ``--warmup``.

Variants: ``none`` (the baseline), each callback alone (``nanskip``, ``lossclamp``,
``asyncckpt``, ``evalthrottle``, ``cudamem``, ``speedmon``), ``all6``, Lightning's
``ThroughputMonitor`` and ``all6`` with NaNSkip's host mode. Rounds are interleaved, in
alternating order (A B C ... C B A ...), so clock/thermal drift does not favour one variant;
each variant's overhead is the median over rounds of its ratio to ``none`` in the same round.

A no-sync check runs ``none`` and ``all6`` once more with (1) ``set_sync_debug_mode("error")``
over each non-log step and (2) every host wait on a CUDA event, stream or device counted by
phase: a wait before the step's backward is queued drains the device queue (fails the check);
one after it leaves the device a whole backward of work (allowed, counted).

    python benchmarks/callbacks_overhead.py                          # CUDA, ~3 min on an H100
    python benchmarks/callbacks_overhead.py --variants none,nanskip,all6 --rounds 6
    python benchmarks/callbacks_overhead.py --smoke                  # CPU, seconds
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
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from result_header import result_header  # noqa: E402

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


class SyncGuard:
    """Finds host-device syncs inside non-log training steps (after ``after`` batches).

    ``opener`` goes first in the callback list and ``closer`` last, so every other callback's
    batch hooks are inside the window. Inside it, ``set_sync_debug_mode("error")`` raises on
    blocking copies and ``.item()``; host waits on CUDA events, streams and the device, which that
    mode does not see, are counted: ``bubbles`` before the step's backward is queued (the device
    queue runs dry: a sync in effect), ``queued_waits`` after it (the device has the backward to
    run meanwhile). Log steps (every ``log_every`` steps) are left out: reads are allowed there.
    """

    def __init__(self, after: int, log_every: int = 10) -> None:
        self.after, self.log_every = after, log_every
        self.checked = 0
        self.active = False
        self.backward_queued = False
        self.bubbles: list[str] = []
        self.queued_waits = 0
        self._orig: list[tuple[Any, str, Any]] = []
        guard = self

        class Opener(pl.Callback):
            def on_train_start(self, trainer, pl_module):
                guard._patch()

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx >= guard.after and (trainer.global_step + 1) % guard.log_every != 0:
                    guard.active, guard.backward_queued = True, False
                    torch.cuda.set_sync_debug_mode("error")

            def on_after_backward(self, trainer, pl_module):
                guard.backward_queued = True

            def on_train_end(self, trainer, pl_module):
                guard._close()
                guard._unpatch()

            def on_exception(self, trainer, pl_module, exception):
                guard._close()
                guard._unpatch()

        class Closer(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if guard.active:
                    guard.checked += 1
                guard._close()

        self.opener, self.closer = Opener(), Closer()

    def _close(self) -> None:
        self.active = False
        torch.cuda.set_sync_debug_mode("default")

    def _wrap(self, owner: Any, name: str) -> None:
        orig = getattr(owner, name)
        guard = self

        def wait(*args: Any, **kwargs: Any) -> Any:
            if guard.active:
                if guard.backward_queued:
                    guard.queued_waits += 1
                else:
                    guard.bubbles.append(
                        f"{owner.__name__}.{name}:\n" + "".join(traceback.format_stack(limit=6)[:-1])
                    )
            return orig(*args, **kwargs)

        self._orig.append((owner, name, orig))
        setattr(owner, name, wait)

    def _patch(self) -> None:
        if not self._orig:
            self._wrap(torch.cuda.Event, "synchronize")
            self._wrap(torch.cuda.Stream, "synchronize")
            self._wrap(torch.cuda, "synchronize")

    def _unpatch(self) -> None:
        for owner, name, orig in reversed(self._orig):
            setattr(owner, name, orig)
        self._orig = []


def six_callbacks(tmpdir: str) -> list[pl.Callback]:
    return [make(tmpdir) for make in SINGLES.values()]


SINGLES: dict[str, Callable[[str], pl.Callback]] = {
    "nanskip": lambda d: NaNSkip(),
    "lossclamp": lambda d: LossClamp(),
    # No save inside the window (checkpoint_stall.py measures saves); no one-off buffer prewarm.
    "asyncckpt": lambda d: AsyncCheckpoint(
        dirpath=os.path.join(d, "ck"),
        every_n_steps=10**9,
        save_on_train_end=False,
        save_on_exception=False,
        prewarm=False,
    ),
    "evalthrottle": lambda d: EvalThrottle(every_n_steps=10**9),
    "cudamem": lambda d: CudaMemoryHygiene(gc_every_n_steps=25),
    "speedmon": lambda d: SpeedMonitor(log_every_n_steps=10),
}


def throughput_monitor() -> list[pl.Callback]:
    from lightning.pytorch.callbacks import ThroughputMonitor

    return [ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel())]


VARIANTS: dict[str, Callable[[str], list[pl.Callback]]] = {
    "none": lambda d: [],
    **{name: (lambda d, make=make: [make(d)]) for name, make in SINGLES.items()},
    "all6": six_callbacks,
    "lightning_throughput_monitor": lambda d: throughput_monitor(),
    "all6_nanskip_host_mode": lambda d: [NaNSkip(mode="host"), *six_callbacks(d)[1:]],
}


def run_variant(
    name: str,
    module: pl.LightningModule,
    callbacks: list[pl.Callback],
    args: argparse.Namespace,
    tmpdir: str,
    first: list[pl.Callback] = (),
    last: list[pl.Callback] = (),
) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    cfg = gpt_config(args.smoke)
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
        callbacks=[timer, *first, *callbacks, *last],
    )
    trainer.fit(
        module, train_dataloaders=RandomTokens(n + 1, args.batch_size, cfg.block_size, cfg.vocab_size)
    )
    ms = timer.step_ms(args.warmup)
    out: dict[str, Any] = {
        "median_step_ms": statistics.median(ms),
        "mean_step_ms": statistics.fmean(ms),
        "steps": len(ms),
        "step_ms": [round(x, 4) for x in ms],
    }
    for c in callbacks:
        if isinstance(c, SpeedMonitor):
            out["speed_monitor_metrics"] = c.metrics
        if isinstance(c, NaNSkip):
            out["nan_skip"] = {"skipped": c.skipped_total, "host_waits": c.host_waits, "steps": c.steps_seen}
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def summarize(results: dict[str, Any]) -> None:
    """Per variant: median of round medians, spread, and the paired per-round ratio to ``none``."""
    base_rounds = results.get("none", {}).get("rounds", [])
    for r in results.values():
        rounds = r["rounds"]
        if not rounds:
            continue
        meds = [x["median_step_ms"] for x in rounds]
        pooled = [t for x in rounds for t in x["step_ms"]]
        r["median_step_ms"] = statistics.median(meds)
        r["mean_step_ms"] = statistics.fmean(pooled)
        r["round_medians_ms"] = meds
        r["spread_ms"] = {
            "round_median_min": min(meds),
            "round_median_max": max(meds),
            "pooled_p25": quantile(pooled, 0.25),
            "pooled_p75": quantile(pooled, 0.75),
        }
        pairs = [
            (x["median_step_ms"], b["median_step_ms"], x["mean_step_ms"], b["mean_step_ms"])
            for x, b in zip(rounds, base_rounds)
            if x.get("round") == b.get("round")
        ]
        if pairs:
            ratios = [a / b - 1 for a, b, _, _ in pairs]
            r["overhead_vs_none"] = statistics.median(ratios)
            r["overhead_vs_none_rounds"] = ratios
            r["overhead_vs_none_mean_based"] = statistics.median([a / b - 1 for _, _, a, b in pairs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} ('none' is always run: the baseline)",
    )
    p.add_argument("--no-sync-check", action="store_true", help="skip the no-sync check runs")
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "callbacks_overhead.json"
        ),
    )
    args = p.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    chosen = ["none", *[v for v in chosen if v != "none"]]
    if args.smoke:
        args.steps, args.warmup, args.batch_size = 6, 2, 2
        args.rounds = min(args.rounds, 2)
        if args.out.endswith("callbacks_overhead.json"):
            args.out = args.out.replace(".json", "_smoke.json")
    elif not torch.cuda.is_available():
        sys.exit("callbacks_overhead: needs a CUDA GPU (or pass --smoke)")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True

    cfg = gpt_config(args.smoke)
    torch.manual_seed(0)
    module = BenchModule(cfg, args.batch_size)  # one model for every run: no rebuild per variant
    t_start = time.perf_counter()
    results: dict[str, Any] = {name: {"rounds": []} for name in chosen}
    with tempfile.TemporaryDirectory() as tmpdir:
        # Untimed run first: CUDA context, cuBLAS handles and kernels' first launches land here.
        run_variant("prewarm", module, [], args, tmpdir)
        for rnd in range(args.rounds):
            order = chosen if rnd % 2 == 0 else chosen[::-1]  # A B C, C B A: linear drift cancels
            for name in order:
                try:
                    out = run_variant(name, module, VARIANTS[name](tmpdir), args, tmpdir)
                    out["round"] = rnd
                    results[name]["rounds"].append(out)
                except Exception as err:  # one failing variant must not kill the others
                    if torch.cuda.is_available():
                        torch.cuda.set_sync_debug_mode("default")
                    results[name].setdefault("errors", []).append(
                        f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
                    )
            print(f"round {rnd + 1}/{args.rounds} done at {time.perf_counter() - t_start:.0f} s", flush=True)
        sync_check: dict[str, Any] = {}
        if torch.cuda.is_available() and not args.no_sync_check:
            # "none" is the control: a sync there comes from Lightning or the model, not from us.
            for name in ("none", "all6"):
                guard = SyncGuard(after=args.warmup)
                cbs = VARIANTS[name](tmpdir)
                try:
                    out = run_variant(
                        "sync_check", module, cbs, args, tmpdir, first=[guard.opener], last=[guard.closer]
                    )
                    sync_check[name] = {
                        "ok": not guard.bubbles,
                        "steps_checked": guard.checked,
                        "bubbles": guard.bubbles[:5],
                        "n_bubbles": len(guard.bubbles),
                        "waits_after_backward_queued": guard.queued_waits,
                        "nan_skip": out.get("nan_skip"),
                    }
                except Exception as err:
                    torch.cuda.set_sync_debug_mode("default")
                    guard._unpatch()
                    sync_check[name] = {
                        "ok": False,
                        "error": f"{type(err).__name__}: {err}",
                        "trace": traceback.format_exc()[-3000:],
                    }
    summarize(results)
    wall = time.perf_counter() - t_start
    attribution = {
        name: {
            "median_step_ms": r["median_step_ms"],
            "overhead_vs_none": r["overhead_vs_none"],
            "overhead_range_over_rounds": [
                min(r["overhead_vs_none_rounds"]),
                max(r["overhead_vs_none_rounds"]),
            ],
        }
        for name, r in results.items()
        if "overhead_vs_none" in r
    }
    singles = [attribution[n]["overhead_vs_none"] for n in SINGLES if n in attribution]
    if len(singles) == len(SINGLES):
        attribution["sum_of_the_six_alone"] = {"overhead_vs_none": sum(singles)}

    report = {
        **result_header("callbacks_overhead"),
        "config": {
            "model": "GPT-2 124M" if not args.smoke else "tiny (smoke)",
            "batch": f"{args.batch_size}x{cfg.block_size}",
            "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
            "optimizer": "AdamW fused" if torch.cuda.is_available() else "AdamW",
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "log_every_n_steps": 10,
            "compile": False,
            "round_order": "alternating (forward, then reversed)",
        },
        "baseline": "none",
        "overhead_definition": "median over rounds of (variant median step / none median step, same round) - 1",
        "attribution": attribution,
        "results": results,
        "no_sync_check": sync_check,
        "target": "all6 overhead_vs_none <= 0.01",
        "wall_s": wall,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)

    print(f"\nPer-callback attribution ({report['device']}, {args.rounds} rounds x {args.steps} steps)")
    print(
        f"{'variant':30s} {'median ms':>10s} {'overhead':>9s} {'rounds min..max':>17s} "
        f"{'mean-based':>10s} {'p25..p75 ms':>15s}"
    )
    for name, r in results.items():
        if "median_step_ms" not in r:
            print(f"{name:30s} ERROR {r.get('errors', ['?'])[0][:100]}")
            continue
        ov = r.get("overhead_vs_none")
        rr = r.get("overhead_vs_none_rounds") or [0.0]
        sp = r["spread_ms"]
        print(
            f"{name:30s} {r['median_step_ms']:10.2f} "
            + (
                f"{ov * 100:+8.2f}% {min(rr) * 100:+7.2f}..{max(rr) * 100:+6.2f}% "
                if ov is not None
                else " " * 28
            )
            + (f"{r['overhead_vs_none_mean_based'] * 100:+9.2f}% " if ov is not None else " " * 11)
            + f"{sp['pooled_p25']:7.2f}..{sp['pooled_p75']:.2f}"
            + ("  (errors)" if r.get("errors") else "")
        )
    if len(singles) == len(SINGLES) and "all6" in attribution:
        print(
            f"sum of the six alone: {sum(singles) * 100:+.2f}%   all6 together: "
            f"{results['all6']['overhead_vs_none'] * 100:+.2f}%   (target <= +1.00%)"
        )
    for name, r in sync_check.items():
        if "error" in r:
            print(f"no-sync check, {name}: FAILED {r['error'][:200]}")
        else:
            print(
                f"no-sync check, {name}: {'ok' if r['ok'] else 'FAILED'} ({r['steps_checked']} non-log steps, "
                f"{r['n_bubbles']} waits before backward was queued, {r['waits_after_backward_queued']} after)"
            )
    print(f"wrote {args.out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
