"""Shared pieces of the GPT-2 benchmarks: environment record, token data on the device, the bare PyTorch
training loop, the Lightning Trainer run, validation, and fault-tolerant variant running.

The same data order, validation set and clock rules are used by every runner:

- training data: the train shard cut into ``seq_len`` windows read in order (micro-batch ``p`` holds
  windows ``[p*B, (p+1)*B)``, wrapping per epoch), exactly what ``TokenShardDataModule(shuffle=False)``
  yields;
- validation: the first ``val_tokens`` tokens of the val shard in ``seq_len`` windows, evaluated eagerly
  (no compile) under the run's autocast, excluded from the training clock;
- clock: device-synchronised at the end of optimizer step ``warm`` and at the end; tokens/s is measured
  between the two, and compile time is the excess of the first ``warm`` steps over ``warm`` steady steps.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import device_slug
from lightning_opt.callbacks.speed_monitor import peak_flops
from lightning_opt.data.schedule import BatchGeometry
from lightning_opt.data.shards import read_shard
from lightning_opt.models.gpt2 import GPTConfig, GPTExecution
from lightning_opt.optim.combined import CombinedOptimizer
from lightning_opt.optim.factory import OptimConfig, build_optimizer
from lightning_opt.optim.schedules import ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]

DATA_DIR = ROOT / ".data" / "novels"
DATA_DIR_ENV = "LIGHTNING_OPT_DATA_DIR"  # the novels shards' folder when --data-dir is not given
VAL_TOKENS = 1_048_576


# ------------------------------------------------------------------------------------------------
# environment and results


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_out(name: str) -> Path:
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d")
    return ROOT / "benchmarks" / "results" / f"{name}_{device_slug()}_{date}.json"


def find_shards(data_dir: str | None = None) -> tuple[Path, Path]:
    """The train and val shards (``<corpus>_train_000000.bin``, ``<corpus>_val_000000.bin``: the novels or any
    corpus built by ``benchmarks/build_corpora.py``) in ``data_dir`` (``--data-dir``), else in
    ``$LIGHTNING_OPT_DATA_DIR``, else in the repository's ``.data/novels``."""
    d = Path(data_dir or os.environ.get(DATA_DIR_ENV) or DATA_DIR)
    trains = sorted(d.glob("*_train_000000.bin"))
    pairs = [(t, t.with_name(t.name.replace("_train_", "_val_"))) for t in trains]
    pairs = [(t, v) for t, v in pairs if v.exists()]
    if len(pairs) == 1:
        return pairs[0]
    found = "several corpora: " + ", ".join(t.name for t, _ in pairs) if pairs else "none"
    raise FileNotFoundError(
        f"expected one pair of shards <corpus>_{{train,val}}_000000.bin in {d}, found {found}: pass --data-dir "
        f"DIR, set {DATA_DIR_ENV}=DIR, or copy the novels shards to {DATA_DIR}"
    )


class Deadline:
    """Wall-clock budget of a whole benchmark call: variants that would not fit are skipped, not started."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def add_common_args(p, deadline_s: float) -> None:
    """The arguments every GPT-2 benchmark takes."""
    p.add_argument("--smoke", action="store_true", help="tiny models on CPU; proves the script end to end")
    p.add_argument("--data-dir", default=None, help=f"folder with novels_{{train,val}}_000000.bin (default: "
                   f"${DATA_DIR_ENV}, else .data/novels)")
    p.add_argument("--deadline-s", type=float, default=deadline_s, help="skip work that would end past this")
    p.add_argument("--end-unix", type=float, default=None, help="absolute end time (overrides --deadline-s)")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/<name>_<device>_<date>.json)")


def deadline_from(args) -> Deadline:
    return Deadline(args.deadline_s if args.end_unix is None else args.end_unix - time.time())


def smoke_shard(data: Tokens) -> Path:
    """The (small-vocabulary) smoke tokens as a shard file, for the Lightning DataModule which reads files."""
    import tempfile

    from lightning_opt.data.shards import write_shard

    path = Path(tempfile.mkdtemp(prefix="gpt2_smoke_")) / "smoke_train.bin"
    write_shard(path, data.train.cpu().numpy().astype("uint16"))
    return path


def guarded(name: str, fn: Callable[[], dict[str, Any]], deadline: Deadline | None = None,
            need_s: float = 0.0) -> dict[str, Any]:
    """Run one variant; an exception (out-of-memory included) is recorded, never raised."""
    if deadline is not None and deadline.left() < need_s:
        print(f"[{name}] skipped: {deadline.left():.0f}s left, needs about {need_s:.0f}s", flush=True)
        return {"name": name, "skipped": f"time budget: {deadline.left():.0f}s left, needed ~{need_s:.0f}s"}
    print(f"[{name}] start ({deadline.left():.0f}s left)" if deadline else f"[{name}] start", flush=True)
    t0 = time.perf_counter()
    try:
        out = fn()
        out = {"name": name, **out}
    except Exception as err:  # noqa: BLE001 - one variant must not stop the others
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        out = {"name": name, "error": f"{type(err).__name__}: {str(err)[:2000]}", "oom": oom,
               "traceback": traceback.format_exc()[-4000:]}
        print(f"[{name}] FAILED: {out['error'][:300]}", flush=True)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    cleanup()
    return out


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def autocast(dev: torch.device, amp: str):
    if amp == "bf16":
        return torch.autocast(dev.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# The 1024-token geometry the throughput benchmarks compare at (nanoGPT's): causal attention over each whole
# 1024-token window (no document masking, no sliding window, attention backend "auto"), micro-batches of
# 32 x 1024 tokens, no gradient accumulation, a 1000-step schedule (what gpt2_ablation scales the Muon
# momentum warm-up by), validation every 125 steps. The shipped speedrun config trains on the record's
# 65,536-token document-causal sequences instead; recipe_config(name, "short") reads it in this geometry.
SHORT_GEOMETRY: dict[str, dict[str, Any]] = {
    "model_config": {"block_size": 1024, "doc_causal": False, "window_schedule": None},
    "execution": {"attn_backend": "auto"},
    "data": {"seq_len": 1024, "batch_size": 32},
    "trainer": {"max_steps": 1000, "val_check_interval": 125, "accumulate_grad_batches": 1},
}


def _arg(value: Any) -> str:
    """A value as the recipe's command line writes it (``null``, ``false``, ``1024``, ``auto``)."""
    return value if isinstance(value, str) else json.dumps(value)


def short_geometry_args() -> list[str]:
    """:data:`SHORT_GEOMETRY` as the recipe's command-line overrides (``--model.model_config.block_size 1024``,
    ...), with ``--train_tokens null``: the run's length is ``trainer.max_steps``."""
    args = ["--train_tokens", "null"]
    for section, values in SHORT_GEOMETRY.items():
        prefix = f"model.{section}" if section in ("model_config", "execution") else section
        for key, value in values.items():
            args += [f"--{prefix}.{key}", _arg(value)]
    return args


@functools.cache
def _recipe_config(name: str, geometry: str) -> str:
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
    from lightning_opt.recipes.gpt2 import GPT2RecipeCLI

    class ConfigOnly(GPT2RecipeCLI):
        """The ``lightning-opt-gpt2`` parser and its checks, instantiating nothing."""

        def instantiate_classes(self) -> None:
            return None

    args = ["--config", f"gpt2/{name}", "--seed_everything", "false"]
    if geometry == "short":
        args += short_geometry_args()
    cli = ConfigOnly(GPT2SpeedrunModule, TokenShardDataModule, args=args, run=False)
    return json.dumps(cli.config.as_dict(), default=str)


def recipe_config(name: str, geometry: str = "config") -> dict[str, Any]:
    """The full config of ``lightning-opt-gpt2 --config gpt2/<name>`` as the recipe's own parser reads it
    (every default filled in; nothing built). ``geometry="short"``: in the 1024-token geometry
    (:data:`SHORT_GEOMETRY`, given as command-line overrides); ``"config"``: as the file says."""
    if geometry not in ("config", "short"):
        raise ValueError(f"geometry={geometry!r}: expected 'config' (the file's) or 'short' (1024-token windows)")
    return json.loads(_recipe_config(name, geometry))


def load_yaml_config(name: str, geometry: str = "config") -> tuple[GPTConfig, OptimConfig, ScheduleConfig, dict[str, Any]]:
    """Model, optimizer and schedule of ``lightning_opt/recipes/configs/gpt2/<name>.yaml`` (the recipe's own config,
    read by its parser: :func:`recipe_config`), and that full config. The schedule's ``total_steps`` is the
    benchmark's (:func:`schedule_for`), not the recipe's."""
    raw = recipe_config(name, geometry)
    m = raw["model"]
    schedule = {k: v for k, v in m["schedule"].items() if k != "total_steps"}
    return GPTConfig.from_dict(m["model_config"]), OptimConfig(**m["optim"]), ScheduleConfig(**schedule), raw


def yaml_compile_options(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The inductor settings of a recipe config (``model.compile.options``; None where it gives none)."""
    compile_cfg = raw["model"].get("compile")
    return (compile_cfg.get("options") or None) if isinstance(compile_cfg, dict) else None


# ------------------------------------------------------------------------------------------------
# data


class Tokens:
    """Train and val tokens held on the device as int32 (the novels shard is 66 MB that way)."""

    def __init__(self, train_path: Path, val_path: Path, dev: torch.device, val_tokens: int = VAL_TOKENS,
                 train_tokens: int | None = None, vocab_mod: int | None = None) -> None:
        train = read_shard(train_path)
        if train_tokens is not None:
            train = train[:train_tokens]
        val = read_shard(val_path)
        self.val_tokens = min(val_tokens, len(val) - 1)
        train = np.asarray(train, dtype=np.int32)
        val = np.asarray(val[: self.val_tokens + 1], dtype=np.int32)
        if vocab_mod is not None:  # smoke runs: a small vocabulary keeps tiny models fast on a CPU
            train, val = train % vocab_mod, val % vocab_mod
        self.train = torch.from_numpy(train).to(dev)
        self.val = torch.from_numpy(val).to(dev)
        self.device = dev

    def train_batch(self, position: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch number ``position`` in TokenShardDataModule's order (contiguous windows)."""
        per_epoch = ((len(self.train) - 1) // seq_len) // batch
        start = (position % per_epoch) * batch * seq_len
        buf = self.train[start : start + batch * seq_len + 1]
        return buf[:-1].view(batch, seq_len).long(), buf[1:].view(batch, seq_len).long()

    @torch.no_grad()
    def evaluate(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seq_len: int,
                 batch: int, amp: str) -> float:
        """Mean loss over the fixed val windows; one host sync at the end."""
        n_windows = self.val_tokens // seq_len
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for lo in range(0, n_windows, batch):
            b = min(batch, n_windows - lo)
            buf = self.val[lo * seq_len : (lo + b) * seq_len + 1]
            x, y = buf[:-1].view(b, seq_len).long(), buf[1:].view(b, seq_len).long()
            with autocast(self.device, amp):
                total += loss_fn(x, y).double() * b
        return float(total / n_windows)


# ------------------------------------------------------------------------------------------------
# runs


@dataclass
class RunSpec:
    """One training run: model, optimizer, schedule, batch geometry and how it is timed."""

    model: GPTConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    execution: GPTExecution = field(default_factory=GPTExecution)  # how the model is computed
    variants: dict[str, Any] = field(default_factory=dict)  # gpt2_variants.Variants settings (MTP, MoE)
    steps: int = 20
    micro_batch: int = 32
    accum: int = 1
    seq_len: int = 1024
    compile: bool = True
    compile_options: dict[str, Any] | None = None  # inductor settings (the recipe's model.compile.options)
    amp: str = "bf16"
    clip: float | None = None
    warm: int = 3
    val_every: int = 0
    val_batch: int = 32
    val_seq_len: int | None = None  # validation window (default seq_len): fixed across rows that change seq_len
    seed: int = 0
    # [(from_step, seq_len)]: a sequence-length curriculum at a fixed number of tokens per micro-batch
    # (the library's BatchGeometry, over optimizer steps here)
    seq_schedule: list[tuple[int, int]] = field(default_factory=list)
    stop_at_loss: float | None = None  # stop once a validation reaches this loss (time to target)
    # checked at validations: stop once the wall time (time.time()) has passed this; wall time, not the training
    # clock, which leaves validation and set-up out and would overrun a call's time limit
    deadline_unix: float | None = None

    def geometry(self) -> BatchGeometry:
        """``(micro-batch, seq_len)`` per optimizer step: the curriculum keeps the tokens per micro-batch."""
        return BatchGeometry.build(self.seq_len, self.micro_batch, self.seq_schedule, keep_tokens=True)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_step"] = self.micro_batch * self.accum * self.seq_len
        return d


def schedule_for(spec: RunSpec) -> ScheduleConfig:
    return spec.schedule.stretched(spec.steps)


def build_model_and_optimizer(spec: RunSpec, dev: torch.device, init_on_device: bool = False):
    """The model and the optimizer exactly as GPT2SpeedrunModule builds them (same roles, same factory).

    The module builds the model on the CPU (same seed, same numbers as here); ``init_on_device`` builds it
    on the GPU directly (seconds faster, other random numbers) for runs that are not compared with it.
    """
    from benchmarks.gpt2_variants import build_gpt

    torch.manual_seed(spec.seed)
    if init_on_device:
        with dev:
            model = build_gpt(spec.model, spec.execution, **spec.variants)
    else:
        model = build_gpt(spec.model, spec.execution, **spec.variants).to(dev)
    head = [] if spec.model.tie_embeddings else [model.lm_head.weight]
    opts = build_optimizer(model, spec.optim, hidden=model.hidden_matrices(), embeddings=None, head=head)
    opt = opts[0] if len(opts) == 1 else CombinedOptimizer(opts)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_for(spec))
    return model, opt, sched


class Clock:
    """Training clock with validation excluded; synchronises the device only where it reads the time."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        sync(dev)
        self.t0 = time.perf_counter()
        self.paused = 0.0
        self.t_warm: float | None = None
        self._pause_start = 0.0

    def now(self) -> float:
        sync(self.dev)
        return time.perf_counter() - self.t0 - self.paused

    def pause(self) -> float:
        t = self.now()
        self._pause_start = time.perf_counter()
        return t

    def resume(self) -> None:
        self.paused += time.perf_counter() - self._pause_start


def summarize(spec: RunSpec, model: torch.nn.Module, clock_end: float, t_warm: float | None, steps_done: int,
              tokens_done: int, curve: list[dict[str, Any]], dev: torch.device, extra: dict[str, Any]) -> dict:
    warm = min(spec.warm, steps_done)
    out: dict[str, Any] = {"steps": steps_done, "tokens": tokens_done, "train_s_total": round(clock_end, 3)}
    timed_steps = steps_done - warm
    if t_warm is not None and timed_steps > 0:
        step_s = (clock_end - t_warm) / timed_steps
        tps = spec.micro_batch * spec.accum * spec.seq_len / step_s
        out.update(step_ms=round(1000 * step_s, 2), tokens_per_s=round(tps, 1),
                   compile_s=round(max(0.0, t_warm - warm * step_s), 2) if spec.compile else 0.0,
                   first_steps_s=round(t_warm, 2))
        # speedrun rules: compile excluded from the training time
        out["train_s"] = round(clock_end - t_warm + warm * step_s, 3)
        fpt = model.flops_per_token(spec.seq_len) if hasattr(model, "flops_per_token") else extra.pop("fpt", None)
        if fpt:
            out["flops_per_token"] = fpt
            peak = peak_flops(dev, torch.bfloat16 if spec.amp == "bf16" else torch.float32)
            out["mfu"] = round(fpt * tps / peak, 4) if peak else None  # None: CPU or a GPU Lightning does not list
        for row in curve:  # re-express curve times on the compile-free clock
            if row["step"] >= warm:
                row["train_s"] = round(row["clock_s"] - t_warm + warm * step_s, 3)
            else:
                row["train_s"] = round(row["step"] * step_s, 3)
    out["val_curve"] = curve
    out["final_val_loss"] = curve[-1]["val_loss"] if curve else None
    out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None
    out.update(extra)
    return out


def run_loop(spec: RunSpec, data: Tokens, model: torch.nn.Module, loss_fn: Callable, val_fn: Callable, opt,
             sched) -> dict[str, Any]:
    """The bare training loop shared by our model and the peers': micro-batches, accumulation, clipping,
    optimizer and schedule steps, the clock and the validations. Returns what :func:`summarize` needs."""
    dev = data.device
    clock = Clock(dev)
    curve: list[dict[str, Any]] = []
    t_warm, stopped = None, None
    position, tokens, step = 0, 0, 0
    geometry = spec.geometry()
    for step in range(spec.steps):
        b, t = geometry.at(step)
        if hasattr(model, "set_train_progress"):  # a scheduled attention window follows the step, as in the module
            model.set_train_progress(step / spec.steps)
        for _ in range(spec.accum):
            x, y = data.train_batch(position, b, t)
            position += 1
            with autocast(dev, spec.amp):
                loss = loss_fn(x, y)
            (loss / spec.accum).backward()
            tokens += b * t
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done == spec.warm:
            t_warm = clock.now()
        if spec.val_every and (done % spec.val_every == 0 or done == spec.steps):
            stopped = _validate(spec, model, val_fn, data, clock, curve, done, tokens)
            if stopped:
                break
    if not spec.val_every:
        stopped = _validate(spec, model, val_fn, data, clock, curve, step + 1, tokens)
    return {"end": curve[-1]["clock_s"], "t_warm": t_warm, "steps": step + 1, "tokens": tokens, "curve": curve,
            "stopped": stopped}


def train_bare(spec: RunSpec, data: Tokens, init_on_device: bool = False) -> dict[str, Any]:
    """The bare PyTorch loop: our model, our optimizer, torch.compile, autocast; nothing else."""
    dev = data.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model, opt, sched = build_model_and_optimizer(spec, dev, init_on_device)
    if spec.compile:
        model.compile(dynamic=False, options=spec.compile_options)
    # model.forward is the eager function: validation must not trigger a second compile
    r = run_loop(spec, data, model, model, model.forward, opt, sched)
    return summarize(spec, model, r["end"], r["t_warm"], r["steps"], r["tokens"], r["curve"], dev,
                     {"runner": "bare", "stopped": r["stopped"], "spec": spec.describe()})


def _validate(spec: RunSpec, model, val_fn, data: Tokens, clock: Clock, curve: list, step: int,
              tokens: int) -> str | None:
    t = clock.pause()
    model.eval()
    loss = data.evaluate(val_fn, spec.val_seq_len or spec.seq_len, spec.val_batch, spec.amp)
    model.train()
    clock.resume()
    curve.append({"step": step, "tokens": tokens, "clock_s": round(t, 3), "val_loss": round(loss, 5)})
    print(f"    step {step:>5}  val_loss {loss:.4f}  clock {t:.1f}s", flush=True)
    if not math.isfinite(loss):
        return "non-finite loss"
    if spec.stop_at_loss is not None and loss <= spec.stop_at_loss:
        return "target reached"
    if spec.deadline_unix is not None and time.time() > spec.deadline_unix:
        return "deadline"
    return None


class SyncProbe:
    """Records where the host waits for the GPU during a window of steps (``set_sync_debug_mode("warn")``).

    Each synchronising call raises a warning from the Python frame that caused it; we keep the op and the
    innermost frames outside torch, deduplicated, so a report says which line of whose code synchronised.
    """

    def __init__(self) -> None:
        self.found: dict[str, dict[str, Any]] = {}
        self._old: Any = None
        self.used = False  # one window per run

    @property
    def active(self) -> bool:
        return self._old is not None

    def start(self) -> None:
        import warnings

        self.used = True
        self._old = warnings.showwarning
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = self._record  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        import warnings

        torch.cuda.set_sync_debug_mode("default")
        if self._old is not None:
            warnings.showwarning = self._old  # type: ignore[assignment]
            self._old = None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        import traceback

        text = str(message)
        if "synchroniz" not in text.lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "site-packages/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        where = [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in frames[-12:]]
        key = text.split("\n")[0][:120] + " @ " + (where[-1] if where else "?")
        entry = self.found.setdefault(key, {"op": text.split("\n")[0][:200], "stack": where, "count": 0})
        entry["count"] += 1


def train_lightning(spec: RunSpec, data: Tokens, train_path: Path, logger: str = "tensorboard",
                    log_dir: str | None = None, sync_probe_steps: int = 0) -> dict[str, Any]:
    """Our recipe path: GPT2SpeedrunModule + TokenShardDataModule + Trainer (bf16-mixed, compile).

    ``sync_probe_steps``: after the warm-up steps, record every host-device synchronisation during that
    many optimizer steps (see :class:`SyncProbe`); reported under ``sync_probe`` (CUDA only).
    """
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.modules.base import CompileConfig
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule

    dev = data.device
    if spec.seq_schedule:
        raise ValueError("the Lightning runner does not do sequence-length curricula")
    if spec.variants:
        raise ValueError("the Lightning runner builds the library's GPT: architecture variants run in train_bare")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(spec.seed)
    module = GPT2SpeedrunModule(spec.model, spec.optim, schedule_for(spec), spec.execution,
                                compile=CompileConfig(mode="full", options=spec.compile_options or {})
                                if spec.compile else CompileConfig(mode="none"))
    dm = TokenShardDataModule(str(train_path), None, seq_len=spec.seq_len, batch_size=spec.micro_batch,
                              shuffle=False)
    curve: list[dict[str, Any]] = []
    state: dict[str, Any] = {"t_warm": None, "last": 0, "stopped": None, "tokens": 0}

    probe = SyncProbe() if sync_probe_steps and dev.type == "cuda" else None
    probe_window = (spec.warm + 1, spec.warm + 1 + sync_probe_steps)

    class Timing(Callback):
        def on_train_start(self, trainer, pl_module):
            state["clock"] = Clock(dev)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if probe is not None and trainer.global_step == probe_window[0] and not probe.used:
                probe.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            state["tokens"] += batch[0].numel()
            done = trainer.global_step
            if done == state["last"]:
                return  # mid accumulation
            state["last"] = done
            clock: Clock = state["clock"]
            if done == spec.warm:
                state["t_warm"] = clock.now()
            if probe is not None and done >= probe_window[1] and probe.active:
                probe.stop()
            # the last step validates inside fit (val_every 0: only there): after fit, Lightning's teardown
            # has moved the module back to the CPU
            if done == spec.steps or (spec.val_every and done % spec.val_every == 0):
                model = pl_module.model
                stop = _validate(spec, model, model.forward, data, clock, curve, done, state["tokens"])
                if stop:
                    state["stopped"] = stop
                    trainer.should_stop = True

        def on_train_end(self, trainer, pl_module):
            state["end"] = state["clock"].now()
            if probe is not None:
                probe.stop()

    if logger == "tensorboard" and not any(_importable(m) for m in ("tensorboard", "tensorboardX")):
        logger = "none (tensorboard is not installed)"
    if logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        lg: Any = TensorBoardLogger(save_dir=log_dir or str(ROOT / "runs" / "bench"), name="gpt2_bench")
    else:
        lg = False
    trainer = L.Trainer(
        accelerator="cuda" if dev.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if spec.amp == "bf16" else "32-true",
        max_steps=spec.steps, accumulate_grad_batches=spec.accum, gradient_clip_val=spec.clip,
        logger=lg, log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Timing()],
    )
    trainer.fit(module, datamodule=dm)
    end = curve[-1]["clock_s"] if curve else state["end"]
    return summarize(spec, module.model, end, state["t_warm"], trainer.global_step, module.tokens_seen, curve,
                     dev, {"runner": "lightning", "stopped": state["stopped"], "logger": logger,
                           "spec": spec.describe(),
                           **({"sync_probe": {"optimizer_steps": sync_probe_steps,
                                              "syncs": list(probe.found.values())}} if probe else {})})


def oom_retry(run: Callable[[RunSpec], dict[str, Any]], spec: RunSpec, tries: int = 2) -> dict[str, Any]:
    """Run; on out-of-memory halve the micro-batch and double accumulation (same tokens per step), and say so."""
    notes = []
    for _ in range(tries + 1):
        try:
            out = run(spec)
            if notes:
                out["oom_fallback"] = notes
            return out
        except torch.OutOfMemoryError as err:
            if spec.micro_batch < 2:
                raise
            notes.append(f"OOM at micro_batch={spec.micro_batch}: {str(err)[:200]}")
            print(f"    OOM at micro-batch {spec.micro_batch}; retrying with {spec.micro_batch // 2}", flush=True)
            cleanup()
            spec = replace(spec, micro_batch=spec.micro_batch // 2, accum=spec.accum * 2,
                           val_batch=max(1, spec.val_batch // 2))
    raise RuntimeError("; ".join(notes))


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def with_compile_options(spec: RunSpec, **options: Any) -> RunSpec:
    """The spec with inductor settings merged into its ``compile_options`` (the recipe's ``model.compile.options``)."""
    return replace(spec, compile_options={**(spec.compile_options or {}), **options})


def with_model(spec: RunSpec, **model_changes: Any) -> RunSpec:
    """The spec with model settings changed: ``GPTExecution`` fields go to its execution, the
    ``gpt2_variants`` ones (MTP, MoE) to its variants, the rest to its architecture."""
    from benchmarks.gpt2_variants import VARIANT_FIELDS

    execution = {k: v for k, v in model_changes.items() if k in GPTExecution.__dataclass_fields__}
    variants = {k: v for k, v in model_changes.items() if k in VARIANT_FIELDS}
    arch = {k: v for k, v in model_changes.items() if k not in execution and k not in variants}
    return replace(spec, model=replace(spec.model, **arch), execution=replace(spec.execution, **execution),
                   variants={**spec.variants, **variants})


def yaml_execution(raw: dict[str, Any]) -> GPTExecution:
    """The ``model.execution`` of a recipe YAML that :func:`load_yaml_config` read (``raw``)."""
    return GPTExecution(**(raw["model"].get("execution") or {}))
