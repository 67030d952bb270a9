"""Acceptance run of the documented commands: every GPU-relevant recipe command of README.md and docs/, through
the console scripts, long enough to pass every phase of its run, at each number of GPUs.

    python -m benchmarks.documented_commands --gpus 1,2,4 --deadline-s 480
    python -m benchmarks.documented_commands --cpu-smoke          # gloo, tiny, 1 and 2 processes

Each command runs as a subprocess in its own folder (``--work-dir``, default a temporary one), as a user types
it plus the overrides that shrink it: a few steps past each phase (the GPT-2 speedrun's warm-up, cooldown and
validation; the CLT's dead-feature window so AuxK runs, dead-feature resampling, validation, the LR decay; the SPD
warm-up), then the commands that continue a run (``--ckpt_path`` resume, ``lightning-opt-sample``). Data comes
from the recipes' built-in offline corpus and demo targets (a GPU machine without internet suffices);
commands that need downloads (GPT-2 weights, FineWeb shards) are listed as skipped with the reason.

Writes ``benchmarks/results/documented_commands_<device>.json`` (``--out`` elsewhere): per command its name,
where it is documented, the command line, GPUs, passed, seconds, steady tokens/s (the run's ``metrics.json``),
the phases seen in its logs (CLT: AuxK steps and resampled features), and the tail of its output when it failed.
``--deadline-s`` stops starting commands once that many seconds have passed; the file is written either way.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._results import RESULTS, command_line, device_slug, environment, write_result

ROOT = Path(__file__).resolve().parents[1]

STRATEGIES = {
    "decoder_sharding_shard_encoder": ["--trainer.strategy.class_path", "lightning_opt.strategies.DecoderShardingStrategy",
                                       "--trainer.strategy.init_args.shard_encoder", "true"],
    "decoder_sharding": ["--trainer.strategy.class_path", "lightning_opt.strategies.DecoderShardingStrategy",
                         "--trainer.strategy.init_args.shard_encoder", "false"],
    "global_batchtopk": ["--trainer.strategy.class_path", "lightning_opt.strategies.GlobalBatchTopKStrategy"],
    "fsdp_global_batchtopk": ["--trainer.strategy.class_path", "lightning_opt.strategies.FSDPGlobalBatchTopKStrategy"],
}
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@dataclass
class Command:
    """One documented command at one GPU count, with the overrides that take it through its phases quickly."""

    name: str
    script: str  # console script: lightning-opt-gpt2 | -clt | -spd | -sample
    args: list[str]
    gpus: int
    doc: str  # where the command is documented
    after: str | None = None  # a command whose run this one continues (resume, sample)
    skip: str | None = None  # why it is not run
    phases: list[str] = field(default_factory=list)  # logged keys that show a phase was reached


def _clt_phases(steps: int, tokens_per_batch: int) -> list[str]:
    """A dead-feature window of a quarter of the run (AuxK from then on), resampling every third of it,
    validation at the middle and the end, the schedule's decay in the last 30 %."""
    return ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps // 2),
            "--callbacks.async_checkpoint.every_n_steps", str(steps // 2),
            "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
            "--model.dead_tokens", str(tokens_per_batch * max(1, steps // 4)),
            "--model.resample_dead_every", str(max(1, steps // 3)),
            "--model.schedule.warmup_steps", "2", "--model.schedule.decay_fraction", "0.3"]


def _hf_gpt2_reason() -> str | None:
    """Why GPT-2's pretrained weights are not usable offline here (None: they are)."""
    try:
        import transformers  # noqa: F401
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return "needs the `hf` extra (transformers) and GPT-2's weights from the Hugging Face hub; not installed"
    found = try_to_load_from_cache("gpt2", "config.json")
    if not isinstance(found, str):
        return "needs GPT-2's weights from the Hugging Face hub (not in the local cache; no network here)"
    return None


def commands(gpus: int, smoke: bool, target: str | None) -> list[Command]:
    """The documented commands at ``gpus`` GPUs (or CPU processes with ``smoke``), in the order they run."""
    out: list[Command] = []
    accel = ["--trainer.accelerator", "cpu" if smoke else "gpu", "--trainer.devices", str(gpus)]
    hf = _hf_gpt2_reason()
    # ------------------------------------------------------------- CLT
    if smoke:
        demo = ["--config", "clt_demo", *accel, *QUIET, "--data.target", target or "demo", "--data.seq_len", "32",
                "--data.tokens_per_batch", "64", "--data.train_tokens", "256", "--data.val_tokens", "128",
                "--data.stats_tokens", "512", "--model.clt.n_layers", "2", "--model.clt.d_model", "32",
                "--model.clt.n_features", "64", "--model.clt.k", "8", "--model.aux_k", "8",
                *_clt_phases(8, 64), "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1"]
    else:
        demo = ["--config", "clt_demo", *accel, *QUIET, "--data.stats_tokens", "8192", *_clt_phases(40, 512)]
    clt_doc = "docs/clt.md (Use), docs/strategies.md (With the CLT recipe)"
    clt_keys = ["train/auxk", "train/resampled", "val/fvu"]
    if gpus == 1:
        for compile_ in ([False] if smoke else [False, True]):
            out.append(Command(f"clt_demo_compile_{str(compile_).lower()}", "lightning-opt-clt",
                               [*demo, "--model.compile", str(compile_).lower()], gpus, clt_doc, phases=clt_keys))
        if not smoke:
            out.append(Command("clt_demo_export", "lightning-opt-clt",
                               [*demo, "--model.clt.activation", "relu", "--model.resample_dead_every", "null",
                                "--export_dir", "export"], gpus, "docs/clt.md (Use: --export_dir)"))
    strategies = ["decoder_sharding_shard_encoder"] if smoke else list(STRATEGIES)[:3]
    if gpus > 1:
        for s in strategies:
            out.append(Command(f"clt_demo_{s}", "lightning-opt-clt", [*demo, "--model.compile", "false",
                                                                      *STRATEGIES[s]], gpus, clt_doc, phases=clt_keys))
    # resume the first CLT run of this GPU count from its middle checkpoint (the smoke run: 2 processes only)
    first = out[0].name if gpus == 1 else f"clt_demo_{strategies[0]}"
    base = next(c for c in out if c.name == first)
    if not smoke or gpus > 1:
        out.append(Command(f"{first}_resume", "lightning-opt-clt", [*base.args, "--ckpt_path", "MIDDLE_CHECKPOINT"],
                           gpus, "docs/strategies.md (resume with --ckpt_path)", after=first, phases=["val/fvu"]))
    if not smoke:
        small = ["--config", "clt_gpt2_small", *accel, *QUIET, "--data.target", "gpt2-random",
                 "--data.train_files", "builtin", "--data.val_files", "builtin", "--data.val_tokens", "8192",
                 "--data.stats_tokens", "16384", *_clt_phases(16, 4096),
                 # no checkpoints: with Adam's state a 32768-feature CLT's is about 24 GB (resume: the demo's)
                 "--trainer.enable_checkpointing", "false"]
        doc_small = "docs/clt.md (offline end-to-end run of clt_gpt2_small)"
        if gpus == 1:
            for compile_ in (True, False):
                out.append(Command(f"clt_gpt2_small_random_compile_{str(compile_).lower()}", "lightning-opt-clt",
                                   [*small, "--model.compile", str(compile_).lower()], gpus, doc_small, phases=clt_keys))
            out.append(Command("clt_gpt2_small_hf", "lightning-opt-clt",
                               ["--config", "clt_gpt2_small", *accel, "--data.train_files", "builtin",
                                "--data.val_files", "builtin", "--trainer.max_steps", "20"], gpus,
                               "docs/clt.md (Use: GPT-2 small on FineWeb shards)", skip=hf))
        else:
            for s in STRATEGIES:
                out.append(Command(f"clt_gpt2_small_random_{s}", "lightning-opt-clt",
                                   [*small, "--model.compile", "false", *STRATEGIES[s]], gpus,
                                   "docs/strategies.md (With the CLT recipe; FSDP: 4 GPUs)", phases=clt_keys))
    # ------------------------------------------------------------- GPT-2
    gpt_demo = ["--config", "gpt2/demo", *accel, *QUIET, "--trainer.max_steps", "8" if smoke else "40",
                "--trainer.val_check_interval", "4" if smoke else "20", "--data.val_tokens", "2048" if smoke else "8192"]
    if smoke:
        gpt_demo += ["--model.model_config.n_layer", "2", "--model.model_config.n_embd", "32",
                     "--model.model_config.n_head", "2", "--model.model_config.block_size", "32",
                     "--data.seq_len", "32", "--data.batch_size", "2", "--data.val_tokens", "256"]
    if gpus == 1:
        out.append(Command("gpt2_demo", "lightning-opt-gpt2", gpt_demo, gpus, "README.md, docs/gpt2.md (demo)",
                           phases=["val/loss"]))
        if not smoke:
            out.append(Command("gpt2_demo_resume", "lightning-opt-gpt2",
                               [*gpt_demo, "--trainer.max_steps", "50", "--ckpt_path", "LAST_CHECKPOINT"], gpus,
                               "docs/strategies.md (resume with --ckpt_path)", after="gpt2_demo"))
        out.append(Command("sample", "lightning-opt-sample",
                           ["--ckpt_path", "RUN_DIR", "--prompt", "The for statement", "--max_new_tokens", "50",
                            "--temperature", "0.8", "--top_k", "50", "--seed", "0"], gpus,
                           "docs/gpt2.md (Sampling and fine-tuning)", after="gpt2_demo"))
    if not smoke:
        steps = 12  # warm-up, the window's growth and the cooldown are fractions of the token budget
        speedrun = ["--config", "gpt2/gpt2-124m-speedrun", *accel, *QUIET, "--data.train_files", "builtin",
                    "--data.val_files", "builtin", "--data.seq_len", "8192",
                    # two validation windows of 8192 tokens on every rank
                    "--data.val_tokens", str(2 * 8192 * gpus),
                    "--trainer.accumulate_grad_batches", "1", "--train_tokens", str(steps * 8192 * gpus),
                    "--trainer.val_check_interval", str(steps // 2)]
        out.append(Command("gpt2_124m_speedrun", "lightning-opt-gpt2", speedrun, gpus,
                           "README.md, docs/gpt2.md, docs/strategies.md (several GPUs)", phases=["val/loss"]))
        # ------------------------------------------------------------- SPD
        if gpus == 1:
            out.append(Command("spd_lm_demo", "lightning-opt-spd",
                               ["--config", "spd_lm_demo", *accel, *QUIET, "--trainer.max_steps", "60",
                                "--model.target.train_steps", "50", "--model.train.faithfulness_warmup_steps", "20"],
                               gpus, "docs/spd.md (spd_lm_demo)"))
            out.append(Command("spd_tms_5-2", "lightning-opt-spd",
                               ["--config", "spd_tms_5-2", *accel, *QUIET, "--trainer.max_steps", "200",
                                "--model.train.faithfulness_warmup_steps", "50"], gpus, "docs/spd.md"))
            out.append(Command("spd_gpt2_layer", "lightning-opt-spd", ["--config", "spd_gpt2_layer", *accel], gpus,
                               "docs/spd.md (GPT-2 layer)",
                               skip=hf or "needs FineWeb GPT-2 token shards (no network here)"))
    return out


# ----------------------------------------------------------------- running
def _argv(script: str) -> list[str]:
    """The console script next to this Python, else on PATH, else its module (``python -m``)."""
    here = Path(sys.executable).with_name(script)
    if here.exists():
        return [str(here)]
    found = shutil.which(script)
    if found:
        return [found]
    module = {"lightning-opt-gpt2": "gpt2", "lightning-opt-clt": "clt", "lightning-opt-spd": "spd",
              "lightning-opt-sample": "sample"}[script]
    return [sys.executable, "-m", f"lightning_opt.recipes.{module}"]


def _env(work: Path, smoke: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MASTER_", "RANK", "LOCAL_", "WORLD_", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC"))}
    env.update(LIGHTNING_OPT_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    if smoke:
        env["OMP_NUM_THREADS"] = "1"  # several processes on a few cores
    return env


def _run_dir(cwd: Path) -> Path | None:
    found = sorted(glob.glob(str(cwd / "runs" / "*" / "version_*" / "metrics.json")), key=os.path.getmtime)
    return Path(found[-1]).parent if found else None


def _checkpoints(cwd: Path) -> list[Path]:
    return sorted((Path(p) for p in glob.glob(str(cwd / "**" / "*.ckpt"), recursive=True) if Path(p).is_file()),
                  key=lambda p: p.stat().st_mtime)


def _resolve(args: list[str], before: Path) -> list[str]:
    """Fill the placeholders of a command that continues the run in ``before``."""
    ckpts = [p for p in _checkpoints(before) if p.name != "last.ckpt"] or _checkpoints(before)
    fill = {"RUN_DIR": str(_run_dir(before) or before),
            "LAST_CHECKPOINT": str(ckpts[-1]) if ckpts else "missing.ckpt",
            # the middle one: the resumed run crosses validation, resampling and the decay again
            "MIDDLE_CHECKPOINT": str(ckpts[len(ckpts) // 2 - 1] if len(ckpts) > 1 else (ckpts or ["missing"])[0])}
    return [fill.get(a, a) for a in args]


def _scalars(run: Path | None, keys: list[str]) -> dict[str, Any]:
    """Steps and values of ``keys`` in the run's TensorBoard events: the phases the run reached."""
    if run is None or not keys:
        return {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {"note": "tensorboard not installed: phases not read"}
    seen: dict[str, Any] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for key in keys:
            if key in acc.Tags().get("scalars", []):
                seen.setdefault(key, []).extend((e.step, e.value) for e in acc.Scalars(key))
    out: dict[str, Any] = {}
    for key, values in seen.items():
        out[key] = {"steps": len(values), "last": values[-1][1]}
    if "train/auxk" in seen:
        out["auxk_ran_on_dead_features"] = any(v != 1.0 for _, v in seen["train/auxk"])
    if "train/resampled" in seen:
        out["resampled_features"] = sum(v for _, v in seen["train/resampled"])
    return out


# A CLT run on several GPUs must train about as well as on one: decoder sharding computes the one-GPU model
# (bit for bit on CPU ranks), data parallel sees more tokens per step. "It ran" is not enough.
FVU_REFERENCE = "clt_demo_compile_false"
FVU_SLACK = (1.5, 0.05)  # a run on several GPUs fails above 1.5 x the one-GPU val/fvu + 0.05


def _last_fvu(row: dict[str, Any]) -> float | None:
    value = (row.get("phases") or {}).get("val/fvu", {}).get("last")
    return None if value is None else float(value)


def check_fvu_agreement(rows: list[dict[str, Any]]) -> None:
    """Fail every passed multi-GPU ``clt_demo_<strategy>`` row whose final val/fvu exceeds the one-GPU run's by
    more than :data:`FVU_SLACK` (in place; the reason goes to the row's ``error``). Rows of a run without the
    one-GPU reference get ``fvu_check`` saying so."""
    ref = next((r for r in rows if r["name"] == FVU_REFERENCE and r["gpus"] == 1 and r.get("passed")), None)
    ref_fvu = None if ref is None else _last_fvu(ref)
    for row in rows:
        if not (row["name"].startswith("clt_demo_") and row["name"].removeprefix("clt_demo_") in STRATEGIES
                and row["gpus"] > 1 and row.get("passed")):
            continue
        fvu = _last_fvu(row)
        if ref_fvu is None or fvu is None:
            row["fvu_check"] = f"not checked: no val/fvu of {FVU_REFERENCE} at 1 GPU in this run"
            continue
        bound = FVU_SLACK[0] * ref_fvu + FVU_SLACK[1]
        row["fvu_check"] = f"val/fvu {fvu:.4g} vs {ref_fvu:.4g} at 1 GPU (bound {bound:.4g})"
        if fvu > bound:
            row["passed"] = False
            row["error"] = (f"val/fvu {fvu:.4g} at {row['gpus']} GPUs vs {ref_fvu:.4g} at 1 GPU "
                            f"({FVU_REFERENCE}): above {FVU_SLACK[0]} x + {FVU_SLACK[1]}")


def run_command(cmd: Command, work: Path, timeout_s: float, smoke: bool,
                done: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Run one command (``done``: the rows so far, by name and GPUs); its result row."""
    cwd = work / f"{cmd.name}_{cmd.gpus}"
    row: dict[str, Any] = {"name": cmd.name, "gpus": cmd.gpus, "doc": cmd.doc,
                           "command": " ".join([cmd.script, *cmd.args])}
    if cmd.skip:
        return {**row, "passed": None, "skipped": cmd.skip}
    args = cmd.args
    if cmd.after is not None:
        before = done.get((cmd.after, cmd.gpus))
        if not before or not before.get("passed"):
            return {**row, "passed": None, "skipped": f"needs {cmd.after}, which did not pass"}
        args = _resolve(args, Path(before["cwd"]))
        row["command"] = " ".join([cmd.script, *args])
        # a resume continues in the same folder (its checkpoints and logs), a sample reads from there
        cwd = Path(before["cwd"])
    cwd.mkdir(parents=True, exist_ok=True)
    log = cwd / f"{cmd.name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        # its own process group: a timeout ends the ranks Lightning started too (they hold GPUs)
        proc = subprocess.Popen([*_argv(cmd.script), *args], cwd=cwd, env=_env(work, smoke), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout_s:.0f} s"
    seconds = time.perf_counter() - start
    run = _run_dir(cwd)
    metrics = json.loads((run / "metrics.json").read_text()) if run is not None and cmd.script != "lightning-opt-sample" else {}
    passed = code == 0
    row.update(passed=passed, seconds=round(seconds, 1), cwd=str(cwd), exit=code,
               steady_tokens_per_s=metrics.get("steady_tokens_per_s", metrics.get("tokens_per_s")),
               steps=metrics.get("steps"), world_size=metrics.get("world_size"),
               phases=_scalars(run, cmd.phases) if passed else {})
    if not passed:
        row["error_tail"] = log.read_text(errors="replace")[-3000:]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated (those above the GPUs here are skipped)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, tiny: 1 and 2 processes, a few commands")
    p.add_argument("--only", default=None,
                   help="run only the commands whose name contains one of these (comma-separated)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per command")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no command after this many seconds")
    p.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary folder, removed)")
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/documented_commands_<device>.json)")
    args = p.parse_args(argv)
    begin = time.perf_counter()
    import torch

    available = 0 if args.cpu_smoke else torch.cuda.device_count()
    counts = [1, 2] if args.cpu_smoke else [int(g) for g in args.gpus.split(",") if g.strip()]
    name = f"documented_commands_{'cpu' if args.cpu_smoke else device_slug()}"
    if args.out is None:
        args.out = os.path.join(RESULTS, f"{name}_smoke.json" if args.cpu_smoke else f"{name}.json")
    temp = None if args.work_dir else tempfile.mkdtemp(prefix="documented_commands_")
    work = Path(args.work_dir or temp)
    work.mkdir(parents=True, exist_ok=True)
    target = None
    if args.cpu_smoke:
        # a tiny random byte-level GPT as the CLT's target (the demo target would be trained first)
        from lightning_opt.models.gpt2 import GPT, GPTConfig

        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
        target = str(work / "target.pt")
        torch.save({"config": cfg.to_dict(), "model": GPT(cfg).state_dict()}, target)
    rows: list[dict[str, Any]] = []
    done: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for gpus in counts:
            for cmd in commands(gpus, args.cpu_smoke, target):
                if args.only and not any(part in cmd.name for part in args.only.split(",")):
                    continue
                row_base = {"name": cmd.name, "gpus": gpus, "doc": cmd.doc, "command": " ".join([cmd.script, *cmd.args])}
                if not args.cpu_smoke and gpus > available:
                    rows.append({**row_base, "passed": None, "skipped": f"{gpus} GPUs asked, {available} here"})
                    continue
                left = args.deadline_s - (time.perf_counter() - begin)
                if left <= 0:
                    rows.append({**row_base, "passed": None, "skipped": "past --deadline-s"})
                    continue
                limit = min(args.timeout_s, max(left, 30.0))
                row = run_command(cmd, work, limit, args.cpu_smoke, done)
                if row["passed"] is False and limit < args.timeout_s and str(row.get("exit", "")).startswith("timeout"):
                    # cut short by the call's --deadline-s, not by --timeout-s: not a verdict on the command
                    row = {**row, "passed": None, "skipped": f"stopped by --deadline-s after {limit:.0f} s"}
                done[(cmd.name, gpus)] = row
                rows.append(row)
                status = {True: f"passed in {row.get('seconds')} s", False: f"FAILED in {row.get('seconds')} s",
                          None: f"skipped: {row.get('skipped')}"}[row["passed"]]
                print(f"[{time.perf_counter() - begin:6.0f}s] {gpus} x {cmd.name}: {status}", flush=True)
    finally:
        check_fvu_agreement(rows)
        summary = {"passed": sum(r["passed"] is True for r in rows), "failed": sum(r["passed"] is False for r in rows),
                   "skipped": sum(r["passed"] is None for r in rows),
                   "total_s": round(time.perf_counter() - begin, 1), "gpus_here": available}
        for r in rows:
            r.pop("cwd", None)
        path = args.out
        write_result(path, benchmark="documented_commands", env=environment(not args.cpu_smoke and available > 0),
                     command=command_line(argv), baseline=None,
                     results={"config": {k: v for k, v in vars(args).items() if k != "out"}, "summary": summary,
                              "rows": rows})
        print(f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped -> {path}")
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return {"path": path, "rows": rows, "summary": summary}


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result["summary"]["failed"] else 0)
