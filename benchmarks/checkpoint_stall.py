"""Training time lost per checkpoint: synchronous save vs Lightning AsyncCheckpointIO vs our AsyncCheckpoint.

GPT-2 124M, bf16-mixed, batch 16x1024, fused AdamW (model + optimizer state ~1.5 GB). Each variant
trains ``--steps`` steps and saves once at step ``--save-at``; the time lost is the variant's
wall time for those steps (including waiting for the write to finish at the end, so background
contention counts) minus the same steps without a save, measured in the same process. Also: the
loop time inside the save call, extra peak GPU memory during the save window, and the file size.

    python -m benchmarks.checkpoint_stall            # CUDA, ~2 min on an H100
    python -m benchmarks.checkpoint_stall --smoke    # CPU, seconds
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks._results import command_line, environment, write_result
from benchmarks.callbacks_overhead import BenchModule, RandomTokens, gpt_config
from lightning_opt.callbacks import AsyncCheckpoint


class SaveAt(pl.Callback):
    """Saves once, at one step: ``trainer.save_checkpoint`` (sync save, or Lightning's async IO
    plugin), or ``AsyncCheckpoint.save`` when ``ours`` is given."""

    def __init__(self, step: int, path: str, ours: AsyncCheckpoint | None = None) -> None:
        self.step, self.path, self.ours = step, path, ours
        self.stall_s = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            t0 = time.perf_counter()
            if self.ours is not None:
                self.ours.save(trainer)
            else:
                trainer.save_checkpoint(self.path)
            self.stall_s = time.perf_counter() - t0


class Window(pl.Callback):
    """Wall time from the end of warmup to the end of training (synchronised at both ends)."""

    def __init__(self, warmup: int, save_at: int, cuda: bool) -> None:
        self.warmup, self.save_at, self.cuda = warmup, save_at, cuda
        self.t0 = self.t1 = 0.0
        self.peak_extra = 0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        if trainer.global_step == self.save_at - 1 and self.cuda:
            # Peak memory from here on; its excess over the pre-save allocation is the save's.
            self._sync()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def finish(self) -> None:
        self._sync()
        self.t1 = time.perf_counter()
        if self.cuda:
            self.peak_extra = torch.cuda.max_memory_allocated() - self.before


def run(variant: str, args: argparse.Namespace, outdir: str) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    cfg = gpt_config(args.smoke)
    torch.manual_seed(0)
    module = BenchModule(cfg, args.batch_size)
    window = Window(args.warmup, args.save_at, cuda)
    path = os.path.join(outdir, f"{variant}.ckpt")
    callbacks: list[pl.Callback] = []
    plugins: list[Any] = []
    ours = None
    saver = None
    if variant == "sync":
        saver = SaveAt(args.save_at, path)
    elif variant == "lightning_async_io":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
        saver = SaveAt(args.save_at, path)
    elif variant in ("ours", "ours_overlap_copy"):
        # No periodic trigger: one save at --save-at, like the other variants.
        ours = AsyncCheckpoint(
            dirpath=os.path.join(outdir, "ours"),
            every_n_steps=None,
            keep_last_k=None,
            save_last=False,
            save_on_train_end=False,
            save_on_exception=False,
            overlap_copy=variant == "ours_overlap_copy",
        )
        callbacks.append(ours)
        saver = SaveAt(args.save_at, path, ours=ours)
    if ours is None:
        # Same checkpoint content in every variant: an idle AsyncCheckpoint (never saves, no
        # buffer prewarm) contributes its state (RNG states) to the other variants' files. Being
        # a Checkpoint, it also keeps Lightning from adding a ModelCheckpoint that would save.
        callbacks.append(
            AsyncCheckpoint(
                dirpath=os.path.join(outdir, "idle"),
                every_n_steps=None,
                save_on_train_end=False,
                save_on_exception=False,
                prewarm=False,
            )
        )
    if saver is not None:
        callbacks.append(saver)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        callbacks=[*callbacks, window],
        plugins=plugins,
    )
    trainer.fit(
        module,
        train_dataloaders=RandomTokens(args.steps + 1, args.batch_size, cfg.block_size, cfg.vocab_size),
    )
    # The write must be finished for the save to count as done; waiting here is part of its cost.
    if ours is not None:
        ours.wait()
    if variant == "lightning_async_io":
        trainer.strategy.checkpoint_io.teardown()
    window.finish()
    out: dict[str, Any] = {"window_s": window.t1 - window.t0, "steps_in_window": args.steps - args.warmup}
    if cuda:
        out["extra_peak_gpu_bytes_during_save"] = window.peak_extra
    if ours is not None:
        out["loop_stall_s"] = saver.stall_s
        files = [os.path.join(ours.dirpath, f) for f in os.listdir(ours.dirpath) if f.endswith(".ckpt")]
        out["files_written"] = len(files)
        out["file_bytes"] = os.path.getsize(files[0]) if files else None
    elif saver is not None:
        out["loop_stall_s"] = saver.stall_s
        out["file_bytes"] = os.path.getsize(path) if os.path.exists(path) else None
    del trainer, module
    if cuda:
        torch.cuda.empty_cache()
    shutil.rmtree(outdir, ignore_errors=True)
    os.makedirs(outdir, exist_ok=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--save-at", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_stall.json"),
    )
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.save_at, args.batch_size = 10, 2, 4, 2
        if args.out.endswith("checkpoint_stall.json"):
            args.out = args.out.replace(".json", "_smoke.json")
    elif not torch.cuda.is_available():
        sys.exit("checkpoint_stall: needs a CUDA GPU (or pass --smoke)")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True

    base_dir = args.dir or tempfile.mkdtemp(prefix="ckpt_stall_")
    order = ["none", "sync", "lightning_async_io", "ours", "ours_overlap_copy", "none"]
    raw: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for variant in order:
        try:
            raw.setdefault(variant, []).append(run(variant, args, os.path.join(base_dir, variant)))
        except Exception as err:
            errors[variant] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
    shutil.rmtree(base_dir, ignore_errors=True)

    results: dict[str, Any] = {}
    base_runs = raw.get("none", [])
    base = min(r["window_s"] for r in base_runs) if base_runs else None
    base_peak = min(r.get("extra_peak_gpu_bytes_during_save", 0) for r in base_runs) if base_runs else 0
    for variant, runs in raw.items():
        r = (
            dict(runs[0])
            if variant != "none"
            else {"window_s_runs": [x["window_s"] for x in runs], "window_s": base}
        )
        if base is not None and variant != "none":
            r["time_lost_s"] = r["window_s"] - base
            if "extra_peak_gpu_bytes_during_save" in r:
                r["extra_gpu_bytes"] = r["extra_peak_gpu_bytes_during_save"] - base_peak
        results[variant] = r
    ratios: dict[str, Any] = {}
    sync, lio = results.get("sync", {}), results.get("lightning_async_io", {})
    for name in ("ours", "ours_overlap_copy"):
        ours = results.get(name, {})
        if "time_lost_s" not in ours:
            continue
        if sync.get("time_lost_s"):
            ratios[f"{name}_over_sync"] = ours["time_lost_s"] / sync["time_lost_s"]
        if lio.get("time_lost_s"):
            ratios[f"{name}_over_lightning_async_io"] = ours["time_lost_s"] / lio["time_lost_s"]
        if sync.get("file_bytes") and ours.get("file_bytes"):
            ratios[f"{name}_file_over_sync_file"] = ours["file_bytes"] / sync["file_bytes"]
    report = {
        "config": {
            "model": "GPT-2 124M" if not args.smoke else "tiny (smoke)",
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "save_at": args.save_at,
            "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
        },
        "results": results,
        "ratios": ratios,
        "errors": errors,
    }
    targets = {
        "ours_over_lightning_async_io": "<= 0.5",
        "ours_over_sync": "<= 0.05",
        "extra_gpu_bytes": "0",
        "ours_file_over_sync_file": "<= 1.0",
    }
    write_result(args.out, benchmark="checkpoint_stall", env=environment(), command=command_line(),
                 baseline={"name": "none (same steps, no save; best of two runs)"}, results=report, goals=targets)
    print(f"\n{'variant':22s} {'lost s':>9s} {'loop stall s':>13s} {'extra GPU MB':>13s} {'file MB':>9s}")
    for variant, r in results.items():

        def fmt(v: Any, scale: float = 1.0, spec: str = "9.3f") -> str:
            return "-" if v is None else format(v / scale, spec)

        print(
            f"{variant:22s} {fmt(r.get('time_lost_s')):>9s} {fmt(r.get('loop_stall_s'), spec='13.3f'):>13s} "
            f"{fmt(r.get('extra_gpu_bytes'), 2**20, '13.1f'):>13s} {fmt(r.get('file_bytes'), 2**20, '9.1f'):>9s}"
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    for k, v in errors.items():
        print(f"ERROR in {k}: {v.splitlines()[0]}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
