"""GPT-2 124M speedrun with DDP on 1, 2, 4 (8) GPUs through our Lightning recipe path, same global batch.

Each world size runs as its own process group (1 GPU first, then the largest sizes first) (``torch.multiprocessing`` spawns one process per GPU; each
builds ``GPT2SpeedrunModule`` + ``TokenShardDataModule`` + ``Trainer(strategy="ddp", precision="bf16-mixed")``
with the ``gpt2-124m-speedrun`` config in the 1024-token geometry of ``gpt2_common.SHORT_GEOMETRY`` and
``torch.compile``), on the novels shards:

- the global batch is fixed at ``--global-tokens`` (524,288 = 32 x 1024 x 16) tokens per optimizer step;
  gradient accumulation is ``16 / N`` at N GPUs, so every size runs the same optimisation;
- ``--steps`` optimizer steps per size (the same schedule length everywhere); tokens/s is measured from the
  end of step ``--warm`` to the end (compile excluded), validation off the clock;
- val loss on the first ``--val-tokens`` (1,048,576) val tokens at the end (every rank evaluates a slice,
  the sums are all-reduced);
- time to ``--target-loss`` (default: the final val loss of the modded-nanogpt record script in
  ``benchmarks/results/gpt2_record_*.json``, 4.2893): a longer run (``--target-steps``, validating every
  ``--target-val-every`` steps, stopping at the target or at the call's time budget) at the largest size;
  the time is interpolated between val points on the compile-free clock. Steps to the target do not depend
  on the number of GPUs (same global batch and data), so for the other sizes the JSON also gives
  ``estimated_time_to_target_s`` = steps to target x that size's measured step time (an estimate, marked so).

Scaling efficiency at N GPUs = tokens/s at N / (N x tokens/s at 1), both from this call. A failing size is
recorded (error or time-budget skip) and the other sizes still run; a launch that outlives the budget is
terminated.

    python -m benchmarks.gpt2_ddp_scaling --deadline-s 330    # GPUs: 1, 2, 4 (8), about 5 minutes on H100s
    python -m benchmarks.gpt2_ddp_scaling --smoke             # tiny model on CPU, 2 gloo processes

Writes ``benchmarks/results/gpt2_ddp_scaling_<device>_<date>.json`` (or ``--out``); the page is
``docs/benchmarks/scaling.md`` (``python -m benchmarks.scaling_report``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import command_line, environment, write_result
from benchmarks.dist_launch import default_gpus, init_group, launch, seconds_left
from benchmarks.gpt2_common import (
    ROOT,
    Clock,
    RunSpec,
    add_common_args,
    default_out,
    find_shards,
    load_yaml_config,
    schedule_for,
    with_model,
    yaml_execution,
)

RECORD_TARGET_FALLBACK = 4.2893  # the record script's final val loss on the novels shards (H100, 127 steps)
SMOKE_VOCAB = 512
# 4 layers: value embeddings in the first and last block only, the layout of the full model
SMOKE_SHAPE = dict(n_layer=4, n_head=2, n_embd=64, vocab_size=SMOKE_VOCAB, vocab_multiple=1, n_value_embeds=1,
                   skip_attn_layers=(2,))


def record_target() -> tuple[float, str]:
    """The record script's final val loss from the newest committed ``gpt2_record_*.json`` (and its file)."""
    for path in sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "gpt2_record_*.json")), reverse=True):
        try:
            with open(path) as f:
                loss = json.load(f)["results"]["record"]["final_val_loss"]
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                return float(loss), os.path.relpath(path, ROOT)
        except (OSError, KeyError, TypeError, ValueError):
            continue
    return RECORD_TARGET_FALLBACK, "built-in (no readable gpt2_record_*.json)"


def _val_tokens(val_path: str, n: int, vocab_mod: int | None) -> torch.Tensor:
    from lightning_opt.data.shards import read_shard

    val = np.asarray(read_shard(val_path)[: n + 1], dtype=np.int64)
    if vocab_mod is not None:
        val = val % vocab_mod
    return torch.from_numpy(val)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val: torch.Tensor,
    seq_len: int,
    batch: int,
    rank: int,
    world: int,
    dev: torch.device,
    amp: str,
    stop_flag: float = 0.0,
) -> tuple[float, bool]:
    """Mean loss over the fixed val windows, each rank a contiguous slice; one all-reduce of the sums.

    ``stop_flag`` (rank 0's "time is up") rides in the same all-reduce, so every rank stops at the same step.
    """
    import torch.distributed as dist

    n_windows = (len(val) - 1) // seq_len
    lo, hi = rank * n_windows // world, (rank + 1) * n_windows // world
    total = torch.zeros(3, dtype=torch.float64, device=dev)
    was_training = model.training
    model.eval()
    for a in range(lo, hi, batch):
        b = min(batch, hi - a)
        buf = val[a * seq_len : (a + b) * seq_len + 1].to(dev, non_blocking=True)
        x, y = buf[:-1].view(b, seq_len), buf[1:].view(b, seq_len)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            # model.forward: the eager function (model.compile() compiles __call__ only), no recompile
            total[0] += model.forward(x, y).double() * b
        total[1] += b
    total[2] = stop_flag if rank == 0 else 0.0
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1]), bool(total[2] > 0)


def _interpolate(curve: list[dict[str, Any]], target: float, key: str) -> float | None:
    """``key`` (train seconds or steps) at which the val curve first reaches ``target`` (linear between points)."""
    prev = None
    for point in curve:
        if point["val_loss"] <= target:
            if prev is None or prev["val_loss"] == point["val_loss"]:
                return float(point[key])
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - point["val_loss"])
            return float(prev[key] + frac * (point[key] - prev[key]))
        prev = point
    return None


def freeze_unused(model: torch.nn.Module) -> list[str]:
    """Freeze the parameters no loss ever reaches, so plain DDP (``find_unused_parameters=False``) can run.

    E.g. a speedrun GPT that creates ``attn.ve_lambda`` in blocks without value embeddings (as ours did
    until that was fixed): DDP then fails after the first backward ("parameters that were not used in
    producing the loss"). A probe forward/backward on 8 tokens finds them; freezing changes nothing (on one
    GPU they get no gradient either) and avoids ``find_unused_parameters=True`` (a graph walk every step).
    Returns their names (recorded in the JSON; empty for a model without such parameters).
    """
    with torch.random.fork_rng():
        x = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
        model(x, x).backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    for name, p in model.named_parameters():
        p.grad = None
        if name in unused:
            p.requires_grad_(False)
    return unused


def run_ddp(
    spec: RunSpec,
    rank: int,
    world: int,
    train_path: str,
    val: torch.Tensor,
    args: argparse.Namespace,
    target: float | None = None,
) -> dict[str, Any]:
    """One training run of ``spec`` through the recipe path on this process group (rank 0's clock)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    use_cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(spec.seed)
    module = GPT2SpeedrunModule(spec.model, spec.optim, schedule_for(spec), spec.execution, compile=spec.compile)
    unused = freeze_unused(module.model)
    dm = TokenShardDataModule(
        train_path, None, seq_len=spec.seq_len, batch_size=spec.micro_batch, shuffle=False
    )
    global_tokens = spec.micro_batch * spec.seq_len * spec.accum * world
    state: dict[str, Any] = {"t_warm": None, "last": 0, "stopped": None, "curve": []}
    end_unix = args.end_unix

    def validate(trainer: Any, pl_module: Any, done: int) -> None:
        clock: Clock = state["clock"]
        t = clock.pause()
        # rank 0 decides whether time is up (keeping a reserve for the sizes' JSON and the exit)
        late = float(end_unix is not None and time.time() > end_unix - args.reserve_s)
        loss, late_all = evaluate(
            pl_module.model,
            val,
            spec.val_seq_len or spec.seq_len,
            spec.val_batch,
            rank,
            world,
            dev,
            spec.amp,
            late,
        )
        clock.resume()
        state["curve"].append(
            {"step": done, "tokens": done * global_tokens, "clock_s": round(t, 3), "val_loss": round(loss, 5)}
        )
        if rank == 0:
            print(f"    [{world} GPU] step {done:>4}  val_loss {loss:.4f}  clock {t:.1f}s", flush=True)
        stop = None
        if not math.isfinite(loss):
            stop = "non-finite loss"
        elif target is not None and loss <= target:
            stop = "target reached"
        elif late_all:
            stop = "time budget"
        if stop and done < spec.steps:
            state["stopped"] = stop
            trainer.should_stop = True  # the same decision on every rank (all-reduced loss and flag)

    class Timing(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            state["clock"] = Clock(dev)

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            done = trainer.global_step
            if done == state["last"]:
                return  # mid accumulation
            state["last"] = done
            if done == spec.warm:
                state["t_warm"] = state["clock"].now()
            if (spec.val_every and done % spec.val_every == 0) or done == spec.steps:
                validate(trainer, pl_module, done)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            state["end"] = state["curve"][-1]["clock_s"] if state["curve"] else state["clock"].now()

    trainer = L.Trainer(
        accelerator="cuda" if use_cuda else "cpu", devices=world, strategy="ddp",
        precision="bf16-mixed" if spec.amp == "bf16" else "32-true",
        max_steps=spec.steps, accumulate_grad_batches=spec.accum, gradient_clip_val=spec.clip,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Timing()],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    steps_done = trainer.global_step
    out: dict[str, Any] = {
        "world": world,
        "steps": steps_done,
        "accum": spec.accum,
        "micro_batch": spec.micro_batch,
        "seq_len": spec.seq_len,
        "global_tokens_per_step": global_tokens,
        "stopped": state["stopped"],
        "train_s_total": state.get("end"),
        "unused_params_frozen": unused,
    }
    warm = min(spec.warm, steps_done)
    if state["t_warm"] is not None and steps_done > warm:
        step_s = (state["end"] - state["t_warm"]) / (steps_done - warm)
        out.update(
            step_ms=round(1e3 * step_s, 2),
            tokens_per_s=round(global_tokens / step_s, 1),
            first_steps_s=round(state["t_warm"], 2),
            compile_s=round(max(0.0, state["t_warm"] - warm * step_s), 2) if spec.compile else 0.0,
        )
        for point in state["curve"]:  # compile excluded: the first warm steps count at the steady step time
            point["train_s"] = round(point["clock_s"] - state["t_warm"] + warm * step_s, 3)
    out["val_curve"] = state["curve"]
    out["final_val_loss"] = state["curve"][-1]["val_loss"] if state["curve"] else None
    if target is not None:
        out["target_loss"] = target
        out["reached_target"] = any(p["val_loss"] <= target for p in state["curve"])
        if state["curve"] and "train_s" in state["curve"][0]:
            out["time_to_target_s"] = _interpolate(state["curve"], target, "train_s")
        out["steps_to_target"] = _interpolate(state["curve"], target, "step")
    out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if use_cuda else None
    return out


def _worker(
    rank: int,
    world: int,
    port: int,
    jobs: list[str],
    args: argparse.Namespace,
    specs: dict[str, RunSpec],
    train_path: str,
    val_path: str,
    out_dir: str,
) -> None:
    """Every job of this world size in one process group; rank 0 writes ``<job>_<world>.json`` after each."""
    import gc

    import torch.distributed as dist

    use_cuda = init_group(rank, world, port, args.smoke, timeout_s=300)
    if use_cuda:
        torch.set_float32_matmul_precision("high")
    val = _val_tokens(val_path, args.val_tokens, SMOKE_VOCAB if args.smoke else None)
    for job in jobs:
        left = seconds_left(args.end_unix)  # the same decision on every rank
        need = args.need_s if job == "throughput" else args.need_s + 30
        t0 = time.perf_counter()
        if left < need:
            result: dict[str, Any] = {
                "world": world,
                "skipped": f"time budget: {left:.0f}s left, needs ~{need:.0f}s",
            }
        else:
            spec = replace(specs[job], accum=specs[job].accum // world)
            try:
                result = run_ddp(
                    spec,
                    rank,
                    world,
                    train_path,
                    val,
                    args,
                    target=args.target_loss if job == "target" else None,
                )
            except Exception as err:  # recorded; the other jobs and sizes still run
                oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
                result = {
                    "world": world,
                    "error": f"{type(err).__name__}: {str(err)[:2000]}",
                    "oom": oom,
                    "traceback": traceback.format_exc()[-3000:],
                }
        result["wall_s"] = round(time.perf_counter() - t0, 2)
        if rank == 0:
            with open(os.path.join(out_dir, f"{job}_{world}.json"), "w") as f:
                json.dump(result, f)
        gc.collect()
        if use_cuda:
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# the call


def make_specs(args: argparse.Namespace, max_world: int) -> dict[str, RunSpec]:
    """The throughput and time-to-target runs; ``accum`` here is the 1-GPU value (divided by N per size)."""
    model, optim, schedule, raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    per_micro = args.micro_batch * args.seq_len
    if args.global_tokens % (per_micro * max_world):
        raise ValueError(
            f"--global-tokens {args.global_tokens} is not divisible by micro-batch x seq-len x GPUs = "
            f"{args.micro_batch} x {args.seq_len} x {max_world}; pick a multiple so every size has whole accumulation"
        )
    spec = RunSpec(
        model,
        optim,
        schedule,
        execution=yaml_execution(raw),
        steps=args.steps,
        micro_batch=args.micro_batch,
        accum=args.global_tokens // per_micro,
        seq_len=args.seq_len,
        compile=not args.no_compile,
        amp="fp32" if args.smoke else "bf16",
        warm=args.warm,
        val_every=0,
        val_batch=args.val_batch,
    )
    if args.smoke:
        spec = with_model(spec, block_size=args.seq_len, **SMOKE_SHAPE)
    specs = {"throughput": spec}
    if args.target_steps:
        specs["target"] = replace(spec, steps=args.target_steps, val_every=args.target_val_every)
    return specs


def _smoke_shards(data_dir: str | None) -> tuple[str, str]:
    """Small-vocabulary shards for the smoke run: the novels tokens mod 512 if present, else a synthetic text."""
    from lightning_opt.data.shards import read_shard, write_shard

    out = Path(tempfile.mkdtemp(prefix="gpt2_ddp_smoke_"))
    try:
        train, val = find_shards(data_dir)
        tr = np.asarray(read_shard(train)[:200_000]) % SMOKE_VOCAB
        va = np.asarray(read_shard(val)[:20_000]) % SMOKE_VOCAB
    except FileNotFoundError:  # a repeating pattern with noise: learnable in a few steps
        rng = np.random.default_rng(0)
        base = np.tile(rng.integers(0, SMOKE_VOCAB, 97), 2400)
        noise = rng.integers(0, SMOKE_VOCAB, base.size)
        tokens = np.where(rng.random(base.size) < 0.1, noise, base)
        tr, va = tokens[:200_000], tokens[200_000:220_000]
    write_shard(out / "smoke_train.bin", tr.astype(np.uint16))
    write_shard(out / "smoke_val.bin", va.astype(np.uint16))
    return str(out / "smoke_train.bin"), str(out / "smoke_val.bin")


def summarize(rows: list[dict[str, Any]], target_row: dict[str, Any] | None) -> dict[str, Any]:
    """Scaling efficiency per size (measured tokens/s) and the time to target (measured, then estimated)."""
    by_world = {r["world"]: r for r in rows if r.get("tokens_per_s")}
    base = by_world.get(1)
    s: dict[str, Any] = {"tokens_per_s": {w: r["tokens_per_s"] for w, r in by_world.items()}}
    if base:
        s["speedup_vs_1gpu"] = {
            w: round(r["tokens_per_s"] / base["tokens_per_s"], 4) for w, r in by_world.items()
        }
        s["scaling_efficiency"] = {
            w: round(r["tokens_per_s"] / (w * base["tokens_per_s"]), 4) for w, r in by_world.items()
        }
        for r in rows:
            if r["world"] in s["scaling_efficiency"]:
                r["speedup_vs_1gpu"] = s["speedup_vs_1gpu"][r["world"]]
                r["scaling_efficiency"] = s["scaling_efficiency"][r["world"]]
    if target_row is not None:
        s["target_loss"] = target_row.get("target_loss")
        s["target_world"] = target_row.get("world")
        s["target_reached"] = target_row.get("reached_target")
        s["time_to_target_s"] = target_row.get("time_to_target_s")
        s["steps_to_target"] = target_row.get("steps_to_target")
        steps = target_row.get("steps_to_target")
        if steps is not None:
            # same global batch and data order at every size: the steps to the target do not depend on N
            s["estimated_time_to_target_s"] = {
                w: round(steps * r["step_ms"] / 1e3, 2) for w, r in by_world.items()
            }
    return s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, 330.0)
    p.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        default=None,
        help="world sizes (default: 1 and every power of two up to the GPU count; --smoke: 1 2)",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per size (throughput run)")
    p.add_argument("--warm", type=int, default=4, help="steps excluded from tokens/s (compile happens here)")
    p.add_argument("--global-tokens", type=int, default=524_288, help="tokens per optimizer step, all GPUs")
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per micro-batch per GPU")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--val-batch", type=int, default=32)
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="val loss to reach (default: the record script's, from benchmarks/results/gpt2_record_*.json)",
    )
    p.add_argument(
        "--target-steps",
        type=int,
        default=256,
        help="schedule length of the time-to-target run at the largest size (0: skip it)",
    )
    p.add_argument("--target-val-every", type=int, default=16)
    p.add_argument(
        "--target-world", type=int, default=None, help="size of the time-to-target run (default: largest)"
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--need-s", type=float, default=40.0, help="a run starts only with this much time left")
    p.add_argument(
        "--reserve-s", type=float, default=15.0, help="the target run stops this long before the end"
    )
    p.add_argument("--grace-s", type=float, default=20.0, help="a launch is killed this long after the end")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.smoke else 0
    if args.gpus is None:
        args.gpus = [1, 2] if args.smoke else default_gpus(gpus)
    args.gpus = sorted(set(args.gpus))
    if args.gpus[0] < 1 or (not args.smoke and args.gpus[-1] > max(gpus, 1)):
        p.error(f"--gpus {args.gpus}: sizes must be >= 1 and at most the {gpus} GPUs present")
    target_source = "--target-loss"
    if args.smoke:
        args.steps, args.warm, args.micro_batch, args.seq_len = 4, 1, 4, 64
        args.global_tokens = args.micro_batch * args.seq_len * 2 * args.gpus[-1]
        args.val_tokens, args.val_batch, args.no_compile, args.need_s = 4096, 8, True, 0.0
        args.target_steps, args.target_val_every = min(args.target_steps, 6), 2
        if args.target_loss is None:
            args.target_loss, target_source = (
                5.9,
                "smoke default (vocabulary 512: ln 512 = 6.24 at the start)",
            )
    if args.target_loss is None:
        args.target_loss, target_source = record_target()
    if args.end_unix is None:
        args.end_unix = time.time() + args.deadline_s
    target_world = args.target_world or args.gpus[-1]
    if target_world not in args.gpus:
        p.error(f"--target-world {target_world} is not one of --gpus {args.gpus}")
    specs = make_specs(args, args.gpus[-1])
    if args.smoke:  # imported once here, inherited by the forked processes
        import lightning.pytorch  # noqa: F401

        import lightning_opt.modules.gpt2  # noqa: F401
    train_path, val_path = (
        _smoke_shards(args.data_dir) if args.smoke else map(str, find_shards(args.data_dir))
    )

    out_path = (
        Path(args.out)
        if args.out
        else default_out("gpt2_ddp_scaling_smoke" if args.smoke else "gpt2_ddp_scaling")
    )
    env = environment()
    env["devices"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
    target = {"loss": args.target_loss, "source": target_source}
    payload: dict[str, Any] = {
        "smoke": args.smoke, "data": {"train": train_path, "val": val_path}, "settings": vars(args),
        "spec": specs["throughput"].describe(), "rows": [], "target_run": None, "summary": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        # 1 GPU first (the baseline), then the largest sizes (the point of the run) while time is fresh; the
        # time-to-target run last, in its own process group, with whatever time is left
        order = args.gpus[:1] + sorted(args.gpus[1:], reverse=True)
        launches = [(w, ["throughput"]) for w in order]
        if "target" in specs and order[-1] == target_world:
            launches[-1] = (target_world, ["throughput", "target"])  # no second start-up and compile
        elif "target" in specs:
            launches.append((target_world, ["target"]))
        for world, jobs in launches:
            left = args.end_unix - time.time()
            print(f"[{world} GPU] {', '.join(jobs)} ({left:.0f}s left)", flush=True)
            if left < args.need_s + 15:  # process start-up on top of one run
                launch_error = f"skipped: time budget ({left:.0f}s left)"
            else:
                launch_error = launch(_worker, (jobs, args, specs, train_path, val_path, tmp), world, args.smoke,
                                      args.end_unix, args.grace_s)
            for job in jobs:
                path = os.path.join(tmp, f"{job}_{world}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        row = json.load(f)
                else:
                    row = {
                        "world": world,
                        ("skipped" if launch_error.startswith("skipped") else "error"): launch_error,
                    }
                row["job"] = job
                if job == "throughput":
                    payload["rows"].append(row)
                    payload["rows"].sort(key=lambda r: r["world"])
                else:
                    payload["target_run"] = row
            payload["summary"] = summarize(payload["rows"], payload["target_run"])
            # after every size: a later crash keeps what was measured
            write_result(out_path, benchmark="gpt2_ddp_scaling", env=env, command=command_line(argv), baseline=None,
                         results=payload, goals=target)
    print_table(payload, env, target)
    print(f"wrote {out_path}")
    return payload


def print_table(payload: dict[str, Any], env: dict[str, Any], target: dict[str, Any]) -> None:
    print(
        f"\n{'GPUs':>4} {'accum':>5} {'tok/s':>11} {'x 1 GPU':>8} {'eff':>6} {'step ms':>8} {'compile s':>9} "
        f"{'val loss':>9} {'peak GiB':>8}"
    )
    for r in payload["rows"]:
        if "tokens_per_s" not in r:
            print(f"{r['world']:>4} {r.get('error') or r.get('skipped') or 'no timing'}"[:160])
            continue
        val = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-"
        print(
            f"{r['world']:>4} {r['accum']:>5} {r['tokens_per_s']:>11,.0f} {r.get('speedup_vs_1gpu', math.nan):>8.3f} "
            f"{r.get('scaling_efficiency', math.nan):>6.3f} {r['step_ms']:>8.1f} {r.get('compile_s', 0):>9.1f} "
            f"{val:>9} {r.get('peak_mem_gib') or '-':>8}"
        )
    t = payload.get("target_run") or {}
    if t:
        print(
            f"time to target {target['loss']} at {t.get('world')} GPUs: "
            f"{t.get('time_to_target_s') if t.get('reached_target') else 'not reached'} "
            f"(steps {t.get('steps_to_target')}, final val {t.get('final_val_loss')}, "
            f"stopped: {t.get('stopped') or t.get('error') or t.get('skipped')})"
        )
    print(f"summary: {json.dumps(payload['summary'])}")
    print(
        f"devices: {env.get('devices') or env['device']}  torch {env['torch']}  lightning {env['lightning']}"
    )


if __name__ == "__main__":
    main()
