"""Time to target: a modded-nanogpt record script (2025-01-04 by default; ``--record`` 2025-07-13 or 2025-08-23)
vs our speedrun recipe, same GPU, same budget.

1. The record script (the code at the top of its log, exported to the git-ignored ``.peers/modded-nanogpt/``
   and patched by ``benchmarks/peers/patch_record.py`` in only its data paths, iteration count and val
   token count; the 2025-07-13 one also in its training forward/backward, wrapped in the accumulation loop
   of the later records) runs on one GPU through ``torchrun`` for ``--steps`` iterations of 524,288 tokens
   (127 = 4 passes over the novels train shard; 169 of 393,216 for 2025-07-13 and 2025-08-23). Its final val
   loss is the target.
2. Ours (``gpt2-124m-speedrun`` through GPT2SpeedrunModule + TokenShardDataModule + Trainer, bf16-mixed,
   compile, 32 x 1024 x 16 = 524,288 tokens per step, the same schedule length) validates every
   ``--ours-val-every`` steps off the clock and stops at the target or when the call's time is up; the time
   to target is interpolated between val points. Deciding the goal (<= 0.75x the record's time) needs at
   most 0.75x the record's training time, so ours runs second with what is left.

Clocks: compile and validation excluded for both. The record script resets its clock after step 10 and so
leaves 10 steps out; ``record_train_s_adjusted`` adds them back at its steady step time, as our clock counts
every step. The two val losses are over the same first ``--val-tokens`` val tokens. The record evaluates
with its own attention (64k-token sequences, document-causal sliding window); ours with 1024-token windows,
or, in the ``*-long`` variants and ``recipe`` (the shipped config as it is, at 0.8 of the record's budget),
the record's way as the config sets it (65,536-token document-causal sequences, the window where the schedule
is), so equal numbers mean comparable, not identical, models.

    python -m benchmarks.gpt2_record                  # GPU, about 8 minutes on an H100
    python -m benchmarks.gpt2_record --steps 64       # half the budget if the call must be shorter
    python -m benchmarks.gpt2_record --smoke          # CPU: patch + log parsing + our side on a tiny model
    python -m benchmarks.gpt2_record --ours half-batch --ours half-batch-long   # the record once, then each
                                                      # variant of ours (OURS_VARIANTS) until the target

Writes ``benchmarks/results/gpt2_record_<device>_<date>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import command_line, environment, write_result
from benchmarks.gpt2_common import (
    RunSpec,
    Tokens,
    add_common_args,
    deadline_from,
    default_out,
    device,
    find_shards,
    guarded,
    load_yaml_config,
    smoke_shard,
    train_bare,
    train_lightning,
    with_compile_options,
    with_model,
    yaml_compile_options,
    yaml_execution,
)
from benchmarks.peers.patch_record import DEFAULT_RECORD, RECORDS, record_data, write_patched

RECORD_TOKENS_PER_STEP = RECORDS[DEFAULT_RECORD].tokens_per_step
_VAL = re.compile(r"step:(\d+)/(\d+) val_loss:([\d.]+|nan) train_time:(\d+)ms")
_TRAIN = re.compile(r"step:(\d+)/(\d+) train_time:(\d+)ms step_avg:([\d.]+|nan)ms")
_PEAK = re.compile(r"peak memory (?:consumption|allocated): (\d+) MiB")


def parse_record_log(text: str, warm_reset: int = 10, tokens_per_step: int = RECORD_TOKENS_PER_STEP) -> dict[str, Any]:
    """Numbers from the record script's console output (its ``print0(..., console=True)`` lines).
    ``warm_reset``: the steps its clock leaves out (10 for 2025-01-04, 0 for 2025-07-13 and 2025-08-23, which
    compile in warm-up steps before the clock and then restore the initial state)."""
    found = _VAL.findall(text)
    vals = [(int(s), float(v), int(t) / 1000) for s, _, v, t in found]
    planned = int(found[-1][1]) if found else None
    trains = [(int(s), int(t) / 1000, float(a)) for s, _, t, a in _TRAIN.findall(text)]
    out: dict[str, Any] = {"val_points": len(vals), "train_lines": len(trains)}
    steady = [a for s, _, a in trains if s > warm_reset + 1 and a == a]  # a == a: not NaN
    step_s = steady[-1] / 1000 if steady else None
    if step_s:
        out["step_ms"] = round(1000 * step_s, 2)
        out["tokens_per_s"] = round(tokens_per_step / step_s, 1)
    first = next((t for s, t, _ in trains if s == 1), None)
    if first is not None and step_s and warm_reset:
        out["first_step_s"] = round(first, 2)  # includes compile (and the step-0 validation compile)
        out["compile_s"] = round(max(0.0, first - step_s), 2)
    curve = []
    for step, loss, t in vals:
        # its clock restarts after step `warm_reset`: add those steps back at the steady step time
        adj = t + (warm_reset * step_s if step_s and step > warm_reset else 0.0)
        curve.append({"step": step, "tokens": step * tokens_per_step, "val_loss": loss,
                      "record_clock_s": round(t, 3), "train_s": round(adj, 3)})
    out["val_curve"] = curve
    if curve:
        out["last_val_loss"] = curve[-1]["val_loss"]
        out["steps"] = curve[-1]["step"]
        out["planned_steps"] = planned
        # only a finished run sets the target (a stopped one's last val may be the step-0 one)
        out["final_val_loss"] = curve[-1]["val_loss"] if curve[-1]["step"] == planned else None
        out["record_train_s"] = curve[-1]["record_clock_s"]
        out["record_train_s_adjusted"] = curve[-1]["train_s"]
    peak = _PEAK.findall(text)
    if peak:
        out["peak_mem_gb"] = round(int(peak[-1]) / 1024, 2)
    return out


def run_record(train: Path, val: Path, steps: int, val_tokens: int, timeout_s: float,
               source: Path | None = None, record: str = DEFAULT_RECORD) -> dict[str, Any]:
    rec = RECORDS[record]
    workdir = tempfile.mkdtemp(prefix="record_run_")  # it writes logs/<uuid>.txt into the working dir
    # the 2025-08-23 script names its log logs/final/<uuid>.txt and creates only logs/ (its repository has
    # logs/final checked in)
    (Path(workdir) / "logs" / "final").mkdir(parents=True)
    train_s, val_s = record_data(record, train, val, steps, val_tokens, Path(workdir) / "data")
    # a fresh copy per run: concurrent runs (one per GPU, other corpora) never share the patched script
    script = write_patched(train_s, val_s, steps, val_tokens, record=record, source=source,
                           dest=Path(tempfile.mkdtemp(prefix="record_src_")) / "train_gpt.py")
    t_start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)]
    print("  $ " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines arrive as printed, and survive a timeout kill
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)  # its own process group: a timeout kills the workers too
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "val_loss" in line or "peak memory" in line or re.search(r"step:(1|10|50|100)/", line) \
                    or "Error" in line or "error" in line:
                print("  | " + line.rstrip()[:300], flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    text = "".join(lines)
    out = parse_record_log(text, rec.warm_reset, rec.tokens_per_step)
    out.update(returncode=proc.returncode, timed_out=timed_out, command=" ".join(cmd), script=str(script),
               wall_s=round(time.perf_counter() - t_start, 1), train_data=train_s, val_data=val_s,
               log_tail=text[-3000:])
    if timed_out:
        out["error"] = f"record script stopped after the {timeout_s:.0f}s it was given"
    elif proc.returncode != 0:
        out["error"] = f"record script exited with {proc.returncode}"
    return out


# named variants of ours for one call with several runs after the record.
# name: (micro-batches of 32 x 1024 tokens per step, 65,536-token sequences?, schedule length as a fraction of
# the record's token budget[, GPTConfig overrides, with OptimConfig ones under "optim"]). A run stops at the target wherever its schedule is; a
# shorter schedule ends its learning-rate cooldown earlier.
NO_FP8_MATMULS = {"mlp_fp8": False, "attn_fp8": False}
OURS_VARIANTS: dict[str, tuple] = {
    "default": (16, False, 1.0),  # the record's batch: 16 x 32 x 1024 tokens per step
    "half-batch": (8, False, 1.0),  # 262,144 tokens per step, twice the steps
    "long": (16, True, 1.0),  # 65,536-token document-causal sequences, the recipe's growing window
    "half-batch-long": (8, True, 1.0),
    "half-batch-80": (8, False, 0.8),
    "half-batch-85": (8, False, 0.85),
    # the recipe without its FP8 MLP and attention projections: isolates their loss cost
    "half-batch-85-nofp8mm": (8, False, 0.85, NO_FP8_MATMULS),
    # ... without learned norm gains (norm_weight: false, as the record script)
    "half-batch-85-nonormw": (8, False, 0.85, {"norm_weight": False}),
    "half-batch-85-qkgain": (8, False, 0.85, {"norm_weight": "qk"}),  # gains in QK-norm only
    # inductor's coordinate-descent kernel tuning on / off (same maths, other kernel launch settings)
    "half-batch-85-cdt": (8, False, 0.85, {"compile_options": {"coordinate_descent_tuning": True}}),
    "half-batch-85-nocdt": (8, False, 0.85, {"compile_options": {"coordinate_descent_tuning": False}}),
    # Muon with a quintic per Newton-Schulz step (the "optim" entry overrides OptimConfig fields)
    "half-batch-85-polar": (8, False, 0.85, {"optim": {"muon_ns_coefficients": "polar_express"}}),
    "half-batch-85-normuon": (8, False, 0.85, {"optim": {"muon_normuon_beta2": 0.95}}),
    "half-batch-long-80": (8, True, 0.8),
    "half-batch-long-70": (8, True, 0.7),
    "half-batch-long-75": (8, True, 0.75),
    # the window growing 128 -> 1024 (the recipe's), or to 1792 as the 2025-01-04 record's
    "half-batch-long-80-w1k": (8, True, 0.8, {"window_schedule": (128, 1024)}),
    "half-batch-long-80-w1856": (8, True, 0.8, {"window_schedule": (128, 1856)}),
    "quarter-batch-long": (4, True, 1.0),
    "quarter-batch-long-80": (4, True, 0.8),
}


def recipe_geometry(name: str = "gpt2-124m-speedrun") -> tuple[int, bool]:
    """The shipped config's geometry as OURS_VARIANTS counts it: (its tokens per optimizer step, data.batch_size x
    data.seq_len x trainer.accumulate_grad_batches, in micro-batches of 32 x 1024 tokens; long sequences?)."""
    raw = load_yaml_config(name)[3]
    data = raw["data"]
    tokens = data["batch_size"] * data["seq_len"] * (raw["trainer"].get("accumulate_grad_batches") or 1)
    if tokens % (32 * 1024):
        raise ValueError(f"{name}.yaml: {tokens} tokens per step is not a whole number of 32 x 1024-token micro-batches")
    return tokens // (32 * 1024), data["seq_len"] > 1024


# the shipped config as it is (its geometry and tokens per step), its train_tokens scaled to 0.8 of the record's budget
OURS_VARIANTS["recipe"] = (*recipe_geometry(), 0.8)


def apply_overrides(spec: RunSpec, overrides: dict[str, Any]) -> RunSpec:
    """A variant's overrides: ``GPTConfig`` / ``GPTExecution`` fields, ``OptimConfig`` fields under the key ``"optim"``, and
    inductor settings (merged into the recipe's) under ``"compile_options"``."""
    overrides = dict(overrides)
    if "compile_options" in overrides:
        spec = with_compile_options(spec, **overrides.pop("compile_options"))
    if "optim" in overrides:
        spec = replace(spec, optim=replace(spec.optim, **overrides.pop("optim")))
    return with_model(spec, **overrides)


def parse_model_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for one ``GPTConfig`` or ``GPTExecution`` field; the value is read as YAML (``true``, ``auto``, ``15.0``)."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--ours-model {item!r}: expected KEY=VALUE, e.g. mlp_fp8=auto")
    return key.strip(), yaml.safe_load(value)


def ours_spec(args: argparse.Namespace, target: float | None, accum: int, long: bool, budget: float = 1.0) -> RunSpec:
    """Our run for ``budget`` times the record's token budget: ``accum`` micro-batches of 32 x 1024 per step
    (or the same tokens in the shipped config's own sequence geometry with ``long``: 65,536-token document-causal
    sequences, FlexAttention with a growing window)."""
    sp_model, sp_optim, sp_sched, sp_raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    if 16 % accum:
        raise ValueError(f"accum={accum} must divide 16 (our 32 x 1024-token micro-batches per 524,288-token step)")
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget={budget} must be in (0, 1]: the fraction of the record's token budget")
    # the record's token budget (its steps x its tokens per step) in our steps of 32 x 1024 x accum tokens
    per_f = RECORDS[getattr(args, "record", DEFAULT_RECORD)].tokens_per_step / (32 * 1024 * accum)
    per = max(1, round(per_f))  # our steps per record step, for warm-up and validation spacing
    steps = max(1, round(args.steps * per_f * budget))
    mb = getattr(args, "ours_micro_batch", 32)
    if (32 * accum) % mb:
        raise ValueError(f"--ours-micro-batch {mb} must divide the {32 * accum} sequences of a step")
    spec = RunSpec(sp_model, sp_optim, sp_sched, yaml_execution(sp_raw), steps=steps, micro_batch=mb, accum=32 * accum // mb,
                   seq_len=1024, compile=True, amp="bf16", warm=3 * per, val_every=args.ours_val_every * per,
                   stop_at_loss=target, compile_options=yaml_compile_options(sp_raw))
    if args.smoke:
        spec = with_model(replace(spec, steps=6, micro_batch=4, accum=2, seq_len=64, compile=False, amp="fp32",
                                  warm=1, val_every=2),
                          n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512, vocab_multiple=1,
                          n_value_embeds=1, skip_attn_layers=(1,))
    if long:
        # the same tokens per step in the config's sequence geometry: micro-batches of data.batch_size sequences
        # of data.seq_len tokens, its attention (document-causal, growing window, backend)
        lg_model, _, _, lg_raw = load_yaml_config("gpt2-124m-speedrun")
        long_t = 256 if args.smoke else lg_raw["data"]["seq_len"]
        long_b = lg_raw["data"]["batch_size"]
        tokens_per_step = spec.micro_batch * spec.seq_len * spec.accum
        if tokens_per_step % (long_b * long_t):
            raise ValueError(f"{tokens_per_step} tokens per step is not a whole number of {long_b} x {long_t}-token "
                             "micro-batches; use more micro-batches per step (--ours-accum) with --ours-long")
        spec = with_model(replace(spec, seq_len=long_t, micro_batch=long_b, accum=tokens_per_step // (long_b * long_t),
                                  val_batch=long_b),
                          block_size=long_t, attn_backend=yaml_execution(lg_raw).attn_backend,
                          doc_causal=lg_model.doc_causal,
                          window_schedule=(32, 128) if args.smoke else lg_model.window_schedule,
                          eot_token=lg_model.eot_token % spec.model.vocab_size)  # smoke vocabularies are tokens mod 512
    if args.ours_loss_impl:
        spec = with_model(spec, loss_impl=args.ours_loss_impl)
    for item in getattr(args, "ours_model", None) or []:
        key, value = parse_model_override(item)
        spec = with_model(spec, **{key: value})
    return spec


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, 530.0)
    p.add_argument("--record", default=DEFAULT_RECORD, choices=sorted(RECORDS),
                   help="which modded-nanogpt record script sets the target (benchmarks/peers/patch_record.py)")
    p.add_argument("--steps", type=int, default=None,
                   help="the record's iterations (default: 4 passes over the 16.6M-token train shard: 127 of "
                        "524,288 tokens for 2025-01-04, 169 of 393,216 for 2025-07-13 and 2025-08-23); ours gets "
                        "the same tokens")
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--ours-val-every", type=int, default=8)
    p.add_argument("--ours-runner", default="lightning", choices=["lightning", "bare"])
    p.add_argument("--ours-min-s", type=float, default=150.0,
                   help="seconds the record script's run leaves for ours (its timeout is the rest)")
    p.add_argument("--ours-accum", type=int, default=16,
                   help="our micro-batches (32 x 1024) per step; fewer = smaller batches, proportionally more "
                        "steps for the same token budget (the schedule follows)")
    p.add_argument("--ours-long", action="store_true",
                   help="ours on the record's geometry: 65,536-token sequences, document-causal FlexAttention with "
                        "a window growing 128 -> 1024 (the geometry of lightning_opt/recipes/configs/gpt2/"
                        "gpt2-124m-speedrun.yaml); "
                        "tokens per step as --ours-accum says")
    p.add_argument("--ours-micro-batch", type=int, default=32,
                   help="1024-token sequences per micro-batch for ours (the same tokens per step in fewer, larger "
                        "micro-batches with 64)")
    p.add_argument("--ours-budget", type=float, default=1.0,
                   help="our schedule's length as a fraction of the record's token budget (the cooldown ends there)")
    p.add_argument("--ours-loss-impl", default=None, choices=["torch", "chunked", "chunked_fp8", "fused"],
                   help="override the config's loss_impl for our run (the recipe's head_fp8: auto then applies as "
                        "it does for that loss: all three head matmuls in FP8 with 'torch', none with 'chunked')")
    p.add_argument("--ours-model", action="append", default=None, metavar="KEY=VALUE",
                   help="override one GPTConfig field of our run (repeatable), e.g. mlp_fp8=auto")
    p.add_argument("--target", type=float, default=None, help="use this target (skips the record run)")
    p.add_argument("--ours", action="append", choices=sorted(OURS_VARIANTS), default=None,
                   help="run this variant of ours after the record (repeat for several, each until the target "
                        "or the call's deadline); default: one run as --ours-accum / --ours-long say")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = round(127 * 524_288 / RECORDS[args.record].tokens_per_step)
    rec_name = f"record-{args.record}"
    deadline = deadline_from(args)
    dev = device()
    train_path, val_path = find_shards(args.data_dir)
    out_path = Path(args.out) if args.out else default_out("gpt2_record_smoke" if args.smoke else "gpt2_record")
    env = environment()
    payload: dict[str, Any] = {"smoke": args.smoke, "settings": vars(args), "results": {}}

    def write() -> None:
        write_result(out_path, benchmark="gpt2_record", env=env, command=command_line(argv), baseline=None,
                     results=payload)

    # 1. the record script, in its own process; it sets the target
    if args.target is not None:
        record: dict[str, Any] = {"name": rec_name, "skipped": "--target given", "final_val_loss": args.target}
    elif args.smoke or dev.type != "cuda":
        # it needs CUDA and NCCL: on CPU prove the patch and the log parsing instead
        record = guarded(rec_name, lambda: _smoke_record(train_path, val_path, args))
    else:
        record = guarded(rec_name, lambda: run_record(
            train_path, val_path, args.steps, args.val_tokens, deadline.left() - args.ours_min_s,
            record=args.record), deadline, 60)
    record.setdefault("name", rec_name)
    payload["results"]["record"] = record
    write()
    target = record.get("final_val_loss")

    # 2. ours, same budget, until it reaches the target or the call's time is up. Deciding the goal
    # (<= 0.75x the record's time) needs at most 0.75x the record's training time, plus compile.
    data = Tokens(train_path, val_path, dev, val_tokens=4096 if args.smoke else args.val_tokens,
                  train_tokens=1_000_000 if args.smoke else None, vocab_mod=512 if args.smoke else None)
    lightning_train = smoke_shard(data) if args.smoke else train_path
    variants = args.ours or [None]  # None: --ours-accum / --ours-long as given
    payload["summaries"] = {}
    for i, name in enumerate(variants):
        accum, long, budget, *extra = ((args.ours_accum, args.ours_long, args.ours_budget) if name is None
                                       else OURS_VARIANTS[name])
        spec = ours_spec(args, target, accum, long, budget)
        if extra:
            spec = apply_overrides(spec, extra[0])
        # the run's clock leaves validation out: keep a margin for it and for teardown; later variants in
        # the call get what is left
        spec = replace(spec, deadline_unix=time.time() + max(20.0, deadline.left() - 25))
        key = "ours" if i == 0 else f"ours-{name}"
        label = f"ours-speedrun-{args.ours_runner}" + (f"-{name}" if name else "")
        if args.ours_runner == "lightning":
            ours = guarded(label, lambda spec=spec: train_lightning(spec, data, lightning_train, "none"), deadline, 30)
        else:
            ours = guarded(label, lambda spec=spec: train_bare(spec, data), deadline, 30)
        ours["variant"] = {"name": name or "as given", "accum": accum, "long": long, "budget": budget,
                           "model_overrides": extra[0] if extra else {}}
        payload["results"][key] = ours
        payload["summaries"][key] = summarize(record, ours, target)
        if i == 0:
            payload["summary"] = payload["summaries"][key]
        write()
    print_table(payload)
    print(f"wrote {out_path}")
    return payload


def _smoke_record(train: Path, val: Path, args: argparse.Namespace) -> dict[str, Any]:
    rec = RECORDS[args.record]
    work = Path(tempfile.mkdtemp(prefix="record_smoke_"))
    train_s, val_s = record_data(args.record, train, val, args.steps, args.val_tokens, work / "data")
    script = write_patched(train_s, val_s, args.steps, args.val_tokens, dest=work / "train_gpt.py",
                           record=args.record)
    text = script.read_text()
    w = rec.warm_reset
    log = "\n".join(
        [f"step:0/{args.steps} val_loss:10.8258 train_time:0ms step_avg:nanms",
         f"step:1/{args.steps} train_time:60000ms step_avg:nanms"]
        + [f"step:{s}/{args.steps} train_time:{(s - w) * 1100}ms step_avg:1100.00ms" for s in range(w + 1, w + 10)]
        + [f"step:{args.steps}/{args.steps} val_loss:4.5000 train_time:{(args.steps - w) * 1100}ms "
           "step_avg:1100.00ms", "peak memory consumption: 30000 MiB"])
    out = parse_record_log(log, w, rec.tokens_per_step)
    out.update(smoke=True, patched_script=str(script), patched_lines=int(f"num_iterations = {args.steps}" in text),
               train_data=train_s, val_data=val_s)
    return out


def time_to_target(curve: list[dict[str, Any]], target: float) -> tuple[dict | None, float | None]:
    """First val point at or below ``target``, and the time linearly interpolated from the point before."""
    prev = None
    for row in curve:
        if row.get("train_s") is None:
            continue
        if row["val_loss"] <= target:
            if prev is None or prev["val_loss"] == row["val_loss"]:
                return row, row["train_s"]
            f = (prev["val_loss"] - target) / (prev["val_loss"] - row["val_loss"])
            return row, round(prev["train_s"] + f * (row["train_s"] - prev["train_s"]), 3)
        prev = row
    return None, None


def summarize(record: dict, ours: dict, target: float | None) -> dict[str, Any]:
    s: dict[str, Any] = {"target_val_loss": target}
    rec_t = record.get("record_train_s_adjusted")
    hit, interp = time_to_target(ours.get("val_curve", []), target) if target is not None else (None, None)
    s["ours_reached_target"] = hit is not None
    s["ours_time_to_target_s"] = hit["train_s"] if hit else None
    s["ours_time_to_target_s_interpolated"] = interp
    s["ours_steps_to_target"] = hit["step"] if hit else None
    s["ours_final_val_loss_same_budget"] = ours.get("final_val_loss")
    s["record_time_s_adjusted"] = rec_t
    s["record_time_s_as_it_reports"] = record.get("record_train_s")
    if interp is not None and rec_t:
        # both clocks count every step at its steady time (the record's adjusted one adds back the 10 steps
        # its own clock leaves out): the goal's ratio
        s["time_ratio_ours_over_record"] = round(interp / rec_t, 4)
        s["goal_le_0p75"] = s["time_ratio_ours_over_record"] <= 0.75
    if interp is not None and record.get("record_train_s") and ours.get("step_ms"):
        # the record script's own clock (its first 10 steps left out) against ours without its first 10 steps
        # (the rule as the record applies it) or without the record's first 10 steps' worth of tokens (10 *
        # 524,288: more of our steps when ours takes fewer tokens per step)
        rec_s = record["record_train_s"]
        s["time_ratio_both_without_first_10_steps"] = round((interp - 10 * ours["step_ms"] / 1000) / rec_s, 4)
        accum = (ours.get("variant") or {}).get("accum", 16)  # micro-batches of 32 x 1024 per step
        per = 16 // accum if accum and 16 % accum == 0 else 1  # our steps per record step
        s["time_ratio_both_without_first_10_record_steps_of_tokens"] = round(
            (interp - 10 * per * ours["step_ms"] / 1000) / rec_s, 4)
    if ours.get("tokens_per_s") and record.get("tokens_per_s"):
        s["tokens_per_s_ratio_ours_over_record"] = round(ours["tokens_per_s"] / record["tokens_per_s"], 4)
    return s


def print_table(payload: dict[str, Any]) -> None:
    print()
    print(f"{'run':28} {'tok/s':>10} {'step ms':>8} {'compile s':>9} {'peak GB':>8} {'final val':>9} {'train s':>8}")
    for name, r in payload["results"].items():
        if r.get("error") and "tokens_per_s" not in r:
            print(f"{name:28} {r['error'][:120]}")
            continue
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        step = f"{r['step_ms']:.1f}" if r.get("step_ms") else "-"
        peak = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") else "-"
        val = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-"
        ts = r.get("record_train_s_adjusted") or r.get("train_s")
        print(f"{name:28} {tps:>10} {step:>8} {r.get('compile_s') or 0:>9.1f} {peak:>8} {val:>9} "
              f"{(ts or 0):>8.1f}")
    for name, summary in (payload.get("summaries") or {"ours": payload.get("summary", {})}).items():
        print(f"  [{name}]")
        for k, v in summary.items():
            print(f"    {k}: {v}")


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
