"""GPT-2 124M side by side on one GPU: our bare PyTorch loop, our Lightning recipe path, and nanoGPT.

In one process, on the novels shards, for a fixed number of optimizer steps (same data order, same
tokens per step = 32 x 1024 x 16 = 524,288, like nanoGPT's train.py and the speedrun):

- ``ours-speedrun-bare`` / ``ours-speedrun-lightning``: ``gpt2-124m-speedrun`` (the recipe's YAML in the 1024-token
  geometry, ``gpt2_common.SHORT_GEOMETRY``: RoPE,
  RMSNorm, QK-norm, ReLU^2, value embeddings, U-net, soft-cap, Muon + Adam) in a bare loop (our model and
  optimizer factory, ``torch.compile``, bf16 autocast) and through ``GPT2SpeedrunModule`` +
  ``TokenShardDataModule`` + ``Trainer(precision="bf16-mixed")`` with compile;
- ``ours-speedrun-torchce-bare`` / ``-lightning``: the recipe with ``loss_impl="torch"`` instead of its
  ``fused`` loss (head matmul, then one Triton kernel for the soft-capped loss and its logit gradient,
  :mod:`lightning_opt.ops.softcap_ce`): the soft-cap and cross-entropy inside the compiled graph;
- ``ours-speedrun-prev-bare``: the recipe without the record-parity settings (RoPE base 10000, soft-cap 30, no x0
  mixing, no embedding norm, attention in every layer, Muon one matrix at a time with q/k/v as one matrix
  and no momentum warmup); ``ours-speedrun-unbatchedmuon-bare``: the recipe with Muon one matrix at a
  time (isolates the batched Newton-Schulz);
- ``ours-classic-bare`` / ``ours-classic-lightning``: ``gpt2-124m-classic`` (fused AdamW, clip 1.0, its
  ``fused`` loss); ``ours-classic-torchloss-lightning``: the same with ``loss_impl="torch"`` (logits, then
  ``F.cross_entropy`` in the compiled graph, as nanoGPT computes it): attributes the loss kernel;
  ``ours-classic-nobias-lightning``: the classic config without biases (``bias: false``), the architecture the
  ``nanogpt`` row trains (bench.py's ``bias=False``); ``ours-classic-mb64-lightning``: 64 x 1024 micro-batches;
  the classic rows compile with the YAML's ``model.compile.options``; ``ours-classic-cdt-lightning``: the same
  with inductor's ``coordinate_descent_tuning`` on; ``ours-classic-cudnn-lightning`` (``-cudnn-cdt-``,
  ``-cudnn-mb64-``): the classic config with ``attn_backend="cudnn"`` (SDPA with cuDNN's fused attention first;
  the shipped config's backend when it already is ``cudnn``), alone, with coordinate-descent tuning, at 64 x 1024;
- ``nanogpt``: Karpathy's nanoGPT ``model.py`` trained as its ``bench.py`` does (see
  ``benchmarks/peers/nanogpt_runner.py``), imported from the git-ignored ``.peers/nanoGPT/``;
- ``ours-speedrun-nofp8-lightning``: the recipe without its ``head_fp8: auto`` (the fused loss's head
  forward matmul in bfloat16 instead of FP8): isolates the FP8 head;
- ``ours-speedrun-nofp8mm-mb64-lightning`` / ``-bare``: the recipe without its ``mlp_fp8: auto`` and
  ``attn_fp8: auto`` (the MLP and attention projection matmuls in bfloat16 instead of FP8), at 64 x 1024;
- ``ours-speedrun-nonormw-mb64-lightning``: the recipe without learned norm gains (``norm_weight: false``, as the
  record script), at 64 x 1024;
  ``ours-speedrun-qkgain-mb64-lightning`` / ``-mb128-lightning``: gains in QK-norm only (``norm_weight: qk``);
- ``ours-speedrun-cdt-mb64-lightning`` / ``-cdt-mb128-lightning`` / ``-nocdt-mb128-lightning``: the recipe with
  inductor's ``coordinate_descent_tuning`` on / off (``model.compile.options`` in the YAML);
- ``ours-speedrun-fp8mlp-lightning`` / ``-fp8mlp-mb64-lightning``: ``mlp_fp8: auto`` set explicitly (the
  recipe's own setting);
- ``ours-speedrun-mb64-bare`` / ``-lightning`` and ``nanogpt-mb64``: micro-batches of 64 x 1024 with half
  the accumulation (same tokens per step), ``*-mb128``: 128 x 1024 with a quarter; the goal compares the
  fastest geometry of each;
- ``nanogpt-bias`` / ``nanogpt-bias-mb64``: nanoGPT's model with GPT-2's biases (its ``GPTConfig`` default;
  bench.py turns them off), the architecture of ``gpt2-124m-classic``: the classic goal compares the same
  architecture on both sides (with biases, and ``ours-classic-nobias-lightning`` against ``nanogpt``);
- ``ours-speedrun-fp8head-bare`` / ``-lightning``: the speedrun with ``loss_impl="torch"`` and
  ``head_fp8=True`` (the output head's three matmuls in FP8 with static scales,
  :func:`lightning_opt.ops.fp8.fp8_linear`; the soft-cap and cross-entropy in the compiled graph);
- ``ours-speedrun-chunkedfp8-lightning``: the speedrun recipe path with ``loss_impl="chunked_fp8"`` (head
  matmuls in FP8 inside the chunked soft-capped cross-entropy, outside the compiled graph);
- ``ours-speedrun-chunkedce-bare``: the speedrun with the chunked cross-entropy in bf16, and
  ``ours-speedrun-chunkedce-mb2x-lightning`` the same with twice the micro-batch (if time is left).

Reports tokens/s and MFU (compile excluded; compile time separately), peak memory, val loss on the first
1,048,576 val tokens (a few points along the way, excluded from the clock), the Lightning overhead and the
ratio to nanoGPT. Every variant is fault-tolerant (errors and OOM are recorded, the next one runs).

    python -m benchmarks.gpt2_speedrun                 # the GPU run (about 6 minutes on an H100)
    python -m benchmarks.gpt2_speedrun --smoke         # tiny models on CPU, under a minute

``--repeats N`` runs the row list N times, every other time in reverse order (A B C, C B A, ...: drifts of the
card cancel out of the comparison); each row then reports its median step time (tokens/s and MFU from it) and
every repeat's values under ``repeats``.

Writes ``benchmarks/results/gpt2_speedrun_<device>_<date>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
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
    oom_retry,
    smoke_shard,
    train_bare,
    train_lightning,
    with_compile_options,
    with_model,
    yaml_compile_options,
    yaml_execution,
)
from benchmarks.peers.nanogpt_runner import train_nanogpt

SMOKE_SHAPE = dict(n_layer=2, n_head=2, n_embd=64)
SMOKE_VOCAB = 512


def make_specs(args: argparse.Namespace) -> dict[str, RunSpec]:
    sp_model, sp_optim, sp_sched, sp_raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    cl_model, cl_optim, cl_sched, cl_raw = load_yaml_config("gpt2-124m-classic")
    common = dict(steps=args.steps, micro_batch=args.micro_batch, accum=args.accum, seq_len=args.seq_len,
                  compile=not args.no_compile, amp=args.amp, warm=args.warm, val_every=args.val_every,
                  val_batch=args.micro_batch)
    # the classic config warms up for 100 of 1000 steps: keep that proportion in a short run
    cl_sched = replace(cl_sched, warmup_steps=max(1, args.steps // 10))
    speedrun = RunSpec(sp_model, sp_optim, sp_sched, yaml_execution(sp_raw), **common,
                       compile_options=yaml_compile_options(sp_raw) if not args.no_compile else None)
    classic = RunSpec(cl_model, cl_optim, cl_sched, yaml_execution(cl_raw), clip=1.0, **common,
                      compile_options=yaml_compile_options(cl_raw) if not args.no_compile else None)
    if args.smoke:
        small = dict(SMOKE_SHAPE, block_size=args.seq_len, vocab_size=SMOKE_VOCAB, vocab_multiple=1)
        speedrun = with_model(speedrun, **small, n_value_embeds=1,
                              skip_attn_layers=(1,))
        classic = with_model(classic, **small)
    # the recipe without its record-parity settings (for a same-run attribution of what they do)
    prev = with_model(speedrun, rope_base=10000.0, rope_truncate=False, logit_softcap=30.0, x0_mix=False,
                      embed_norm=False, skip_attn_layers=(), loss_impl="torch", head_fp8=False)
    prev = replace(prev, optim=replace(prev.optim, muon_momentum_start=None, muon_momentum_warmup_steps=0,
                                       muon_split_fused=False, muon_batched=False))
    unbatched = replace(speedrun, optim=replace(speedrun.optim, muon_batched=False))
    return {"speedrun": speedrun, "classic": classic, "prev": prev, "unbatched": unbatched}


def with_cdt(spec: RunSpec, on: bool) -> RunSpec:
    """The spec with inductor's ``coordinate_descent_tuning`` set on or off (other compile options kept)."""
    return with_compile_options(spec, coordinate_descent_tuning=on)


def ratio(a: dict, b: dict, key: str = "tokens_per_s") -> float | None:
    if a.get(key) and b.get(key):
        return round(a[key] / b[key], 4)
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, 500.0)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    p.add_argument("--warm", type=int, default=3, help="steps excluded from tokens/s (compile happens here)")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--accum", type=int, default=16, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--val-every", type=int, default=None,
                   help="validate every N steps (off the clock); 0: only after the last step (default 4, --smoke 2)")
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--smoke-compile", action="store_true", help="with --smoke: keep torch.compile on (slow on CPU)")
    p.add_argument("--only", default=None, help="comma-separated variant names to run")
    p.add_argument("--lightning-logger", default="tensorboard", choices=["tensorboard", "none"])
    p.add_argument("--need-s", type=float, default=75.0, help="seconds one variant needs (for skipping)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the row list this many times, every other time in reverse order; rows report the "
                        "median step time and each repeat's")
    p.add_argument("--sync-probe-steps", type=int, default=1,
                   help="Lightning variants: record host-device syncs during this many steps after warm-up")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")

    if args.smoke:
        args.steps, args.warm, args.micro_batch, args.accum, args.seq_len = 4, 1, 4, 2, 64
        args.val_tokens, args.no_compile, args.need_s = 4096, not args.smoke_compile, 0.0
        args.val_every = 2 if args.val_every is None else args.val_every
        args.amp = "fp32"  # CPUs have no fast bf16 matmul
        args.lightning_logger = "none"
    args.val_every = 4 if args.val_every is None else args.val_every
    deadline = deadline_from(args)
    dev = device()
    train_path, val_path = find_shards(args.data_dir)
    data = Tokens(train_path, val_path, dev, val_tokens=args.val_tokens,
                  train_tokens=1_000_000 if args.smoke else None, vocab_mod=SMOKE_VOCAB if args.smoke else None)
    specs = make_specs(args)
    log_dir = tempfile.mkdtemp(prefix="gpt2_bench_tb_")
    if args.smoke:  # the Lightning DataModule reads files: give it the same small-vocabulary tokens
        train_path = smoke_shard(data)
    sp, cl = specs["speedrun"], specs["classic"]
    # nanoGPT compiles with inductor's defaults and computes its own way (its model.py: SDPA's default kernels,
    # logits then F.cross_entropy); its spec says so rather than carrying the classic config's execution
    cl_peer = replace(cl, compile_options=None,
                      execution=replace(cl.execution, attn_backend="sdpa", loss_impl="torch"))
    nano_shape = SMOKE_SHAPE if args.smoke else None
    nano_vocab = SMOKE_VOCAB if args.smoke else 50304

    def lightning(s: RunSpec) -> dict[str, Any]:
        return train_lightning(s, data, train_path, args.lightning_logger, log_dir, args.sync_probe_steps)

    def mbx(s: RunSpec, f: int) -> RunSpec:  # same tokens per step in f times fewer, f times larger micro-batches
        f = max(1, min(f, s.accum))  # (never fewer than one micro-batch per step: tokens per step stay the same)
        return replace(s, micro_batch=f * s.micro_batch, accum=s.accum // f, val_batch=f * s.micro_batch)

    variants = {
        "ours-speedrun-bare": lambda: oom_retry(lambda s: train_bare(s, data), sp),
        "ours-speedrun-lightning": lambda: oom_retry(lightning, sp),
        "nanogpt": lambda: oom_retry(lambda s: train_nanogpt(s, data, nano_shape, vocab_size=nano_vocab), cl_peer),
        "ours-speedrun-mb64-bare": lambda: oom_retry(lambda s: train_bare(s, data), mbx(sp, 2)),
        "ours-speedrun-mb64-lightning": lambda: oom_retry(lightning, mbx(sp, 2)),
        "nanogpt-mb64": lambda: oom_retry(
            lambda s: train_nanogpt(s, data, nano_shape, vocab_size=nano_vocab), mbx(cl_peer, 2)),
        # nanoGPT's model with GPT-2's biases (its GPTConfig default): the architecture of our classic config
        "nanogpt-bias": lambda: oom_retry(
            lambda s: train_nanogpt(s, data, nano_shape, vocab_size=nano_vocab, bias=True), cl_peer),
        "nanogpt-bias-mb64": lambda: oom_retry(
            lambda s: train_nanogpt(s, data, nano_shape, vocab_size=nano_vocab, bias=True), mbx(cl_peer, 2)),
        # 4x: near an 80 GB card's memory; an OOM halves the micro-batch (the result's spec says what ran)
        "ours-speedrun-mb128-lightning": lambda: oom_retry(lightning, mbx(sp, 4)),
        "nanogpt-mb128": lambda: oom_retry(
            lambda s: train_nanogpt(s, data, nano_shape, vocab_size=nano_vocab), mbx(cl_peer, 4)),
        "ours-speedrun-nofp8-lightning": lambda: oom_retry(lightning, with_model(sp, head_fp8=False)),
        "ours-speedrun-fp8mlp-lightning": lambda: oom_retry(lightning, with_model(sp, mlp_fp8="auto")),
        "ours-speedrun-fp8mlp-mb64-lightning": lambda: oom_retry(lightning, with_model(mbx(sp, 2), mlp_fp8="auto")),
        # the recipe without its FP8 MLP and attention projections
        "ours-speedrun-nofp8mm-mb64-lightning": lambda: oom_retry(
            lightning, with_model(mbx(sp, 2), mlp_fp8=False, attn_fp8=False)),
        # the recipe without learned gains in its norms (as the record script)
        "ours-speedrun-nonormw-mb64-lightning": lambda: oom_retry(
            lightning, with_model(mbx(sp, 2), norm_weight=False)),
        # gains in QK-norm only (candidate: most of the speed of no gains, the attention temperature kept)
        "ours-speedrun-qkgain-mb64-lightning": lambda: oom_retry(lightning, with_model(mbx(sp, 2), norm_weight="qk")),
        "ours-speedrun-qkgain-mb128-lightning": lambda: oom_retry(
            lightning, with_model(mbx(sp, 4), norm_weight="qk")),
        # inductor's coordinate-descent tuning of its generated kernels (longer compile) on / off
        "ours-speedrun-cdt-mb64-lightning": lambda: oom_retry(lightning, with_cdt(mbx(sp, 2), True)),
        "ours-speedrun-cdt-mb128-lightning": lambda: oom_retry(lightning, with_cdt(mbx(sp, 4), True)),
        "ours-speedrun-nocdt-mb128-lightning": lambda: oom_retry(lightning, with_cdt(mbx(sp, 4), False)),
        "ours-speedrun-nofp8mm-mb64-bare": lambda: oom_retry(
            lambda s: train_bare(s, data), with_model(mbx(sp, 2), mlp_fp8=False, attn_fp8=False)),
        "ours-classic-bare": lambda: oom_retry(lambda s: train_bare(s, data), cl),
        "ours-classic-lightning": lambda: oom_retry(lightning, cl),
        # the classic config with inductor's coordinate-descent tuning (the same maths, re-tuned kernels)
        "ours-classic-cdt-lightning": lambda: oom_retry(lightning, with_cdt(cl, True)),
        "ours-classic-torchloss-lightning": lambda: oom_retry(lightning, with_model(cl, loss_impl="torch")),
        # attention through SDPA with cuDNN's fused kernel first (same maths; PyTorch's kernels behind it)
        "ours-classic-cudnn-lightning": lambda: oom_retry(lightning, with_model(cl, attn_backend="cudnn")),
        "ours-classic-cudnn-cdt-lightning": lambda: oom_retry(
            lightning, with_cdt(with_model(cl, attn_backend="cudnn"), True)),
        "ours-classic-cudnn-mb64-lightning": lambda: oom_retry(lightning, with_model(mbx(cl, 2), attn_backend="cudnn")),
        # nanoGPT's bench.py trains without biases in the linear layers and LayerNorms: the same here
        "ours-classic-nobias-lightning": lambda: oom_retry(lightning, with_model(cl, bias=False)),
        "ours-classic-mb64-lightning": lambda: oom_retry(lightning, mbx(cl, 2)),
        "ours-speedrun-torchce-bare": lambda: oom_retry(
            lambda s: train_bare(s, data), with_model(sp, loss_impl="torch", head_fp8=False)),
        "ours-speedrun-torchce-lightning": lambda: oom_retry(
            lightning, with_model(sp, loss_impl="torch", head_fp8=False)),
        "ours-speedrun-prev-bare": lambda: oom_retry(lambda s: train_bare(s, data), specs["prev"]),
        "ours-speedrun-unbatchedmuon-bare": lambda: oom_retry(lambda s: train_bare(s, data), specs["unbatched"]),
        "ours-speedrun-fp8head-bare": lambda: oom_retry(
            lambda s: train_bare(s, data), with_model(sp, loss_impl="torch", head_fp8=True)),
        "ours-speedrun-fp8head-lightning": lambda: oom_retry(
            lightning, with_model(sp, loss_impl="torch", head_fp8=True)),
        "ours-speedrun-chunkedfp8-lightning": lambda: oom_retry(lightning, with_model(sp, loss_impl="chunked_fp8")),
        "ours-speedrun-chunkedce-bare": lambda: oom_retry(
            lambda s: train_bare(s, data), with_model(sp, loss_impl="chunked")),
        # the chunked loss frees the float32 logits: twice the micro-batch, half the accumulation
        "ours-speedrun-chunkedce-mb2x-lightning": lambda: oom_retry(lightning, with_model(mbx(sp, 2), loss_impl="chunked")),
    }
    if args.only:  # in the order given (a long compile last, where the deadline may skip it)
        names = [n for n in args.only.split(",") if n]
        unknown = [n for n in names if n not in variants]
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; known: {sorted(variants)}")
        variants = {k: variants[k] for k in names}

    out_path = Path(args.out) if args.out else default_out("gpt2_speedrun_smoke" if args.smoke else "gpt2_speedrun")
    env = environment()
    payload: dict[str, Any] = {"smoke": args.smoke,
                               "data": {"train": str(train_path), "val": str(val_path),
                                        "train_tokens": len(data.train), "val_tokens": data.val_tokens},
                               "settings": vars(args), "results": {}}
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            position = sum(map(len, runs.values()))  # the run's place in the call
            runs[name].append({**guarded(name, variants[name], deadline, args.need_s), "position": position})
            payload["results"][name] = runs[name][0] if args.repeats == 1 else median_row(runs[name])
            payload["summary"] = summarize(payload["results"])
            # after every variant: a later crash keeps what was measured
            write_result(out_path, benchmark="gpt2_speedrun", env=env, command=command_line(argv), baseline=None,
                         results=payload)
    print_table(payload, env)
    print(f"wrote {out_path}")
    return payload


REPEAT_KEYS = ("position", "step_ms", "tokens_per_s", "mfu", "compile_s", "wall_s", "peak_mem_gb", "final_val_loss")


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a variant's repeats: the first timed repeat's record with the median step time (tokens/s
    and MFU follow from it: the tokens per step are the same), and each repeat's values under ``repeats``."""
    per = [{k: r[k] for k in REPEAT_KEYS if k in r} if "step_ms" in r
           else {"position": r["position"], "error": r.get("error") or r.get("skipped") or "no timing"}
           for r in rows]
    timed = [r for r in rows if "step_ms" in r]
    if not timed:
        return {**rows[-1], "repeats": per}
    first, med = timed[0], statistics.median(r["step_ms"] for r in timed)
    out = {**first, "step_ms": round(med, 2), "repeats": per,
           "step_ms_spread_pct": round(100 * (max(r["step_ms"] for r in timed) / min(r["step_ms"] for r in timed)
                                              - 1), 3)}
    out["tokens_per_s"] = round(first["tokens_per_s"] * first["step_ms"] / med, 1)
    if first.get("mfu") is not None:
        out["mfu"] = round(first["mfu"] * first["step_ms"] / med, 4)
    return out


def fastest(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["tokens_per_s"])


def summarize(results: dict[str, dict]) -> dict[str, Any]:
    g = {k: v for k, v in results.items() if "tokens_per_s" in v}
    s: dict[str, Any] = {}
    for kind in ("speedrun", "classic", "speedrun-mb64"):
        bare, light = g.get(f"ours-{kind}-bare", {}), g.get(f"ours-{kind}-lightning", {})
        r = ratio(light, bare)
        key = kind.replace("-", "_")
        s[f"lightning_over_bare_{key}"] = r
        s[f"lightning_overhead_pct_{key}"] = None if r is None else round(100 * (1 - r), 2)
    nano = g.get("nanogpt", {})
    for name in g:
        if not name.startswith("nanogpt"):
            s[f"{name}_over_nanogpt"] = ratio(g[name], nano)
    if "nanogpt-bias" in g:  # every classic row against the same architecture (GPT-2's biases) in nanoGPT
        for name in g:
            if name.startswith("ours-classic-") and "nobias" not in name:
                s[f"{name}_over_nanogpt_bias"] = ratio(g[name], g["nanogpt-bias"])
    # the goal: our recipe through Lightning, at the faster of its two geometries, against the faster peer run
    nanos = [g[k] for k in ("nanogpt", "nanogpt-mb64", "nanogpt-mb128") if k in g]
    ours = [g[k] for k in ("ours-speedrun-lightning", "ours-speedrun-mb64-lightning", "ours-speedrun-mb128-lightning")
            if k in g]
    if nanos and ours:
        best_nano, best_ours = fastest(nanos), fastest(ours)
        s["best_nanogpt_tokens_per_s"] = best_nano["tokens_per_s"]
        s["best_ours_lightning_tokens_per_s"] = best_ours["tokens_per_s"]
        s["best_ours_lightning_over_best_nanogpt"] = ratio(best_ours, best_nano)
    # the classic config as shipped through Lightning, at the faster of its geometries, against the faster peer
    # run; and what its fused loss adds
    classic = [g[k] for k in ("ours-classic-lightning", "ours-classic-mb64-lightning") if k in g]
    best = ratio(fastest(classic), fastest(nanos)) if nanos and classic else None
    s["best_classic_lightning_over_best_nanogpt"] = best
    # the same architecture on both sides: the classic config (GPT-2's biases) against nanoGPT with biases, and
    # the classic config without biases against nanoGPT as bench.py builds it (bias=False)
    nanos_bias = [g[k] for k in ("nanogpt-bias", "nanogpt-bias-mb64") if k in g]
    same = ratio(fastest(classic), fastest(nanos_bias)) if nanos_bias and classic else None
    s["best_classic_lightning_over_best_nanogpt_bias"] = same
    nobias = g.get("ours-classic-nobias-lightning")
    s["classic_nobias_lightning_over_nanogpt"] = ratio(nobias, nano) if nobias and nano else None
    same_arch = [r for r in (same, s["classic_nobias_lightning_over_nanogpt"]) if r is not None]
    s["goal_classic_ge_1p05x_nanogpt"] = (min(same_arch) >= 1.05 if same_arch
                                          else None if best is None else best >= 1.05)
    cdt = g.get("ours-classic-cdt-lightning")
    s["classic_cdt_lightning_over_classic_lightning"] = ratio(cdt, g["ours-classic-lightning"]) if (
        cdt and "ours-classic-lightning" in g) else None
    s["classic_fused_loss_over_torch_loss"] = ratio(g.get("ours-classic-lightning", {}),
                                                     g.get("ours-classic-torchloss-lightning", {}))
    # the Lightning overhead at the 32 x 1024 geometry, or at 64 x 1024 where only that pair ran
    over = s.get("lightning_overhead_pct_speedrun")
    over = s.get("lightning_overhead_pct_speedrun_mb64") if over is None else over
    s["goal_lightning_overhead_le_2pct"] = None if over is None else over <= 2.0
    best = s.get("best_ours_lightning_over_best_nanogpt", s.get("ours-speedrun-lightning_over_nanogpt"))
    s["goal_speedrun_ge_1p1x_nanogpt"] = None if best is None else best >= 1.1
    fp8 = s.get("ours-speedrun-fp8head-lightning_over_nanogpt")
    s["goal_speedrun_fp8head_ge_1p1x_nanogpt"] = None if fp8 is None else fp8 >= 1.1
    return s


def print_table(payload: dict[str, Any], env: dict[str, Any]) -> None:
    rows = payload["results"]
    print()
    print(f"{'variant':32} {'tok/s':>10} {'MFU':>6} {'step ms':>8} {'compile s':>9} {'peak GB':>8} "
          f"{'val loss':>9}  note")
    for name, r in rows.items():
        if "tokens_per_s" not in r:
            print(f"{name:32} {r.get('error') or r.get('skipped') or 'no timing'}"[:160])
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        peak = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        val = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-"
        print(f"{name:32} {r['tokens_per_s']:>10,.0f} {mfu:>6} {r['step_ms']:>8.1f} {r.get('compile_s', 0):>9.1f} "
              f"{peak:>8} {val:>9}  {r.get('stopped') or ''}")
    for k, v in payload.get("summary", {}).items():
        print(f"  {k}: {v}")
    print(f"device: {env['device']}  torch {env['torch']}  lightning {env['lightning']}")


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
