"""GPT-2 ablation table: each row switches one library option against one baseline, for long enough that loss
differences can be told from run-to-run noise.

Baseline: the model and optimizer of the shipped ``gpt2-124m-speedrun`` recipe in the 1024-token geometry
(``gpt2_common.SHORT_GEOMETRY``; its YAML: architecture, Muon +
Adam with their learning rates, WSD schedule, fused soft-capped loss) at a size one call can afford:
``--n-layer`` x ``--n-embd`` with heads of the recipe's width (the recipe's attention-free layer 7 of 12 maps to
layer ``7 * n_layer // 12``, its Muon momentum warmup to the same fraction of the run), ``--micro-batch`` x
``--seq-len`` tokens per step, bf16 autocast, PyTorch SDPA, FP8 off (a row of its own) and **eager**: every row
builds its own graph, and compiling each would cost more than its training, so tokens/s compare between rows,
not with compiled runs (``--compile`` compiles every row).

Noise: the baseline runs with two seeds (initialisation; same data order). The noise band is their mean +-
their difference, for the val loss and for tokens/s; a row's effect is called real only outside it. Rows use
seed 0.

Length: a probe of the baseline measures its tokens/s, and every row then trains the tokens the baseline trains
in ``--row-seconds`` (at most one pass over the train tokens; ``--steps`` fixes the steps instead). A row that
runs past ``--row-cap`` times the baseline's training time stops there (its loss is then at fewer tokens and
is not compared) and a row that would end past ``--deadline-s`` is skipped: one slow row cannot eat the run.

Columns: tokens/s (after ``--warm`` steps), peak memory of training, val loss on the first ``--val-tokens``
val tokens (the same windows for every row), the option's code (lines counted from the source at run time:
its own classes, functions or files plus the lines that use its switch, docstrings and comments left out) and
the packages it needs beyond torch and lightning, and when to skip it. A row whose package is not importable
is reported as not measured, never run on a fallback.

    pip install --no-deps bitsandbytes-*.whl   # for the adamw_8bit row (any way of installing it will do)
    python -m benchmarks.gpt2_ablation --data-dir .data/novels --no-report   # GPU, 5-6.5 minutes on an H100
    python -m benchmarks.gpt2_ablation --train-files 'fw/fineweb_train_*.bin' --val-files 'fw/fineweb_val_*.bin'
    python -m benchmarks.gpt2_ablation --smoke   # the builtin byte-level corpus, a tiny model, CPU

Writes ``benchmarks/results/gpt2_ablation_<device>.json`` (``--out``: a file or a folder; smoke runs: a temporary
folder) and, unless ``--no-report``, regenerates ``docs/benchmarks/gpt2.md`` through ``benchmarks/gpt2_report.py``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import os
import tempfile
import time
import tokenize
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import command_line, device_slug, environment, write_result
from benchmarks.gpt2_common import (
    DATA_DIR,
    DATA_DIR_ENV,
    ROOT,
    Clock,
    Deadline,
    RunSpec,
    Tokens,
    autocast,
    build_model_and_optimizer,
    guarded,
    load_yaml_config,
    with_model,
    yaml_execution,
)
from lightning_opt._optional import is_available
from lightning_opt.data.schedule import BatchGeometry
from lightning_opt.data.shards import read_shard, resolve_files
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

RECIPE = "gpt2-124m-speedrun"
ADAMW_RECIPE = "gpt2-124m-classic"  # the AdamW settings of the optimizer rows
SEED_ROWS = ("baseline", "baseline_seed1")  # seeds 0 and 1 of the baseline: the noise band
BASELINE_MATMUL_PRECISION = "high"  # the recipe's MatmulPrecision callback
REPORT_S = 5.0  # seconds kept free at the deadline for the last validation, the JSON and the report


# ------------------------------------------------------------------------------------------------
# the code an option is


@dataclass(frozen=True)
class Code:
    """Where an option's code lives: ``path`` (from the repository root); the whole file when neither ``objects``
    nor ``names`` is given, else the lines of the classes and functions ``objects`` (``name`` or
    ``Class.method``) and the lines that use one of the identifiers ``names``."""

    path: str
    objects: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    def describe(self) -> str:
        what = [f"`{o}`" for o in self.objects] + ([f"lines using {', '.join(self.names)}"] if self.names else [])
        return f"{self.path}" + (f": {'; '.join(what)}" if what else " (whole file)")


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _object_lines(tree: ast.Module, qualname: str, path: str) -> set[int]:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(f"{path} has no {qualname}")
        body = node.body
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return set(range(start, node.end_lineno + 1))


def code_lines(path: Path, objects: tuple[str, ...] = (), names: tuple[str, ...] = ()) -> set[int]:
    """The line numbers of ``path`` that hold code (not blank, not comment-only, not a docstring) and belong to
    ``objects`` or use one of ``names`` as an identifier (all code lines when both are empty)."""
    src = path.read_text()
    tree = ast.parse(src)
    code: set[int] = set()
    named: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in skip:
            continue
        code.update(range(tok.start[0], tok.end[0] + 1))
        if tok.type == tokenize.NAME and tok.string in names:
            named.add(tok.start[0])
    code -= _docstring_lines(tree)
    if not objects and not names:
        return code
    picked = set().union(*(_object_lines(tree, o, str(path)) for o in objects)) if objects else set()
    return (picked | named) & code


def count_code(code: tuple[Code, ...], root: Path = ROOT) -> tuple[int, list[dict[str, Any]]]:
    """Total code lines of ``code`` (a line counted once per file) and one record per entry."""
    per_file: dict[str, set[int]] = {}
    parts = []
    for c in code:
        lines = code_lines(root / c.path, c.objects, c.names)
        per_file.setdefault(c.path, set()).update(lines)
        parts.append({"what": c.describe(), "lines": len(lines)})
    return sum(len(v) for v in per_file.values()), parts


# ------------------------------------------------------------------------------------------------
# runs


@dataclass
class AblationSpec(RunSpec):
    """A run of the table: :class:`RunSpec` with a batch-size schedule and a float32 matmul precision."""

    batch_schedule: list[tuple[int, int]] = field(default_factory=list)  # [(from_step, micro_batch)]
    matmul_precision: str = BASELINE_MATMUL_PRECISION

    def geometry(self) -> BatchGeometry:
        return BatchGeometry.build(self.seq_len, self.micro_batch, self.seq_schedule, self.batch_schedule,
                                   keep_tokens=True)

    def tokens(self) -> int:
        g = self.geometry()
        return sum(b * t for b, t in map(g.at, range(self.steps)))


class ShardTokens(Tokens):
    """Train and val tokens of FineWeb-format shards (paths or globs, read in name order), on the device."""

    def __init__(self, train_files: list[Path], val_files: list[Path], dev: torch.device, val_tokens: int,
                 max_train_tokens: int) -> None:
        train, val = _read(train_files, max_train_tokens), _read(val_files, val_tokens + 1)
        if len(val) < 2 or len(train) < 2:
            raise ValueError(f"too few tokens in {train_files} / {val_files}")
        self.val_tokens = len(val) - 1
        self.train = torch.from_numpy(train).to(dev)
        self.val = torch.from_numpy(val).to(dev)
        self.device = dev


def _read(files: list[Path], limit: int) -> np.ndarray:
    parts, n = [], 0
    for f in files:
        if n >= limit:
            break
        part = np.asarray(read_shard(f)[: limit - n], dtype=np.int32)
        parts.append(part)
        n += len(part)
    return np.concatenate(parts)


def next_batch(data: Tokens, offset: int, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``b`` windows of ``t`` tokens read in order from ``offset`` (back to 0 at the end of the train tokens)."""
    n = b * t
    if offset + n + 1 > len(data.train):
        offset = 0
    buf = data.train[offset : offset + n + 1]
    return buf[:-1].view(b, t).long(), buf[1:].view(b, t).long(), offset + n


def train_row(spec: AblationSpec, data: Tokens, cap_s: float | None = None,
              verify: Callable[[torch.nn.Module, torch.optim.Optimizer], str | None] | None = None) -> dict[str, Any]:
    """Train ``spec`` (stopping once the host clock passes ``cap_s``), then validate on the fixed val windows."""
    dev = data.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(spec.matmul_precision)
    try:
        model, opt, sched = build_model_and_optimizer(spec, dev, init_on_device=True)
        problem = verify(model, opt) if verify else None
        if problem:
            raise RuntimeError(problem)
        if spec.compile:
            model.compile(dynamic=False, options=spec.compile_options)
        geometry = spec.geometry()
        clock = Clock(dev)
        t0 = time.perf_counter()
        offset = tokens = 0
        t_warm = tokens_warm = None
        stopped = None
        for step in range(spec.steps):
            b, t = geometry.at(step)
            x, y, offset = next_batch(data, offset, b, t)
            model.set_train_progress(step / spec.steps)
            with autocast(dev, spec.amp):
                loss = model(x, y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tokens += b * t
            if step + 1 == spec.warm:
                t_warm, tokens_warm = clock.now(), tokens
            elif cap_s is not None and spec.warm < step + 1 < spec.steps and time.perf_counter() - t0 > cap_s:
                # after the warm-up (a stopped row still has a tokens/s); the host clock, no device sync: the
                # host runs at most the launch queue ahead of the GPU
                stopped = f"row time cap ({cap_s:.0f} s) at step {step + 1} of {spec.steps}"
                break
        t_end = clock.now()
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        model.eval()
        val_len = spec.val_seq_len or spec.seq_len
        val = data.evaluate(model.forward, val_len, spec.val_batch, spec.amp)
    finally:
        torch.set_float32_matmul_precision(previous)
    timed = t_warm is not None and t_end > t_warm
    return {
        "steps": step + 1, "tokens": tokens, "train_s": round(t_end, 3), "stopped": stopped,
        "tokens_per_s": round((tokens - tokens_warm) / (t_end - t_warm), 1) if timed else None,
        "step_ms": round(1000 * (t_end - t_warm) / (step + 1 - spec.warm), 2) if timed else None,
        "peak_mem_gb": round(peak, 3) if peak is not None else None,
        "final_val_loss": round(val, 5), "val_tokens": data.val_tokens // val_len * val_len,
        "params": sum(p.numel() for p in model.parameters()),
    }


# ------------------------------------------------------------------------------------------------
# the baseline and the rows


def scaled_recipe(n_layer: int, n_embd: int, seq_len: int, vocab_size: int | None, steps: int,
                  micro_batch: int) -> tuple[AblationSpec, OptimConfig, dict[str, Any]]:
    """The recipe's model and optimizer at ``n_layer`` x ``n_embd`` (heads of the recipe's head width), its
    execution with FP8 off and SDPA attention, its schedule over ``steps``; and the classic recipe's AdamW."""
    model, optim, sched, raw = load_yaml_config(RECIPE, geometry="short")
    classic = load_yaml_config(ADAMW_RECIPE)[1]
    head_dim = model.head_dim
    if n_embd % head_dim:
        raise ValueError(f"--n-embd {n_embd} must be a multiple of the recipe's head width {head_dim}")
    ratio = n_layer / model.n_layer
    model = replace(
        model, n_layer=n_layer, n_embd=n_embd, n_head=n_embd // head_dim, block_size=seq_len,
        n_value_embeds=min(model.n_value_embeds, n_layer // 2),
        skip_attn_layers=tuple(sorted({int(i * ratio) for i in model.skip_attn_layers})),
        mla_kv_rank=max(16, model.mla_kv_rank * n_embd // model.n_embd),
        **({"vocab_size": vocab_size} if vocab_size else {}))
    recipe_steps = raw["trainer"]["max_steps"]
    optim = replace(optim, muon_momentum_warmup_steps=round(optim.muon_momentum_warmup_steps * steps / recipe_steps))
    execution = replace(yaml_execution(raw), head_fp8=False, mlp_fp8=False, attn_fp8=False, attn_backend="sdpa")
    spec = AblationSpec(model, optim, sched, execution, steps=steps, micro_batch=micro_batch, accum=1,
                        seq_len=seq_len, compile=False, amp="bf16", warm=5, val_every=0, val_batch=micro_batch,
                        val_seq_len=seq_len)
    info = {"recipe": RECIPE, "recipe_max_steps": recipe_steps, "adamw_recipe": ADAMW_RECIPE}
    return spec, classic, info


@dataclass(frozen=True)
class Row:
    name: str
    toggle: str  # what this row changes against the baseline
    change: Callable[[AblationSpec], AblationSpec]
    skip_when: str  # when to leave the option out
    code: tuple[Code, ...] = ()  # the code of the option the row switches (on or off)
    extras: tuple[str, ...] = ()  # pip packages beyond torch and lightning
    needs: Callable[[torch.device], str | None] | None = None  # why it cannot be measured here, or None
    verify: Callable[[torch.nn.Module, torch.optim.Optimizer], str | None] | None = None
    cost: float = 1.0  # expected time relative to the baseline's (to skip rows that would pass the deadline)


def _package(module: str, pip_name: str) -> Callable[[torch.device], str | None]:
    def needs(dev: torch.device) -> str | None:
        if not is_available(module):
            return f"{pip_name} not installed"
        if dev.type != "cuda":
            return f"{pip_name} needs CUDA (this run is on {dev.type})"
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - a broken install is reported, not fallen back from
            return f"{pip_name} is installed but does not import ({type(err).__name__}: {str(err)[:200]})"
        return None

    return needs


def _needs_flash(dev: torch.device) -> str | None:
    from lightning_opt.ops.attention import flash_available

    reason = _package("flash_attn", "flash-attn")(dev)
    return reason or (None if flash_available() else "flash-attn does not import (see the warning in the log)")


def _needs_flash4(dev: torch.device) -> str | None:
    from lightning_opt.ops.attention import _FLASH4_MIN_CAPABILITY, flash4_available

    reason = _package("flash_attn.cute", "flash-attn-4")(dev)
    if reason is None and torch.cuda.get_device_capability(dev)[0] < _FLASH4_MIN_CAPABILITY:
        reason = "flash-attn-4 needs a Hopper or newer GPU"
    return reason or (None if flash4_available() else "flash-attn-4 does not import (see the warning in the log)")


def _needs_fp8(dev: torch.device) -> str | None:
    from lightning_opt.ops.fp8 import fp8_supported

    return None if fp8_supported(dev) else f"FP8 matmuls need compute capability 8.9+ ({torch.cuda.get_device_name()})"


def _is_bnb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str | None:
    inner = getattr(opt, "optimizers", [opt])
    kinds = [f"{type(o).__module__}.{type(o).__name__}" for o in inner]
    return None if all(k.startswith("bitsandbytes") for k in kinds) else f"not a bitsandbytes optimizer: {kinds}"


def _staged_steps(steps: int, micro_batch: int) -> tuple[int, list[tuple[int, int]]]:
    """A batch-size ramp B/4 -> B/2 -> B with the tokens of ``steps`` steps of B: the tokens of ``k`` steps of B
    (``k`` about a sixth of ``steps``) at each of the two small sizes, the rest at B.
    Returns (steps, [(from_step, micro_batch)])."""
    if micro_batch % 4:
        raise ValueError(f"the batch-size ramp needs a micro-batch divisible by 4, got {micro_batch}")
    k = max(1, round(steps / 6))
    return steps + 4 * k, [(0, micro_batch // 4), (4 * k, micro_batch // 2), (6 * k, micro_batch)]


def _batch_ramp(spec: AblationSpec) -> AblationSpec:
    steps, schedule = _staged_steps(spec.steps, spec.micro_batch)
    return replace(spec, steps=steps, batch_schedule=schedule)


def _seq_ramp(spec: AblationSpec) -> AblationSpec:
    third = max(1, spec.steps // 3)
    return replace(spec, seq_schedule=[(0, spec.seq_len // 4), (third, spec.seq_len // 2), (2 * third, spec.seq_len)])


def _one_cycle(spec: AblationSpec) -> AblationSpec:
    return replace(spec, schedule=ScheduleConfig(name="one_cycle", warmup_steps=round(0.3 * spec.steps),
                                                 total_steps=spec.steps, min_ratio=0.0, start_ratio=0.04))


GPT_PY = "lightning_opt/models/gpt2.py"
SCHEDULE_CODE = (Code("lightning_opt/data/schedule.py", objects=("_pairs", "_value_at", "BatchGeometry",
                                                                 "ScheduledBatches")),)


def rows(base: AblationSpec, adamw: OptimConfig) -> list[Row]:
    """The table's rows in priority order (rows that would pass the deadline are skipped from the end)."""
    lion = replace(adamw, name="lion", lr=adamw.lr / 3, weight_decay=adamw.weight_decay * 3, betas=(0.9, 0.99))
    half = base.model.n_layer // 2
    mla_rank = base.model.mla_kv_rank
    cap = base.model.logit_softcap
    return [
        Row("baseline", f"the {RECIPE} recipe's model and optimizer at this size (seed 0)", lambda s: s, "reference"),
        Row("baseline_seed1", "the baseline with seed 1 (initialisation; same data): the noise band",
            lambda s: replace(s, seed=1), "reference"),
        Row("adamw", f"Muon + Adam -> AdamW on every parameter ({ADAMW_RECIPE}'s lr {adamw.lr:g}, betas "
            f"{tuple(adamw.betas)}, weight decay {adamw.weight_decay:g})", lambda s: replace(s, optim=adamw),
            "to reproduce an AdamW baseline; Muon costs a few bf16 matmuls per hidden matrix per step",
            code=(Code("lightning_opt/optim/muon.py"),)),
        Row("lion", f"Muon + Adam -> Lion on every parameter (lr {lion.lr:.3g}, weight decay {lion.weight_decay:g}, "
            f"betas {lion.betas}: AdamW's lr / 3 and decay x 3)", lambda s: replace(s, optim=lion),
            "unless optimizer memory matters: one moment instead of two, and it needs its own lr and decay",
            code=(Code("lightning_opt/optim/lion.py"),)),
        Row("adamw_8bit", "Muon + Adam -> bitsandbytes AdamW8bit on every parameter (the adamw row's settings: "
            "compare with it)", lambda s: replace(s, optim=replace(adamw, name="adamw8bit")),
            "when optimizer states are a small part of memory (small models, Muon's hidden matrices); CUDA only",
            code=(Code("lightning_opt/optim/factory.py", names=("adamw8bit", "bnb", "on_cuda")),),
            extras=("bitsandbytes",), needs=_package("bitsandbytes", "bitsandbytes"), verify=_is_bnb, cost=1.2),
        Row("one_cycle", "WSD -> one-cycle schedule (rise from lr/25 over 30% of the steps, cosine down to 0)",
            _one_cycle, "when the run may be stopped or extended: WSD's flat phase can cool down at any step",
            code=(Code("lightning_opt/optim/schedules.py", objects=("_one_cycle",),
                       names=("one_cycle", "start_ratio", "anneal")),)),
        Row("fp8", "FP8 matmuls on: head, MLP and attention projections, static scales (eager: the casts are "
            "separate kernels)", lambda s: with_model(s, head_fp8=True, mlp_fp8=True, attn_fp8=True),
            "without torch.compile (eager, the casts cost more than FP8 saves) and on GPUs below compute "
            "capability 8.9", code=(Code("lightning_opt/ops/fp8.py"), Code(GPT_PY, objects=("linear_maybe_fp8",),
                                    names=("head_fp8", "mlp_fp8", "attn_fp8", "_head_fp8", "fp8_head_applicable"))),
            needs=_needs_fp8, cost=1.3),
        Row("torch_loss", "fused soft-capped loss (one Triton kernel) -> logits + torch cross-entropy",
            lambda s: with_model(s, loss_impl="torch"),
            "never on CUDA; without Triton the fused function runs the same torch ops",
            code=(Code("lightning_opt/ops/softcap_ce.py"),), extras=("triton (ships with CUDA torch)",), cost=1.3),
        Row("no_value_embeds", f"value embeddings off (n_value_embeds {base.model.n_value_embeds} -> 0)",
            lambda s: with_model(s, n_value_embeds=0),
            "when memory is short: each is a vocab x width table with its Adam state",
            code=(Code(GPT_PY, names=("n_value_embeds", "value_embeds", "ves", "ve")),)),
        Row("no_unet", "U-net skips off", lambda s: with_model(s, unet_skips=False),
            "when the loss row shows no gain: a scalar per skipped pair",
            code=(Code(GPT_PY, names=("unet_skips", "skip_weights", "skips")),)),
        Row("no_qk_norm", "QK-norm off", lambda s: with_model(s, qk_norm=False),
            "only with low learning rates: it keeps attention logits bounded under Muon's",
            code=(Code(GPT_PY, names=("qk_norm", "q_norm", "k_norm", "qk_gain")),)),
        Row("no_softcap", f"logit soft-cap {cap:g} -> none", lambda s: with_model(s, logit_softcap=None),
            "when the loss row shows no gain; the fused loss computes it at no extra pass",
            code=(Code(GPT_PY, names=("logit_softcap", "cap")),)),
        Row("layer_drop", "LayerDrop 0.1 (block i skipped with probability 0.1 (i + 1) / n_layer)",
            lambda s: with_model(s, layer_drop=0.1),
            "in short pretraining runs (a regulariser); skipped blocks save their time",
            code=(Code(GPT_PY, names=("layer_drop", "layer_drop_prob", "p_drop", "draws", "drop",
                                      "layer_drop_generator")),), cost=0.9),
        Row("grad_ckpt", f"activation checkpointing of the first {half} of {base.model.n_layer} blocks",
            lambda s: with_model(s, grad_checkpoint=half),
            "when activations fit: it recomputes those blocks' forward in the backward pass",
            code=(Code(GPT_PY, names=("grad_checkpoint", "checkpointed_blocks", "n_ckpt", "checkpoint")),), cost=1.3),
        Row("tf32_off", f"float32 matmuls at 'highest' (TF32 off; the recipe's MatmulPrecision sets "
            f"'{BASELINE_MATMUL_PRECISION}')", lambda s: replace(s, matmul_precision="highest"),
            "to debug float32 numerics; under bf16 autocast few matmuls stay float32, so it changes little",
            code=(Code("lightning_opt/callbacks/matmul_precision.py"),)),
        Row("seq_schedule", "sequence length T/4 -> T/2 -> T over thirds of the steps (same tokens per step)",
            _seq_ramp, "when the task needs long context from the start", code=SCHEDULE_CODE),
        Row("batch_schedule", "batch size B/4 -> B/2 -> B (a sixth of the tokens at each small size; same tokens, "
            "more steps)", _batch_ramp, "when steps, not tokens, are the budget: small batches take more steps",
            code=SCHEDULE_CODE, cost=1.4),
        Row("mla", f"attention MHA -> MLA (kv rank {mla_rank}, rope {base.model.mla_rope_dim}; value embeddings off, "
            "which MLA does not take: compare with no_value_embeds)",
            lambda s: with_model(s, attention="mla", n_value_embeds=0),
            "when decoding memory is not the limit: MLA's gain is a smaller KV cache",
            code=(Code(GPT_PY, objects=("MultiLatentAttention", "GPTConfig._check_mla"),
                       names=("mla_kv_rank", "mla_q_rank", "mla_rope_dim")),), cost=1.2),
        Row("flash_attn", "PyTorch SDPA -> flash-attn", lambda s: with_model(s, attn_backend="flash"),
            "plain causal attention: SDPA has a flash kernel; flash-attn adds fixed sliding windows",
            code=(Code("lightning_opt/ops/attention.py", objects=("_flash_attn_func", "flash_available"),
                       names=("use_flash", "fn")),), extras=("flash-attn",), needs=_needs_flash),
        Row("flash_attn_4", "PyTorch SDPA -> flash-attn-4", lambda s: with_model(s, attn_backend="flash4"),
            "plain causal attention on Hopper and newer GPUs; document masks go to SDPA",
            code=(Code("lightning_opt/ops/attention.py", objects=("_flash4_func", "flash4_available"),
                       names=("_FLASH4_FN", "_FLASH4_MIN_CAPABILITY")),), extras=("flash-attn-4",),
            needs=_needs_flash4),
    ]


def extra_rows(base: AblationSpec) -> list[Row]:
    """Rows outside the default set (``--rows``): other recipe details and the benchmark-only variants."""
    variants = "benchmarks/gpt2_variants.py"
    return [
        Row("no_x0_mix", "x0 mixing off", lambda s: with_model(s, x0_mix=False), "two scalars per block",
            code=(Code(GPT_PY, names=("x0_mix", "x0_lambdas", "x0")),)),
        Row("no_embed_norm", "embedding RMS norm off", lambda s: with_model(s, embed_norm=False), "free",
            code=(Code(GPT_PY, names=("embed_norm",)),)),
        Row("attn_every_layer", "attention in every layer", lambda s: with_model(s, skip_attn_layers=()),
            "the record drops one attention layer", code=(Code(GPT_PY, names=("skip_attn_layers", "has_attn")),)),
        Row("no_norm_gain", "no learned gains in the norms", lambda s: with_model(s, norm_weight=False),
            "measure before use", code=(Code(GPT_PY, names=("norm_weight", "qk_gain")),)),
        Row("muon_polar_express", "Muon with Polar-Express-style per-step coefficients",
            lambda s: replace(s, optim=replace(s.optim, muon_ns_coefficients="polar_express")), "same cost",
            code=(Code("lightning_opt/optim/muon.py", objects=("_optimal_quintic", "polar_express_coefficients")),)),
        Row("muon_normuon", "Muon + NorMuon-style per-neuron normalisation (beta2 0.95)",
            lambda s: replace(s, optim=replace(s.optim, muon_normuon_beta2=0.95)), "measure before use",
            code=(Code("lightning_opt/optim/muon.py", objects=("Muon._normuon",), names=("normuon_beta2",)),)),
        Row("mtp_k2", "multi-token prediction, one extra head (benchmark-only variant)",
            lambda s: with_model(s, mtp_heads=1), "not a library option",
            code=(Code(variants, objects=("VariantGPT",)),)),
        Row("moe_2", "dense MLP -> 2 experts, top-1, evaluated densely (benchmark-only variant)",
            lambda s: with_model(s, moe_experts=2, moe_top_k=1), "not a library option",
            code=(Code(variants, objects=("MoE",)),), cost=1.5),
    ]


LEFT_OUT = {
    "compile": "every row has its own graph: compiling each costs tens of seconds on an H100, more than its "
               "training here; all rows run eager (--compile compiles every row)",
    "gqa": "grouped-query attention shrinks the KV cache for decoding; the scaled model's heads leave only "
           "one KV head as an option",
    "window_schedule / flex attention": "sliding windows pay off at long sequences; the recipe attends fully",
    "dropout": "a fine-tuning option; pretraining runs without it",
    "multi-GPU (DDP, sharded Muon)": "one GPU",
}


# ------------------------------------------------------------------------------------------------
# steps, noise band, verdicts


def calibrate(base: AblationSpec, data: Tokens, row_s: float, probe_steps: int, min_steps: int,
              max_steps: int) -> dict[str, Any]:
    """Steps for ``row_s`` seconds of the baseline, from a short probe run of it (at most one pass over the
    train tokens, at least ``min_steps``)."""
    probe = train_row(replace(base, steps=base.warm + probe_steps), data)
    per_step = base.micro_batch * base.seq_len
    one_pass = (len(data.train) - 1) // per_step
    want = round(row_s * probe["tokens_per_s"] / per_step)
    steps = max(min_steps, min(want, one_pass, max_steps))
    limit = "one pass over the train tokens" if steps == one_pass < want else (
        "--max-steps" if steps == max_steps < want else "--min-steps" if steps == min_steps > want else "time")
    return {"probe_steps": probe_steps, "probe_tokens_per_s": probe["tokens_per_s"], "row_seconds": row_s,
            "steps_for_row_seconds": want, "steps": steps, "limited_by": limit, "probe_wall_s": probe["train_s"]}


def _measured(r: dict[str, Any]) -> bool:
    return r.get("final_val_loss") is not None and r.get("tokens_per_s") is not None


def noise_band(results: dict[str, dict[str, Any]], seeds: list[str]) -> dict[str, Any] | None:
    """The seeds' val loss and tokens/s: mean, |difference| and the band mean +- |difference|."""
    runs = [results[n] for n in seeds if _measured(results.get(n, {})) and not results[n].get("stopped")]
    if len(runs) < 2:
        return None
    out: dict[str, Any] = {"seeds": [r["spec"]["seed"] for r in runs]}
    for key, label in (("final_val_loss", "val_loss"), ("tokens_per_s", "tokens_per_s")):
        a, b = runs[0][key], runs[1][key]
        mean, spread = (a + b) / 2, abs(a - b)
        out[label] = [a, b]
        out[f"{label}_mean"] = round(mean, 5)
        out[f"{label}_seed0_vs_seed1"] = round(spread, 5)
        out[f"{label}_band"] = [round(mean - spread, 5), round(mean + spread, 5)]
    out["tokens_per_s_seed0_vs_seed1_pct"] = round(100 * out["tokens_per_s_seed0_vs_seed1"]
                                                   / out["tokens_per_s_mean"], 2)
    mem = [r.get("peak_mem_gb") for r in runs]
    out["peak_mem_gb"] = mem
    return out


def judge(row: dict[str, Any], noise: dict[str, Any] | None) -> None:
    """Deltas against the seeds' mean, whether they leave the noise band, and a one-line verdict."""
    if row.get("status") != "measured" or noise is None:
        return
    lo, hi = noise["val_loss_band"]
    tlo, thi = noise["tokens_per_s_band"]
    row["d_val_loss"] = None if row.get("stopped") else round(row["final_val_loss"] - noise["val_loss_mean"], 5)
    row["d_tokens_per_s_pct"] = round(100 * (row["tokens_per_s"] / noise["tokens_per_s_mean"] - 1), 2)
    row["speed_real"] = not tlo <= row["tokens_per_s"] <= thi
    base_mem = [m for m in noise["peak_mem_gb"] if m]
    if row.get("peak_mem_gb") and base_mem:
        row["d_peak_mem_pct"] = round(100 * (row["peak_mem_gb"] / (sum(base_mem) / len(base_mem)) - 1), 1)
    parts = []
    d = row["d_tokens_per_s_pct"]
    parts.append(f"{abs(d):.1f}% {'faster' if d > 0 else 'slower'}" if row["speed_real"] else "same speed (in band)")
    if row.get("stopped"):
        row["loss_real"] = None
        parts.append("stopped early: loss at fewer tokens, not compared")
    else:
        row["loss_real"] = not lo <= row["final_val_loss"] <= hi
        dl = row["d_val_loss"]
        parts.append(f"loss {'better' if dl < 0 else 'worse'} by {abs(dl):.3f} (outside the band)" if row["loss_real"]
                     else "loss within noise")
    dm = row.get("d_peak_mem_pct")
    spread = max(base_mem) - min(base_mem) if base_mem else 0.0
    if dm is not None and abs(dm) >= 1 and abs(row["peak_mem_gb"] - sum(base_mem) / len(base_mem)) > spread:
        parts.append(f"{abs(dm):.0f}% {'more' if dm > 0 else 'less'} memory")
    row["verdict"] = ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# main


def _files(pattern: str | None, data_dir: str | None, split: str) -> list[Path]:
    if pattern:
        return resolve_files(pattern)
    folder = Path(data_dir or os.environ.get(DATA_DIR_ENV) or DATA_DIR)
    files = sorted(folder.glob(f"*_{split}_*.bin"))
    if not files:
        raise FileNotFoundError(f"no *_{split}_*.bin shards in {folder}: pass --{split}-files or --data-dir")
    return files


def default_out(smoke: bool) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gpt2_ablation_")) if smoke else ROOT / "benchmarks" / "results"
    return folder / f"gpt2_ablation_{device_slug()}.json"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="the builtin byte-level corpus, a tiny model (CPU test)")
    p.add_argument("--data-dir", default=None, help=f"folder of *_train_*.bin / *_val_*.bin shards (default: "
                   f"${DATA_DIR_ENV}, else .data/novels)")
    p.add_argument("--train-files", default=None, help="train shards: path or glob (overrides --data-dir)")
    p.add_argument("--val-files", default=None, help="val shards: path or glob (overrides --data-dir)")
    p.add_argument("--deadline-s", type=float, default=370.0, help="rows that would end past this are skipped")
    p.add_argument("--row-seconds", type=float, default=12.0, help="baseline training seconds per row (sets the steps)")
    p.add_argument("--row-cap", type=float, default=2.0, help="a row stops at this many baseline training times")
    p.add_argument("--steps", type=int, default=None, help="steps per row (instead of --row-seconds)")
    p.add_argument("--min-steps", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--probe-steps", type=int, default=15)
    p.add_argument("--warm", type=int, default=5, help="steps left out of tokens/s")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--max-train-tokens", type=int, default=200_000_000, help="train tokens read onto the device")
    p.add_argument("--amp", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (the recipe's bf16-mixed)")
    p.add_argument("--compile", action="store_true", help="torch.compile every row (costs a compile per row)")
    p.add_argument("--rows", default=None, help="comma-separated rows (the baseline seeds always run); 'all' adds "
                   "the extra rows; default: the default set")
    p.add_argument("--out", default=None, help="result JSON file or folder (default benchmarks/results/)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate docs/benchmarks/gpt2.md")
    args = p.parse_args(argv)
    if args.smoke:
        args.n_layer, args.n_embd, args.micro_batch, args.seq_len, args.val_tokens = 6, 128, 4, 64, 4096
        args.row_seconds, args.min_steps, args.max_steps, args.probe_steps, args.warm = 1.0, 8, 12, 3, 2
        args.deadline_s = max(args.deadline_s, 1800.0)  # slow shared CPUs: never skip rows in a smoke run
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    deadline = Deadline(args.deadline_s)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.set_float32_matmul_precision(BASELINE_MATMUL_PRECISION)
    if args.smoke:
        from lightning_opt.data.corpus import default_corpus_shards

        train_files, val_files = map(lambda f: [f], default_corpus_shards())
    else:
        train_files, val_files = _files(args.train_files, args.data_dir, "train"), _files(args.val_files, args.data_dir, "val")
    data = ShardTokens(train_files, val_files, dev, args.val_tokens, args.max_train_tokens)
    vocab = 256 if args.smoke else None  # the builtin corpus is byte-level

    def baseline(steps: int) -> tuple[AblationSpec, OptimConfig, dict[str, Any]]:
        spec, adamw, info = scaled_recipe(args.n_layer, args.n_embd, args.seq_len, vocab, steps, args.micro_batch)
        return replace(spec, warm=args.warm, compile=args.compile, amp=args.amp), adamw, info

    base = baseline(args.steps or 1)[0]
    if args.steps:
        calib = {"steps": args.steps, "limited_by": "--steps"}
    else:
        calib = guarded("calibration", lambda: calibrate(base, data, args.row_seconds, args.probe_steps,
                                                         args.min_steps, args.max_steps))
        if "steps" not in calib:
            raise RuntimeError(f"the baseline probe failed: {calib.get('error')}")
    base, adamw, info = baseline(calib["steps"])

    table = rows(base, adamw)
    extras = extra_rows(base)
    known = {r.name: r for r in table + extras}
    if args.rows:
        wanted = [r.name for r in table + extras] if args.rows == "all" else args.rows.split(",")
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SystemExit(f"unknown rows {unknown}; choose from {sorted(known)}")
        table = [known[n] for n in dict.fromkeys([*SEED_ROWS, *wanted])]
    chosen = {r.name for r in table}
    left_out = {name: f"not in the default set (time budget); run it with --rows {name}"
                for name in known if name not in chosen}
    left_out.update(LEFT_OUT)

    out_path = Path(args.out) if args.out else default_out(args.smoke)
    if out_path.suffix != ".json":
        out_path = out_path / f"gpt2_ablation_{device_slug()}.json"
    env = environment()
    baseline_info = {"name": info["recipe"], **info, "n_layer": base.model.n_layer, "n_embd": base.model.n_embd,
                     "n_head": base.model.n_head, "steps": base.steps, "micro_batch": base.micro_batch,
                     "seq_len": base.seq_len, "tokens_per_step": base.micro_batch * base.seq_len,
                     "tokens": base.tokens(), "compile": base.compile, "amp": base.amp,
                     "attn_backend": base.execution.attn_backend, "matmul_precision": base.matmul_precision,
                     "warm": base.warm, "spec": base.describe()}
    notes = ["deltas are against the mean of the two baseline seeds; the noise band is that mean +- the seeds' "
             "difference (val loss and tokens/s); a row's effect is called real only outside it",
             "tokens/s leaves out the first warm-up steps; peak memory is training's (the token data on the "
             "device included), before validation",
             "code lines: counted from the source when the run started (see each row's code parts)"]
    results: dict[str, Any] = {
        "format": 2, "smoke": args.smoke, "settings": vars(args), "calibration": calib,
        "data": {"train_files": [str(f) for f in train_files], "val_files": [str(f) for f in val_files],
                 "train_tokens": len(data.train), "val_tokens": data.val_tokens},
        "noise": None, "rows": {}, "left_out": left_out,
    }
    # the run's view: its results with the baseline beside them (what run_row and print_table read)
    payload: dict[str, Any] = {**results, "baseline": baseline_info, "notes": notes}
    print(f"baseline: {base.model.n_layer} x {base.model.n_embd}, {base.steps} steps of {base.micro_batch} x "
          f"{base.seq_len} tokens ({calib.get('limited_by')})", flush=True)
    base_wall = None
    for row in table:
        r = run_row(row, base, data, dev, deadline, base_wall, payload, args)
        if row.name == "baseline" and r.get("status") == "measured":
            base_wall = r["wall_s"]
        payload["rows"][row.name] = r
        payload["noise"] = noise_band(payload["rows"], list(SEED_ROWS))
        for name, other in payload["rows"].items():
            if name in SEED_ROWS:
                other["verdict"] = "reference: the noise band's seed " + str(other.get("spec", {}).get("seed"))
            else:
                judge(other, payload["noise"])
        results.update(noise=payload["noise"], rows=payload["rows"])
        write_result(out_path, benchmark="gpt2_ablation", env=env, command=command_line(argv), baseline=baseline_info,
                     results=results, notes=notes)
    print_table(payload)
    print(f"wrote {out_path} ({time.perf_counter() - deadline.t0:.0f} s)")
    if not args.no_report:
        try:
            from benchmarks import gpt2_report

            doc = out_path.parent / "gpt2.md" if args.smoke else None
            print(f"report: {gpt2_report.main(['--ablation', str(out_path)] + (['--doc', str(doc)] if doc else []))}")
        except Exception as err:  # noqa: BLE001 - the JSON is what matters on the device
            print(f"report not generated ({type(err).__name__}: {err}); run benchmarks/gpt2_report.py later")
    return payload


def run_row(row: Row, base: AblationSpec, data: Tokens, dev: torch.device, deadline: Deadline,
            base_wall: float | None, payload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One row: not measured (its package or device is missing), skipped (deadline), or trained and judged."""
    n_code, parts = count_code(row.code)
    head = {"toggle": row.toggle, "skip_when": row.skip_when, "code_lines": n_code if row.code else None,
            "code": parts, "extra_deps": list(row.extras)}
    reason = row.needs(dev) if row.needs else None
    if reason:
        print(f"[{row.name}] not measured: {reason}", flush=True)
        return {"name": row.name, **head, "status": "not_measured", "reason": reason}
    versions = {}
    for pkg in row.extras:
        module = pkg.split()[0].replace("-", "_")
        if is_available(module):
            versions[pkg.split()[0]] = getattr(importlib.import_module(module), "__version__", None)
    spec = row.change(base)
    expected = (base_wall or (args.row_seconds + 5)) * row.cost
    base_train = payload["rows"].get("baseline", {}).get("train_s")
    cap = args.row_cap * base_train if base_train and not args.smoke else None
    if cap is not None:  # leave the validation and the report their time
        cap = min(cap, max(1.0, deadline.left() - 2 * REPORT_S))

    def run() -> dict[str, Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = train_row(spec, data, cap, row.verify)
        # a row whose option has a package (or device) condition must not have run on the library's fallback
        fallbacks = sorted({str(w.message)[:300] for w in caught if "fall" in str(w.message).lower()})
        if fallbacks and row.needs is not None:
            raise RuntimeError(f"ran on a fallback, not measured: {fallbacks[0]}")
        return out

    r = guarded(row.name, run, deadline, 0 if args.smoke else expected + REPORT_S)
    status = "skipped" if r.get("skipped") else "error" if r.get("error") else "measured"
    out = {**r, **head, "status": status, "extra_versions": versions, "spec": spec.describe()}
    if status == "skipped":
        out["reason"] = r["skipped"]
    elif status == "error":
        out["reason"] = r["error"].split("\n")[0][:300]
    return out


def print_table(payload: dict[str, Any]) -> None:
    noise = payload.get("noise")
    if noise:
        print(f"\nnoise band: val loss {noise['val_loss_band']}, tokens/s {noise['tokens_per_s_band']}")
    print(f"{'row':16} {'tok/s':>10} {'d tok/s':>8} {'peak GB':>8} {'val loss':>9} {'d loss':>8} {'code':>5}  verdict")
    for name, r in payload["rows"].items():
        if r.get("status") != "measured":
            print(f"{name:16} {r.get('status')}: {r.get('reason', '')[:100]}")
            continue
        dt = f"{r['d_tokens_per_s_pct']:+.1f}%" if r.get("d_tokens_per_s_pct") is not None else "-"
        dl = f"{r['d_val_loss']:+.4f}" if r.get("d_val_loss") is not None else "-"
        pk = f"{r['peak_mem_gb']:.2f}" if r.get("peak_mem_gb") is not None else "-"
        print(f"{name:16} {r['tokens_per_s']:>10,.0f} {dt:>8} {pk:>8} {r['final_val_loss']:>9.4f} {dl:>8} "
              f"{r.get('code_lines') or '-':>5}  {r.get('verdict', '')}")


if __name__ == "__main__":
    main()
