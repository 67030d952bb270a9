"""GPT-2 speedrun recipe on 1, 2 and 4 GPUs through its entry point: scaling efficiency and time to a target loss.

Each size runs ``python -m lightning_opt.recipes.gpt2 --config gpt2/gpt2-124m-speedrun`` (the default recipe, as
a user runs it) with ``--trainer.devices N`` and ``--trainer.accumulate_grad_batches 4 / N``: the same
262,144 tokens per optimizer step, the same 203 steps and the same data order at every size, so every size
follows the same optimisation and only the time differs. Validation on the first ``--val-tokens`` val tokens
every ``--val-every`` optimizer steps (off the training clock, as the recipe's ``metrics.json`` keeps it).

Read from each run's ``metrics.json``: steady tokens/s (after the warm-up window: compilation), the warm-up
time, the val-loss curve on the training clock. Time to ``--target`` (default: the final val loss of the
2025-01-04 record script on the same corpus, from ``benchmarks/results/gpt2_record_<corpus>_2025-01-04_*.json``)
is interpolated between the two val points around it, with the warm-up included and without it.

Scaling efficiency at N GPUs = steady tokens/s at N / (N x steady tokens/s at 1 GPU), both from this call.

    python -m benchmarks.gpt2_recipe_scaling --data-dir .data/novels --plan "1@0 2@1,2 | 4@0,1,2,3"
    python -m benchmarks.gpt2_recipe_scaling --smoke       # tiny model on CPU, 1 and 2 gloo processes

``--plan``: groups separated by ``|`` run one after the other; the sizes of one group run at the same time on
the GPUs named after ``@`` (``CUDA_VISIBLE_DEVICES``), so a 4-GPU machine measures 1 and 2 GPUs side by side
and then 4. Writes ``benchmarks/results/gpt2_recipe_scaling_<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import command_line, environment, write_result

ROOT = Path(__file__).resolve().parents[1]
ACCUM_1GPU = 4  # the recipe's accumulation at one GPU (gpt2-124m-speedrun.yaml)


def record_target(corpus: str) -> tuple[float | None, str | None]:
    """The 2025-01-04 record script's final val loss on ``corpus`` from the committed result file."""
    for path in sorted(glob.glob(str(ROOT / "benchmarks" / "results" / f"gpt2_record_{corpus}_2025-01-04_*.json"))):
        with open(path) as f:
            data = json.load(f)
        loss = (data.get("results") or {}).get("record", {}).get("final_val_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            return float(loss), os.path.relpath(path, ROOT)
    return None, None


def parse_plan(plan: str) -> list[list[tuple[int, str | None]]]:
    """``"1@0 2@1,2 | 4@0,1,2,3"`` -> ``[[(1, "0"), (2, "1,2")], [(4, "0,1,2,3")]]`` (no ``@``: no GPU list)."""
    groups = []
    for part in plan.split("|"):
        lanes = []
        for item in part.split():
            n, _, gpus = item.partition("@")
            if gpus and len(gpus.split(",")) != int(n):
                raise SystemExit(f"error: --plan lane {item!r} names {len(gpus.split(','))} GPUs for {n}; name {n}")
            lanes.append((int(n), gpus or None))
        if lanes:
            groups.append(lanes)
    return groups


def recipe_args(n: int, args: argparse.Namespace) -> list[str]:
    """The recipe's command line at ``n`` processes (GPUs, or gloo CPU processes with ``--smoke``)."""
    if ACCUM_1GPU % n:
        raise SystemExit(f"error: {n} GPUs do not divide the recipe's accumulation {ACCUM_1GPU}; use 1, 2 or 4")
    accum = ACCUM_1GPU // n
    out = ["--trainer.devices", str(n), "--trainer.accumulate_grad_batches", str(accum),
           # validation every --val-every optimizer steps (Lightning counts micro-batches)
           "--trainer.val_check_interval", str(args.val_every * accum),
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--data.val_tokens", str(args.val_tokens)]
    if args.smoke:
        return ["--config", "gpt2/demo", *out, "--trainer.accelerator", "cpu", "--train_tokens", str(args.smoke_tokens),
                "--trainer.max_steps", "-1", "--model.model_config.n_layer", "2", "--model.model_config.n_embd", "32",
                "--model.model_config.n_head", "2", "--data.seq_len", "64", "--data.batch_size", "2"]
    data = Path(args.data_dir).resolve()  # the runs start in their own folders
    return ["--config", "gpt2/gpt2-124m-speedrun", *out, "--trainer.accelerator", "gpu",
            "--data.train_files", str(data / "*_train_*.bin"), "--data.val_files", str(data / "*_val_*.bin")]


def time_to(curve: list[dict[str, float]], target: float) -> tuple[float | None, int | None]:
    """Training-clock seconds (interpolated between val points) and the first val step at or below ``target``."""
    prev = None
    for row in curve:
        if row["val_loss"] <= target:
            if prev is None or prev["val_loss"] == row["val_loss"]:
                return row["train_time_s"], int(row["step"])
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - row["val_loss"])
            return prev["train_time_s"] + frac * (row["train_time_s"] - prev["train_time_s"]), int(row["step"])
        prev = row
    return None, None


def launch(n: int, gpus: str | None, args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, Path, Any]:
    cwd = work / f"{n}gpu"
    cwd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "lightning_opt.recipes.gpt2", *recipe_args(n, args)]
    log = open(cwd / "log.txt", "w")
    print(f"[{n} GPU{'s' if n > 1 else ''}] {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), cwd, log


def read_run(n: int, cwd: Path, rc: int | None, seconds: float, target: float | None) -> dict[str, Any]:
    found = sorted(glob.glob(str(cwd / "runs" / "*" / "version_*" / "metrics.json")), key=os.path.getmtime)
    row: dict[str, Any] = {"gpus": n, "accumulate_grad_batches": ACCUM_1GPU // n, "returncode": rc,
                           "wall_s": round(seconds, 1)}
    if not found:
        row["log_tail"] = (cwd / "log.txt").read_text(errors="replace")[-3000:]
        return row
    m = json.loads(Path(found[-1]).read_text())
    curve = m.get("val_history") or []
    row.update(steps=m.get("steps"), stopped_by=m.get("stopped_by"), steady_tokens_per_s=m.get("steady_tokens_per_s"), warmup_s=m.get("warmup_s"),
               warmup_steps=m.get("warmup_steps"), train_time_s=m.get("train_time_s"),
               final_val_loss=m.get("final_val_loss"), val_curve=curve, device=m.get("device"))
    if rc:
        row["log_tail"] = (cwd / "log.txt").read_text(errors="replace")[-3000:]
    if target is not None:
        t, step = time_to(curve, target)
        row["time_to_target_s"] = None if t is None else round(t, 2)
        row["time_to_target_after_warmup_s"] = (None if t is None or m.get("warmup_s") is None
                                                else round(t - m["warmup_s"], 2))
        row["step_reaching_target"] = step
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    base = next((r for r in rows if r["gpus"] == 1 and r.get("steady_tokens_per_s")), None)
    out: dict[str, Any] = {}
    for r in rows:
        if base is None or r is base or not r.get("steady_tokens_per_s"):
            continue
        n = r["gpus"]
        out[f"efficiency_{n}gpu"] = round(r["steady_tokens_per_s"] / (n * base["steady_tokens_per_s"]), 4)
        for key in ("time_to_target_s", "time_to_target_after_warmup_s"):
            if r.get(key) and base.get(key):
                out[f"{key}_ratio_{n}gpu_over_1gpu"] = round(r[key] / base[key], 4)
    if "efficiency_4gpu" in out:
        out["goal_efficiency_4gpu_ge_0p90"] = out["efficiency_4gpu"] >= 0.90
    if "time_to_target_s_ratio_4gpu_over_1gpu" in out:
        out["goal_time_to_target_4gpu_le_0p30"] = out["time_to_target_s_ratio_4gpu_over_1gpu"] <= 0.30
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=".data/novels", help="FineWeb-format shards: *_train_*.bin, *_val_*.bin")
    p.add_argument("--plan", default="1@0 2@1,2 | 4@0,1,2,3")
    p.add_argument("--target", type=float, default=None, help="val loss to time (default: the record's on the corpus)")
    p.add_argument("--val-every", type=int, default=10, help="optimizer steps between validations")
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--timeout-s", type=float, default=540.0, help="a group still running then is stopped")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: 1 and 2 gloo processes")
    p.add_argument("--smoke-tokens", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.plan, args.val_every, args.val_tokens = "1 2", 8, 1024
    corpus = Path(args.data_dir).name
    target, source = (args.target, "--target") if args.target is not None else record_target(corpus)
    if args.smoke and args.target is None:
        target, source = None, None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpt2_recipe_scaling_"))
    env = environment()
    env["plan"] = args.plan
    baseline = {"name": "the same recipe on 1 GPU in this call", "target_val_loss": target, "target_source": source,
                "data_dir": args.data_dir}
    slug = "cpu" if args.smoke else (env["device"] or "gpu").lower().replace(" ", "-")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"gpt2_recipe_scaling_{slug}.json")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for group in parse_plan(args.plan):
        t0 = time.time()
        running = [(n, *launch(n, gpus, args, work)) for n, gpus in group]
        for n, proc, cwd, log in running:
            try:
                rc = proc.wait(timeout=max(1.0, args.timeout_s - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                proc.terminate()  # SIGTERM: the recipe stops at a step boundary and writes its metrics.json
                rc = proc.wait()
            log.close()
            rows.append(read_run(n, cwd, rc, time.time() - t0, target))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("val_curve", "log_tail")}), flush=True)
            # written after every run: a call stopped from outside keeps the sizes that finished
            result = write_result(out, benchmark="gpt2_recipe_scaling", env=env, command=command_line(argv),
                                  baseline=baseline, results={"rows": rows, "summary": summarise(rows)})
    print(json.dumps(result["results"]["summary"]), flush=True)
    return result


if __name__ == "__main__":
    main()
