"""Step-time overhead of the six lightning_opt callbacks, alone and together, vs none.

Two workloads, each in this one process on one GPU, each model built once (every run gets a fresh Trainer and
optimizer), real Trainer, no compile, bf16-mixed, ``log_every_n_steps=10``:

* ``main``: GPT-2 124M (lightning_opt.models.gpt2), batch 16x1024 of random tokens, fused AdamW with a per-step
  LR schedule. Variants: ``none`` (the baseline), each callback alone (``nanskip``, ``lossclamp``,
  ``asyncckpt``, ``evalthrottle``, ``cudamem``, ``speedmon``), ``all6``, Lightning's ``ThroughputMonitor``
  and ``all6`` with ``NaNSkip(mode="host")``.
* ``speedrun``: the GPT-2 speedrun recipe's model and optimizer as
  ``lightning_opt/recipes/configs/gpt2/gpt2-124m-speedrun.yaml`` builds them (``GPT2SpeedrunModule``, Muon +
  AdamW in a ``CombinedOptimizer``, its schedule and batch, ``MatmulPrecision("high")``) in the 1024-token
  geometry (``gpt2_common.SHORT_GEOMETRY``: 32 x 1024-token batches), compile off.
  Variants: ``speedrun_none`` and ``speedrun_all6``.

Method. Step time is the interval between CUDA events recorded at consecutive batch starts (no sync of ours),
over ``--steps`` steps after ``--warmup``; the interval to the end of fit is left out. The device is held busy
for ``--prewarm-s`` seconds before the first timed run. In each round the baseline runs before every
``--per-baseline`` variants and after the last one, and the variant order alternates between rounds
(A B C, C B A). A run's overhead is its median step over the baseline interpolated linearly between the
baseline runs around it (run order), so drift of the device's clocks between runs cancels to first order. A
variant's overhead is the median of its per-round overheads; the JSON keeps every round's value, their range
and standard deviation, and the same from mean step times ("mean-based": log and GC steps count in full).

Also measured, same process, on the device: what NaNSkip's check costs for the model's gradients (its Triton
kernel and the ``torch._foreach_norm`` path, CUDA events around back-to-back calls after warm-up calls, median of
many) and what its flagged copy costs on a good and on a bad step for the speedrun's Muon parameters and
momentum; a skip check (a NaN loss at one step: parameters and optimizer state bit-identical across it, Muon's
step counter not advanced) for both workloads; and a no-sync check of ``none``, ``all6`` and
``speedrun_all6``: ``set_sync_debug_mode("error")`` over every non-log step and every host wait on a CUDA
event, stream or device counted by phase (a wait before the step's backward is queued drains the device queue
and fails the check; one after it leaves the device a backward of work).

    python -m benchmarks.callbacks_overhead                # CUDA, about 4 minutes on an H100
    python -m benchmarks.callbacks_overhead --variants none,nanskip,all6 --rounds 8 --no-speedrun
    python -m benchmarks.callbacks_overhead --variants none,nanskip,all6 --rounds 6 --speedrun-rounds 0  # ~2 min
    python -m benchmarks.callbacks_overhead --smoke        # CPU, tiny models, seconds
"""

from __future__ import annotations

import argparse
import gc
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

from benchmarks._results import RESULTS, command_line, device_slug, environment, write_result
from lightning_opt.callbacks import (
    AsyncCheckpoint,
    CudaMemoryHygiene,
    EvalThrottle,
    LossClamp,
    MatmulPrecision,
    NaNSkip,
    SpeedMonitor,
)
from lightning_opt.callbacks._flagged_copy import FlaggedCopy
from lightning_opt.callbacks._nonfinite import NonFiniteCheck
from lightning_opt.callbacks.nan_skip import _REASONS, flag_nonfinite
from lightning_opt.models.gpt2 import GPT, GPTConfig

LOG_EVERY = 10
SPEEDRUN_YAML = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "lightning_opt", "recipes", "configs", "gpt2",
    "gpt2-124m-speedrun.yaml",
)


# -- workloads -------------------------------------------------------------------------------------------------
def gpt_config(smoke: bool) -> GPTConfig:
    if smoke:
        return GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=64, block_size=32)
    return GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024)


class BenchModule(pl.LightningModule):
    """GPT-2 with fused AdamW and a per-step LR schedule; ``flops_per_batch`` set (6 N tokens). ``nan_at``: a
    global step whose loss is made NaN (the skip check)."""

    def __init__(self, cfg: GPTConfig, batch_size: int, nan_at: int | None = None) -> None:
        super().__init__()
        self.model = GPT(cfg)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.flops_per_batch = 6 * n_params * batch_size * cfg.block_size
        self.nan_at = nan_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        if self.nan_at is not None and self.trainer.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

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


def speedrun_settings(smoke: bool) -> dict[str, Any]:
    """The speedrun recipe's ``model`` section (compile off) and its batch, from the YAML in the 1024-token
    geometry; shrunk for --smoke."""
    from benchmarks.gpt2_common import recipe_config

    cfg = recipe_config("gpt2-124m-speedrun", geometry="short")
    model = dict(cfg["model"])
    model["compile"] = False
    data = cfg["data"]
    batch, seq = int(data["batch_size"]), int(data["seq_len"])
    if smoke:  # tiny and without layer 7 (which the speedrun drops attention from)
        model["model_config"] = {**model["model_config"], "n_layer": 2, "n_head": 2, "n_embd": 64,
                                 "block_size": 32, "vocab_size": 256, "skip_attn_layers": [],
                                 "n_value_embeds": 1}
        batch, seq = 2, 32
    return {"model": model, "batch_size": batch, "seq_len": seq,
            "vocab_size": int(model["model_config"]["vocab_size"])}


def speedrun_module(settings: dict[str, Any], nan_at: int | None = None) -> pl.LightningModule:
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    class SpeedrunBench(GPT2SpeedrunModule):
        """The recipe's module; ``nan_at``: a global step whose loss is made NaN (the skip check)."""

        def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = super().compute_loss(x, y)
            if self.nan_at is not None and self.trainer.global_step == self.nan_at:
                loss = loss * float("nan")
            return loss

    torch.manual_seed(0)
    module = SpeedrunBench(**settings["model"])
    module.nan_at = nan_at
    return module


# -- timing and checks -----------------------------------------------------------------------------------------
class StepTimer(pl.Callback):
    """A CUDA event (a host clock on CPU) at each batch start; intervals read after fit (no per-step sync)."""

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

    def step_ms(self, warmup: int, steps: int) -> list[float]:
        """The ``steps`` intervals between the batch starts ``warmup .. warmup + steps``."""
        ev = self.events[warmup : warmup + steps + 1]
        if self.cuda:
            torch.cuda.synchronize()
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

    def __init__(self, after: int, log_every: int = LOG_EVERY) -> None:
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


def _leaf_optimizers(trainer: pl.Trainer) -> list[torch.optim.Optimizer]:
    out = []
    for opt in trainer.optimizers:
        out.extend(getattr(opt, "optimizers", None) or [opt])
    return out


def _optimizer_tensors(trainer: pl.Trainer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for opt in _leaf_optimizers(trainer):
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out.extend(v.clone() for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return out


class SkipProbe(pl.Callback):
    """Parameters and optimizer state before and after global step ``at`` (whose loss is NaN), and the host
    step counters in the param groups (Muon's ``steps_done``) before it and after the next step."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.counters: list[Any] = []

    def _steps_done(self, trainer: pl.Trainer) -> list[int]:
        return [g["steps_done"] for o in _leaf_optimizers(trainer) for g in o.param_groups if "steps_done" in g]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.before = _optimizer_tensors(trainer)
            self.counters.append(self._steps_done(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # global_step counts optimizer steps, skipped ones too: step ``at`` ends at at + 1
        if trainer.global_step == self.at + 1:
            self.after = _optimizer_tensors(trainer)
        elif trainer.global_step == self.at + 2:  # Muon's counter is put back when the next step reads the flag
            self.counters.append(self._steps_done(trainer))

    def result(self, skip: NaNSkip) -> dict[str, Any]:
        same = len(self.before) == len(self.after) > 0 and all(
            torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
            for a, b in zip(self.before, self.after)
        )
        counters_ok = len(self.counters) == 2 and all(b == a + 1 for a, b in zip(*self.counters))
        return {
            "ok": bool(same and counters_ok and skip.skipped_total == 1),
            "tensors_compared": len(self.before),
            "bit_identical_across_the_skipped_step": bool(same),
            "muon_steps_done_before_and_after_the_next_step": self.counters,
            "skipped": skip.skipped_total,
            "steps_seen": skip.steps_seen,
        }


# -- variants --------------------------------------------------------------------------------------------------
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
    # one scheduled collection inside a main run's timed window (global step 20; its default is every 100)
    "cudamem": lambda d: CudaMemoryHygiene(gc_every_n_steps=20),
    "speedmon": lambda d: SpeedMonitor(log_every_n_steps=LOG_EVERY),
}


def six_callbacks(tmpdir: str) -> list[pl.Callback]:
    return [make(tmpdir) for make in SINGLES.values()]


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
# the recipe's own callback (float32 matmuls on TF32) is in both speedrun variants: it is not one of the six
SPEEDRUN_VARIANTS: dict[str, Callable[[str], list[pl.Callback]]] = {
    "speedrun_none": lambda d: [MatmulPrecision(precision="high")],
    "speedrun_all6": lambda d: [MatmulPrecision(precision="high"), *six_callbacks(d)],
}


def run_variant(
    name: str,
    module: pl.LightningModule,
    callbacks: list[pl.Callback],
    data: Callable[[int], Any],
    warmup: int,
    steps: int,
    tmpdir: str,
    first: list[pl.Callback] = (),
    last: list[pl.Callback] = (),
) -> dict[str, Any]:
    """One fit of ``warmup + steps + 1`` steps; the step times of the ``steps`` after the warm-up."""
    cuda = torch.cuda.is_available()
    timer = StepTimer(cuda)
    n = warmup + steps + 1
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=n,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=pl.loggers.CSVLogger(os.path.join(tmpdir, "logs"), name=name),
        log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.Checkpoint) for c in callbacks),
        callbacks=[timer, *first, *callbacks, *last],
    )
    trainer.fit(module, train_dataloaders=data(n + 1))
    ms = timer.step_ms(warmup, steps)
    out: dict[str, Any] = {
        "optimizer": repr(trainer.optimizers[0]) if trainer.optimizers else None,
        "median_step_ms": statistics.median(ms),
        "mean_step_ms": statistics.fmean(ms),
        "steps": len(ms),
        "step_ms": [round(x, 4) for x in ms],
    }
    for c in callbacks:
        if isinstance(c, SpeedMonitor):
            out["speed_monitor_metrics"] = c.metrics
        if isinstance(c, NaNSkip):
            out["nan_skip"] = {"skipped": c.skipped_total, "host_waits": c.host_waits, "steps": c.steps_seen,
                               "paths": c.paths}
    del trainer
    gc.collect()
    return out


def schedule(variants: list[str], baseline: str, rounds: int, per_baseline: int) -> list[tuple[int, str]]:
    """(round, variant) in run order: the baseline before every ``per_baseline`` variants and after the last
    (a round starts with the previous round's last baseline run); the variants' order alternates between
    rounds."""
    order: list[tuple[int, str]] = []
    others = [v for v in variants if v != baseline]
    for rnd in range(rounds):
        seq = others if rnd % 2 == 0 else others[::-1]
        for i, name in enumerate(seq):
            if i % per_baseline == 0 and not (order and order[-1][1] == baseline):
                order.append((rnd, baseline))
            order.append((rnd, name))
        order.append((rnd, baseline))
    return order


def _interpolated(runs: list[dict[str, Any]], i: int, baseline: str, key: str) -> float | None:
    """The baseline's ``key`` at run ``i``: linear in run order between the nearest baseline runs around it."""
    before = next((j for j in range(i - 1, -1, -1) if runs[j]["variant"] == baseline and key in runs[j]), None)
    after = next((j for j in range(i + 1, len(runs)) if runs[j]["variant"] == baseline and key in runs[j]), None)
    if before is None and after is None:
        return None
    if before is None or after is None:
        return runs[before if after is None else after][key]
    a, b = runs[before][key], runs[after][key]
    return a + (b - a) * (i - before) / (after - before)


def _spread(xs: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "n": len(xs),
    }


def summarize(runs: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Per variant: its runs, and its overhead over the interpolated baseline (median, mean, range, stdev)."""
    for i, r in enumerate(runs):
        if r["variant"] == baseline or "median_step_ms" not in r:
            continue
        for key, label in (("median_step_ms", "overhead"), ("mean_step_ms", "overhead_mean_based")):
            base = _interpolated(runs, i, baseline, key)
            if base:
                r[f"baseline_{key}"] = base
                r[label] = r[key] / base - 1
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        ok = [r for r in mine if "median_step_ms" in r]
        entry: dict[str, Any] = {"runs": mine}
        if ok:
            meds = [r["median_step_ms"] for r in ok]
            pooled = sorted(t for r in ok for t in r["step_ms"])
            entry["median_step_ms"] = statistics.median(meds)
            entry["mean_step_ms"] = statistics.fmean([r["mean_step_ms"] for r in ok])
            entry["spread_ms"] = {
                "run_median_min": min(meds),
                "run_median_max": max(meds),
                "pooled_p25": pooled[len(pooled) // 4],
                "pooled_p75": pooled[(3 * len(pooled)) // 4],
            }
        ov = [r["overhead"] for r in ok if "overhead" in r]
        if ov:
            entry["overhead_vs_none"] = statistics.median(ov)
            entry["overhead_vs_none_rounds"] = ov
            entry["overhead_spread"] = _spread(ov)
            om = [r["overhead_mean_based"] for r in ok if "overhead_mean_based" in r]
            entry["overhead_vs_none_mean_based"] = statistics.median(om)
            entry["overhead_mean_based_spread"] = _spread(om)
        elif name == baseline and ok:
            entry["overhead_vs_none"] = 0.0
        errors = [r["error"] for r in mine if "error" in r]
        if errors:
            entry["errors"] = errors
        out[name] = entry
    return out


def run_section(
    variants: dict[str, Callable[[str], list[pl.Callback]]],
    chosen: list[str],
    baseline: str,
    module: pl.LightningModule,
    data: Callable[[int], Any],
    per_baseline: int,
    rounds: int,
    warmup: int,
    steps: int,
    tmpdir: str,
    t_start: float,
    label: str,
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    order = schedule(chosen, baseline, rounds, per_baseline)
    for i, (rnd, name) in enumerate(order):
        entry: dict[str, Any] = {"variant": name, "round": rnd, "order": i}
        try:
            entry.update(run_variant(name, module, variants[name](tmpdir), data, warmup, steps, tmpdir))
        except Exception as err:  # one failing variant must not kill the others
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
            entry["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
        runs.append(entry)
        if i + 1 == len(order) or order[i + 1][0] != rnd:
            print(f"{label}: round {rnd + 1}/{rounds} done at {time.perf_counter() - t_start:.0f} s", flush=True)
    return runs


def prewarm(module: pl.LightningModule, data: Callable[[int], Any], seconds: float, step_s: float,
            tmpdir: str) -> float:
    """Untimed steps: CUDA context, cuBLAS handles, Triton kernels and the device's clocks settle here."""
    t0 = time.perf_counter()
    steps = max(3, int(seconds / max(step_s, 1e-3)))
    run_variant("prewarm", module, [NaNSkip(), LossClamp()], data, 1, steps, tmpdir)
    return time.perf_counter() - t0


def no_sync_check(
    names: list[str],
    variants: dict[str, Callable[[str], list[pl.Callback]]],
    module: pl.LightningModule,
    data: Callable[[int], Any],
    warmup: int,
    steps: int,
    tmpdir: str,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        guard = SyncGuard(after=warmup)
        try:
            run = run_variant("sync_check", module, variants[name](tmpdir), data, warmup, steps, tmpdir,
                              first=[guard.opener], last=[guard.closer])
            out[name] = {
                "ok": not guard.bubbles and guard.checked > 0,
                "steps_checked": guard.checked,
                "bubbles": guard.bubbles[:5],
                "n_bubbles": len(guard.bubbles),
                "waits_after_backward_queued": guard.queued_waits,
                "nan_skip": run.get("nan_skip"),
            }
        except Exception as err:
            torch.cuda.set_sync_debug_mode("default")
            guard._unpatch()
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    return out


def skip_check(module: pl.LightningModule, data: Callable[[int], Any], tmpdir: str, at: int = 4) -> dict[str, Any]:
    """A NaN loss at global step ``at`` with the six callbacks: the step is skipped bit-exactly."""
    probe, callbacks = SkipProbe(at), six_callbacks(tmpdir)
    skip = next(c for c in callbacks if isinstance(c, NaNSkip))
    module.nan_at = at
    try:
        run_variant("skip_check", module, [*callbacks, probe], data, 1, at + 3, tmpdir)
        return probe.result(skip)
    except Exception as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    finally:
        module.nan_at = None


def _time_ms(fn: Callable[[], Any], reps: int, inner: int = 10) -> float:
    """Device time of one call of ``fn``: after three untimed calls (compiles, table uploads), the median over
    ``reps`` samples of (CUDA events around ``inner`` back-to-back calls) / ``inner``; host time on CPU. Back to
    back, the device runs the calls from its queue, so launch gaps of an idle device are not counted."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def check_costs(main: pl.LightningModule | None, speedrun: pl.LightningModule | None, reps: int) -> dict[str, Any]:
    """NaNSkip's device work in isolation, on the device the runs train on (the modules are on the host after a
    fit: every tensor here is made on the device): the check of a step's loss and gradients (float32, like under
    bf16-mixed), through the Triton kernel NaNSkip uses on CUDA and through the ``torch._foreach_norm`` path; and
    the flagged copy of the speedrun's Muon parameters and momentum on a good and a bad step."""
    out: dict[str, Any] = {}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = len(_REASONS)
    if main is not None:
        grads = [torch.randn(p.shape, device=dev) for p in main.parameters()]
        loss = torch.tensor(3.0, device=dev)
        one = torch.ones((), device=dev)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        kernel = NonFiniteCheck()

        def torch_check() -> None:  # NaNSkip's fallback: zeros, the norms, one check kernel per part, the max
            flags = torch.zeros(n, device=dev)
            flag_nonfinite([([loss], flags[0]), (grads, flags[1])], one)
            flags.amax()

        def triton_check() -> None:  # NaNSkip on CUDA: zeros, one kernel (flags and decision)
            kernel([([loss], 0), (grads, 1)], torch.zeros(n + 1, device=dev), n)

        uses_kernel = kernel([([loss], 0), (grads, 1)], torch.zeros(n + 1, device=dev), n)
        norm_ms = _time_ms(lambda: torch._foreach_norm(grads, float("inf")), reps)
        torch_ms = _time_ms(torch_check, reps)
        triton_ms = _time_ms(triton_check, reps) if uses_kernel else None
        check_ms = triton_ms if uses_kernel else torch_ms
        out["main_gradient_check"] = {
            "device": str(dev),
            "tensors": len(grads),
            "gradient_bytes": nbytes,
            "foreach_norm_inf_ms": norm_ms,
            "foreach_norm_read_GB_per_s": nbytes / (norm_ms * 1e-3) / 1e9,
            "torch_check_ms": torch_ms,
            "triton_check_ms": triton_ms,
            "triton_read_GB_per_s": None if triton_ms is None else nbytes / (triton_ms * 1e-3) / 1e9,
            "nan_skip_check_path": "triton" if uses_kernel else "foreach_norm",
            "nan_skip_check_ms": check_ms,
        }
        del grads
    if speedrun is not None:
        hidden = [p.detach().to(dev) for p in speedrun.model.hidden_matrices()]
        live = [*hidden, *[torch.zeros_like(p) for p in hidden]]  # parameters + Muon momentum
        snap = [torch.empty_like(t) for t in live]
        copy = FlaggedCopy()
        good, bad = torch.zeros((), device=dev), torch.ones((), device=dev)
        nbytes = sum(t.numel() * t.element_size() for t in live)
        out["speedrun_muon_flagged_copy"] = {
            "device": str(dev),
            "tensors": len(live),
            "bytes": nbytes,
            "good_step_ms": _time_ms(lambda: copy(good, snap, live), reps),
            "uses_kernel": copy.uses_kernel,
            "bad_step_ms": _time_ms(lambda: copy(bad, snap, live), 3, inner=3),
        }
        del hidden, live, snap
    return out


# -- the report ------------------------------------------------------------------------------------------------
def attribution(summary: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, r in summary.items():
        if "overhead_vs_none" not in r:
            continue
        item = {"median_step_ms": r.get("median_step_ms"), "overhead_vs_none": r["overhead_vs_none"]}
        if "overhead_spread" in r:
            sp = r["overhead_spread"]
            item["overhead_range_over_rounds"] = [sp["min"], sp["max"]]
            item["overhead_stdev_over_rounds"] = sp["stdev"]
            item["overhead_vs_none_mean_based"] = r["overhead_vs_none_mean_based"]
        out[name] = item
    return out


def print_table(title: str, summary: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"{'variant':30s} {'median ms':>10s} {'overhead':>9s} {'rounds min..max':>17s} {'sd':>6s} {'mean-based':>10s}")
    for name, r in summary.items():
        if "median_step_ms" not in r:
            print(f"{name:30s} ERROR {(r.get('errors') or ['?'])[0][:100]}")
            continue
        line = f"{name:30s} {r['median_step_ms']:10.2f} "
        sp = r.get("overhead_spread")
        if sp:
            line += (f"{r['overhead_vs_none'] * 100:+8.2f}% {sp['min'] * 100:+7.2f}..{sp['max'] * 100:+6.2f}% "
                     f"{sp['stdev'] * 100:5.2f}% {r['overhead_vs_none_mean_based'] * 100:+9.2f}%")
        else:
            line += "  baseline"
        print(line + ("  (errors)" if r.get("errors") else ""))


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:
        return {"error": {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}}


def speedrun_section(args: argparse.Namespace, cuda: bool, tmpdir: str, t_start: float, sections: dict[str, Any],
                     sync: dict[str, Any], checks: dict[str, Any], costs: dict[str, Any]) -> None:
    """The six callbacks in the speedrun recipe's configuration: the recipe's module and optimizer, none vs all6."""
    settings = speedrun_settings(args.smoke)
    if args.speedrun_batch_size and not args.smoke:
        settings["batch_size"] = args.speedrun_batch_size
    sr = speedrun_module(settings)
    if args.speedrun_rounds <= 0:  # the flagged copy's cost only, no speedrun training
        sections["speedrun"] = {"device_costs_only": True}
        costs.update(_guarded(lambda: check_costs(None, sr, 20 if cuda else 2)))
        return

    def sr_data(n: int) -> RandomTokens:
        return RandomTokens(n, settings["batch_size"], settings["seq_len"], settings["vocab_size"])

    t0 = time.perf_counter()
    # Triton kernels (the fused loss, NaNSkip's flagged copy) compile here
    run_variant("prewarm", sr, SPEEDRUN_VARIANTS["speedrun_all6"](tmpdir), sr_data, 1, 2 if args.smoke else 6,
                tmpdir)
    print(f"speedrun prewarm: {time.perf_counter() - t0:.0f} s", flush=True)
    runs = run_section(SPEEDRUN_VARIANTS, list(SPEEDRUN_VARIANTS), "speedrun_none", sr, sr_data, 1,
                       args.speedrun_rounds, args.speedrun_warmup, args.speedrun_steps, tmpdir, t_start, "speedrun")
    sections["speedrun"] = {
        "config": os.path.relpath(SPEEDRUN_YAML, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")),
        "batch": f"{settings['batch_size']}x{settings['seq_len']}",
        "optimizer": next((r["optimizer"] for r in runs if "optimizer" in r), None),
        "runs_in_order": [(r["round"], r["variant"]) for r in runs],
        "summary": summarize(runs, "speedrun_none"),
    }
    if cuda and not args.no_sync_check:
        sync.update(no_sync_check(["speedrun_none", "speedrun_all6"], SPEEDRUN_VARIANTS, sr, sr_data,
                                  args.speedrun_warmup, args.speedrun_steps, tmpdir))
    checks["speedrun"] = skip_check(sr, sr_data, tmpdir)
    costs.update(_guarded(lambda: check_costs(None, sr, 20 if cuda else 2)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny models on CPU, a few steps")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (main)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps at the start of each run")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-baseline", type=int, default=3, help="variants between two baseline runs")
    p.add_argument("--prewarm-s", type=float, default=8.0, help="seconds of untimed training before the rounds")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} ('none' is always run: the baseline)")
    p.add_argument("--no-speedrun", action="store_true", help="leave out the speedrun-recipe workload")
    p.add_argument("--speedrun-rounds", type=int, default=3,
                   help="0: only the flagged copy's device cost on the speedrun's Muon tensors (no speedrun runs)")
    p.add_argument("--speedrun-steps", type=int, default=10)
    p.add_argument("--speedrun-warmup", type=int, default=3)
    p.add_argument("--speedrun-batch-size", type=int, default=None, help="default: the recipe's (data.batch_size)")
    p.add_argument("--no-sync-check", action="store_true", help="skip the no-sync check runs")
    p.add_argument("--out", default=None,
                   help="result file (default: benchmarks/results/callbacks_overhead_<device>.json)")
    args = p.parse_args(argv)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    chosen = ["none", *dict.fromkeys(v for v in chosen if v != "none")]
    cuda = torch.cuda.is_available()  # --smoke on a GPU machine runs its tiny models there
    if args.smoke:
        args.steps, args.warmup, args.batch_size, args.rounds, args.prewarm_s = 3, 1, 2, 1, 0.0
        args.speedrun_rounds, args.speedrun_steps, args.speedrun_warmup = min(args.speedrun_rounds, 1), 2, 1
    elif not torch.cuda.is_available():
        sys.exit("callbacks_overhead: needs a CUDA GPU (or pass --smoke)")
    if args.out is None:
        args.out = os.path.join(RESULTS, "callbacks_overhead_smoke.json" if args.smoke
                                else f"callbacks_overhead_{device_slug()}.json")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    t_start = time.perf_counter()
    cfg = gpt_config(args.smoke)
    torch.manual_seed(0)
    module = BenchModule(cfg, args.batch_size)  # one model for every run: no rebuild per variant

    def main_data(n: int) -> RandomTokens:
        return RandomTokens(n, args.batch_size, cfg.block_size, cfg.vocab_size)

    env = environment(cuda)
    report: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        warm_s = prewarm(module, main_data, args.prewarm_s, 0.055, tmpdir)
        print(f"prewarm: {warm_s:.0f} s", flush=True)
        runs = run_section(VARIANTS, chosen, "none", module, main_data, args.per_baseline, args.rounds, args.warmup,
                           args.steps, tmpdir, t_start, "main")
        sections["main"] = {"runs_in_order": [(r["round"], r["variant"]) for r in runs],
                            "summary": summarize(runs, "none")}
        sync = {}
        if cuda and not args.no_sync_check:
            sync.update(no_sync_check(["none", "all6"], VARIANTS, module, main_data, args.warmup, args.steps,
                                      tmpdir))
        checks = {"main": skip_check(module, main_data, tmpdir)}
        costs = _guarded(lambda m=module: check_costs(m, None, 20 if cuda else 2))
        if cuda:
            module.cpu()
        del module
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

        if not args.no_speedrun:
            try:
                speedrun_section(args, cuda, tmpdir, t_start, sections, sync, checks, costs)
            except Exception as err:  # the main workload's results are kept
                sections["speedrun"] = {"error": f"{type(err).__name__}: {err}",
                                        "trace": traceback.format_exc()[-3000:]}
    wall = time.perf_counter() - t_start

    main_summary = sections["main"]["summary"]
    speedrun = sections.get("speedrun") or {}
    attr = attribution(main_summary)
    singles = [attr[n]["overhead_vs_none"] for n in SINGLES if n in attr]
    if len(singles) == len(SINGLES):
        attr["sum_of_the_six_alone"] = {"overhead_vs_none": sum(singles)}
    report.update({
        "config": {
            "model": "GPT-2 124M" if not args.smoke else "tiny (smoke)",
            "batch": f"{args.batch_size}x{cfg.block_size}",
            "precision": "bf16-mixed" if cuda else "32-true",
            "optimizer": "AdamW fused" if cuda else "AdamW",
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "per_baseline": args.per_baseline,
            "prewarm_s": args.prewarm_s,
            "speedrun": None if args.no_speedrun else {"rounds": args.speedrun_rounds, "steps": args.speedrun_steps,
                                                      "warmup": args.speedrun_warmup},
            "log_every_n_steps": LOG_EVERY,
            "compile": False,
            "round_order": "alternating (forward, then reversed); the baseline before every per_baseline variants "
                           "and at the end of each round",
        },
        "overhead_definition": "median over rounds of (run median step / baseline median step interpolated in run "
                               "order between the baseline runs around it) - 1",
        "attribution": attr,
        "results": {name: r for name, r in main_summary.items()},
        "speedrun": sections.get("speedrun"),
        "speedrun_attribution": attribution(speedrun["summary"]) if "summary" in speedrun else None,
        "device_costs": costs,
        "skip_check": checks,
        "no_sync_check": sync,
        "wall_s": wall,
    })
    write_result(args.out, benchmark="callbacks_overhead", env=env, command=command_line(argv),
                 baseline={"name": "none"}, results=report, goals="all6 overhead_vs_none <= 0.005")

    n_rounds = args.rounds
    print_table(f"Main: {env['device']}, {n_rounds} rounds x {args.steps} steps", main_summary)
    if len(singles) == len(SINGLES) and "all6" in attr:
        print(f"sum of the six alone: {sum(singles) * 100:+.2f}%   all6 together: "
              f"{attr['all6']['overhead_vs_none'] * 100:+.2f}%   (target <= +0.50%)")
    if "summary" in speedrun:
        print_table(f"Speedrun recipe: {args.speedrun_rounds} rounds x {args.speedrun_steps} steps",
                    speedrun["summary"])
    elif "error" in speedrun:
        print(f"speedrun workload: FAILED {speedrun['error'][:300]}")
    for name, c in costs.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()))
    for name, c in checks.items():
        print(f"skip check, {name}: {'ok' if c.get('ok') else 'FAILED'} {({k: v for k, v in c.items() if k != 'ok'})}")
    for name, r in sync.items():
        if "error" in r:
            print(f"no-sync check, {name}: FAILED {r['error'][:200]}")
        else:
            ns = r.get("nan_skip") or {}
            print(f"no-sync check, {name}: {'ok' if r['ok'] else 'FAILED'} ({r['steps_checked']} non-log steps, "
                  f"{r['n_bubbles']} waits before backward was queued, {r['waits_after_backward_queued']} after)"
                  + (f"; NaNSkip host waits {ns['host_waits']} of {ns['steps']} steps, paths {ns.get('paths')}"
                     if ns else ""))
    print(f"wrote {args.out} ({wall:.0f} s)")
    return report


if __name__ == "__main__":
    main()
