"""GPT-2 ablation table: one toggle per row against the speedrun baseline, at a fixed token budget.

Baseline: ``gpt2-124m-speedrun`` (the recipe's YAML) trained by the bare loop (``gpt2_common.train_bare``)
for ``--steps`` steps of ``--micro-batch`` x ``--seq-len`` tokens, bf16 autocast, PyTorch SDPA, Muon +
Adam, **eager** (``torch.compile`` costs ~40 s per row on an H100, so only the ``compile`` rows compile; the
tokens/s of every other row is eager tokens/s, comparable between rows, not with gpt2_speedrun.py). Each row
changes one thing; rows report peak memory, tokens/s (warm-up steps excluded), val loss on the first
``--val-tokens`` val tokens at the end, the deltas vs the baseline and a verdict. Missing optional packages
(flash-attn, bitsandbytes) are recorded as such (with the fallback used), not hidden.

    python benchmarks/gpt2_ablation.py                 # GPU, ~3 minutes on an H100 (rows past the deadline skip)
    python benchmarks/gpt2_ablation.py --smoke         # tiny model on CPU, about a minute

Writes ``benchmarks/results/gpt2_ablation_<device>_<date>.json`` and regenerates ``docs/benchmarks/gpt2.md``
through ``benchmarks/gpt2_report.py`` (smoke runs write the page to a temporary folder instead).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpt2_common import (  # noqa: E402
    RunSpec,
    Tokens,
    add_common_args,
    deadline_from,
    default_out,
    device,
    find_shards,
    guarded,
    load_yaml_config,
    train_bare,
    with_model,
    write_json,
    yaml_execution,
)
from result_header import environment  # noqa: E402

from lightning_opt.optim.factory import OptimConfig  # noqa: E402

Row = tuple[str, str, Callable[[RunSpec], RunSpec], str]


def _fp8_mode() -> bool | str:
    """True where this machine's GPU has FP8 matmuls, else "auto" (which then stays in the compute dtype)."""
    from lightning_opt.ops.fp8 import fp8_supported

    return True if torch.cuda.is_available() and fp8_supported("cuda") else "auto"


def _adamw(spec: RunSpec, **kw: Any) -> RunSpec:
    return replace(spec, optim=OptimConfig(name=kw.pop("name", "adamw"), lr=6e-4, betas=(0.9, 0.95),
                                           weight_decay=0.1, **kw))


def _seq(spec: RunSpec, t: int) -> RunSpec:
    tokens = spec.micro_batch * spec.seq_len
    spec = replace(spec, seq_len=t, micro_batch=max(1, tokens // t))
    return with_model(spec, block_size=max(t, spec.model.block_size))


def rows(steps: int, classic_heads: int = 12) -> list[Row]:
    """(name, toggle, change, when to use). Baseline and compile first, then the cheap eager rows; the
    other compiled rows last (rows past the deadline are skipped and say so)."""
    third = max(1, steps // 3)
    return [
        ("baseline", "speedrun config (eager, bf16, SDPA, Muon)", lambda s: s, "reference row"),
        ("compile", "torch.compile on (tokens/s comparable to the eager rows)", lambda s: replace(s, compile=True),
         "always for runs longer than a few minutes"),
        ("fp32", "bf16 autocast -> fp32 (TF32 matmuls)", lambda s: replace(s, amp="fp32"),
         "use bf16 on any GPU that has it; fp32 only to debug numerics"),
        ("flash_attn", "SDPA -> flash-attn", lambda s: with_model(s, attn_backend="flash"),
         "flash-attn adds sliding windows to the fast path; SDPA's flash kernel covers plain causal"),
        ("adamw_fused", "Muon+Adam -> fused AdamW (lr 6e-4)", lambda s: _adamw(s, fused=True),
         "Muon for hidden matrices unless you must match an AdamW baseline"),
        ("adamw_unfused", "Muon+Adam -> for-each AdamW (lr 6e-4)", lambda s: _adamw(s, fused=False),
         "compare with adamw_fused: fused is the default on CUDA"),
        ("adamw_8bit", "Muon+Adam -> bitsandbytes 8-bit AdamW", lambda s: _adamw(s, name="adamw8bit"),
         "8-bit states save optimizer memory on large models; no speed gain at 124M"),
        ("grad_checkpoint", "activation checkpointing per block", lambda s: with_model(s, grad_checkpoint=True),
         "use when activations do not fit; costs a recomputed forward"),
        ("seq_2048", "seq len 1024 -> 2048 (same tokens/step)", lambda s: _seq(s, 2048),
         "longer context costs attention FLOPs; use when the task needs it"),
        ("seq_4096", "seq len 1024 -> 4096 (same tokens/step)", lambda s: _seq(s, 4096),
         "as seq_2048, more so"),
        ("seq_curriculum", "seq len T/4 -> T/2 -> T over the run (same tokens/step)",
         lambda s: replace(s, seq_schedule=[(0, s.seq_len // 4), (third, s.seq_len // 2), (2 * third, s.seq_len)]),
         "short sequences early are cheaper; check the final loss"),
        ("no_rope", "RoPE -> learned positions", lambda s: with_model(s, pos_emb="learned"),
         "keep RoPE"),
        ("no_rmsnorm", "RMSNorm -> LayerNorm", lambda s: with_model(s, norm="layernorm"),
         "RMSNorm is cheaper and as good"),
        ("no_qk_norm", "QK-norm off", lambda s: with_model(s, qk_norm=False),
         "QK-norm stabilises high learning rates (Muon)"),
        ("gelu", "ReLU^2 -> GELU", lambda s: with_model(s, mlp="gelu"), "ReLU^2 is the speedrun's choice"),
        ("swiglu", "ReLU^2 -> SwiGLU (same parameters)", lambda s: with_model(s, mlp="swiglu"),
         "SwiGLU is the LLaMA default"),
        ("gqa", "6 KV heads -> 2 (GQA)", lambda s: with_model(s, n_kv_head=2),
         "GQA shrinks the KV cache for inference; little training gain at 124M"),
        # architecture variants the library does not carry: benchmarks/gpt2_variants.py builds them
        ("mtp_k2", "multi-token prediction, k=2 (one extra head; gpt2_variants.py)",
         lambda s: with_model(s, mtp_heads=1), "an auxiliary signal; pays off on larger models"),
        ("moe_2", "dense MLP -> MoE, 2 experts top-1 (gpt2_variants.py)",
         lambda s: with_model(s, moe_experts=2, moe_top_k=1),
         "dense-evaluated experts here: a quality probe, not a speed feature"),
        ("no_value_embeds", "value embeddings off", lambda s: with_model(s, n_value_embeds=0),
         "value embeddings add parameters (embeddings only) for loss"),
        ("no_unet", "U-net skips off", lambda s: with_model(s, unet_skips=False), "U-net skips are nearly free"),
        ("no_softcap", "logit soft-cap off", lambda s: with_model(s, logit_softcap=None),
         "the soft-cap stabilises early training"),
        ("softcap_30", "logit soft-cap 15 -> 30", lambda s: with_model(s, logit_softcap=30.0),
         "15 is the 2025-01-04 record's value and the recipe's"),
        ("no_x0_mix", "x0 mixing off (x = a x + b x0 per block)", lambda s: with_model(s, x0_mix=False),
         "two scalars per block"),
        ("no_embed_norm", "embedding RMS norm off", lambda s: with_model(s, embed_norm=False),
         "free"),
        ("attn_every_layer", "attention in layer 7 too", lambda s: with_model(s, skip_attn_layers=()),
         "the record drops it: one attention less per step"),
        ("rope_full", "half-truncated RoPE (base 1024) -> full RoPE (base 10000)",
         lambda s: with_model(s, rope_truncate=False, rope_base=10000.0), "the record's RoPE is the truncated one"),
        ("muon_fused_qkv", "Muon: q/k/v orthogonalised as one matrix",
         lambda s: replace(s, optim=replace(s.optim, muon_split_fused=False)),
         "the record keeps q, k, v as separate matrices"),
        ("no_momentum_warmup", "Muon momentum 0.95 from the start (no 0.85 -> 0.95 warmup)",
         lambda s: replace(s, optim=replace(s.optim, muon_momentum_start=None)), "the record warms it up"),
        ("muon_polar_express", "Muon with a quintic per Newton-Schulz step (Polar-Express-style coefficients)",
         lambda s: replace(s, optim=replace(s.optim, muon_ns_coefficients="polar_express")),
         "closer to the exact orthogonalisation at the same cost; keep it if its loss is lower"),
        ("muon_normuon", "Muon + per-neuron second-moment normalisation (NorMuon-style, beta2 0.95)",
         lambda s: replace(s, optim=replace(s.optim, muon_normuon_beta2=0.95)),
         "evens out neurons' update sizes at the same update norm; keep it if its loss is lower"),
        ("muon_unbatched", "Muon one matrix at a time (not batched by shape)",
         lambda s: replace(s, optim=replace(s.optim, muon_batched=False)), "same update, more kernel launches"),
        ("no_norm_gain", "no learned gains in the norms (norm_weight: false, as the record script)",
         lambda s: with_model(s, norm_weight=False),
         "1.7% more tokens/s, but the loss fell behind in the time-to-target run (docs/gpt2.md): keep the gains"),
        ("qk_gain_only", "learned gains only in QK-norm (norm_weight: qk)",
         lambda s: with_model(s, norm_weight="qk"), "candidate between the two: measure before use"),
        ("fp8_head", "the fused loss's head forward matmul in FP8 (the recipe's head_fp8: auto on H100-class GPUs)",
         lambda s: with_model(s, head_fp8="auto"), "on H100-class GPUs; a no-op elsewhere"),
        # eager rows: "auto" keeps the MLP and attention in bf16 outside torch.compile, so these insist on FP8
        # where the GPU has it (and stay "auto", a no-op, elsewhere)
        ("fp8_mlp", "both MLP matmuls in FP8 with static scales (mlp_fp8)",
         lambda s: with_model(s, mlp_fp8=_fp8_mode()), "with torch.compile on H100-class GPUs (eager it is slower)"),
        ("fp8_attn", "the attention projections (q/k/v and output) in FP8 with static scales (attn_fp8)",
         lambda s: with_model(s, attn_fp8=_fp8_mode()), "with torch.compile on H100-class GPUs (eager it is slower)"),
        ("fp8_all", "head, MLP and attention projections in FP8 (the speedrun recipe's setting)",
         lambda s: with_model(s, head_fp8="auto", mlp_fp8=_fp8_mode(), attn_fp8=_fp8_mode()),
         "the recipe's setting on H100-class GPUs, with torch.compile"),
        ("torch_ce", "fused soft-capped loss (Triton) -> torch soft-cap + cross-entropy (eager here)",
         lambda s: with_model(s, loss_impl="torch"), "the fused kernel is one pass for loss and logit gradient"),
        ("half_batch", "half the tokens per step, twice the steps (same tokens)",
         lambda s: replace(s, micro_batch=max(1, s.micro_batch // 2), steps=2 * s.steps, warm=2 * s.warm),
         "more updates per token (here by halving the micro-batch, which costs tokens/s; a recipe halves the "
         "accumulation instead and keeps the speed)"),
        ("chunked_ce", "chunked soft-capped cross-entropy (eager here)",
         lambda s: with_model(s, loss_impl="chunked"),
         "saves the [tokens x vocab] float32 logits; speed needs compile (see gpt2_speedrun.py)"),
        ("classic_arch", "all speedrun features off + AdamW (the classic GPT-2)",
         lambda s: _adamw(with_model(s, pos_emb="learned", norm="layernorm", bias=True, qk_norm=False, mlp="gelu",
                                     tie_embeddings=True, zero_init_proj=False, logit_softcap=None,
                                     n_value_embeds=0, unet_skips=False, n_head=classic_heads)),
         "the nanoGPT baseline, for scale"),
        ("compile_chunked_ce", "torch.compile + chunked cross-entropy",
         lambda s: with_model(replace(s, compile=True), loss_impl="chunked"),
         "compare with the compile row"),
        ("compile_fp8_head", "torch.compile + chunked cross-entropy with the head in FP8",
         lambda s: with_model(replace(s, compile=True), loss_impl="chunked_fp8"),
         "compare with the compile row; H100-class GPUs only"),
    ]


def verdict(row: dict[str, Any], base: dict[str, Any], note: str) -> str:
    if row.get("error"):
        return f"not measured ({row['error'][:80]}); {note}"
    if row.get("skipped"):
        return f"skipped ({row['skipped']})"
    if row is base:
        return "reference"
    parts = []
    if row.get("d_tokens_per_s_pct") is not None:
        d = row["d_tokens_per_s_pct"]
        parts.append("same speed" if abs(d) < 2 else f"{abs(d):.0f}% {'faster' if d > 0 else 'slower'}")
    if row.get("d_val_loss") is not None:
        d = row["d_val_loss"]
        parts.append("same loss" if abs(d) < 0.01 else f"loss {'better' if d < 0 else 'worse'} by {abs(d):.3f}")
    if row.get("d_peak_mem_pct") is not None and abs(row["d_peak_mem_pct"]) >= 5:
        d = row["d_peak_mem_pct"]
        parts.append(f"{abs(d):.0f}% {'more' if d > 0 else 'less'} memory")
    return (", ".join(parts) + "; " if parts else "") + note


def add_deltas(results: dict[str, dict[str, Any]], notes: dict[str, str]) -> None:
    base = results.get("baseline", {})
    for name, r in results.items():
        for key, out, pct in (("tokens_per_s", "d_tokens_per_s_pct", True), ("final_val_loss", "d_val_loss", False),
                              ("peak_mem_gb", "d_peak_mem_pct", True)):
            if r.get(key) is not None and base.get(key):
                r[out] = round(100 * (r[key] / base[key] - 1), 2) if pct else round(r[key] - base[key], 4)
        r["verdict"] = verdict(r, base, notes.get(name, ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, 200.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--val-tokens", type=int, default=262_144)
    p.add_argument("--only", default=None, help="comma-separated row names (baseline is always run)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate docs/benchmarks/gpt2.md")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warm, args.micro_batch, args.seq_len, args.val_tokens = 4, 1, 4, 64, 2048
        args.deadline_s = max(args.deadline_s, 900.0)  # slow shared CPUs: never skip rows in a smoke run
    deadline = deadline_from(args)
    dev = device()
    train_path, val_path = find_shards(args.data_dir)
    model, optim, sched, raw = load_yaml_config("gpt2-124m-speedrun")
    # the FP8 matmuls are rows of their own (fp8_head, fp8_mlp, fp8_attn, fp8_all): every other row toggles one
    # thing against bfloat16 matmuls
    execution = replace(yaml_execution(raw), head_fp8=False, mlp_fp8=False, attn_fp8=False)
    base = RunSpec(model, optim, sched, execution, steps=args.steps, micro_batch=args.micro_batch, accum=1,
                   seq_len=args.seq_len, compile=False, amp="bf16", warm=args.warm, val_every=0,
                   val_batch=args.micro_batch, val_seq_len=args.seq_len)
    vocab_mod = None
    if args.smoke:
        vocab_mod = 512
        base = with_model(replace(base, amp="fp32"), n_layer=2, n_head=2, n_embd=64, block_size=64,
                          vocab_size=512, vocab_multiple=1, n_value_embeds=1, skip_attn_layers=(1,))
    data = Tokens(train_path, val_path, dev, val_tokens=args.val_tokens,
                  train_tokens=1_000_000 if args.smoke else None, vocab_mod=vocab_mod)
    table = rows(args.steps, classic_heads=2 if args.smoke else 12)
    if args.smoke and not args.only:  # keep the smoke run short: a cheap subset crossing every code path
        keep = {"baseline", "flash_attn", "adamw_8bit", "grad_checkpoint", "seq_curriculum", "seq_2048", "gqa",
                "mtp_k2", "moe_2", "chunked_ce", "classic_arch"}
        table = [r for r in table if r[0] in keep]
    if args.only:
        keep = set(args.only.split(",")) | {"baseline"}
        table = [r for r in table if r[0] in keep]
    out_path = Path(args.out) if args.out else default_out("gpt2_ablation_smoke" if args.smoke else "gpt2_ablation")
    payload: dict[str, Any] = {
        "benchmark": "gpt2_ablation", "env": environment(), "smoke": args.smoke, "settings": vars(args),
        "baseline_spec": base.describe(), "rows": {},
        "notes": ["eager (no torch.compile) except the compile rows",
                  f"budget: {args.steps} steps x {args.micro_batch * args.seq_len} tokens; val on the first "
                  f"{data.val_tokens} val tokens in {args.seq_len}-token windows for every row (also the "
                  "seq-len rows)", "tokens/s excludes the first warm-up steps"],
    }
    notes = {n: w for n, _, _, w in table}
    for name, toggle, change, _ in table:
        need = 75.0 if "compile" in name else 12.0
        spec = change(base)

        def run(spec: RunSpec = spec) -> dict[str, Any]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = train_bare(spec, data, init_on_device=True)
            msgs = sorted({str(w.message)[:300] for w in caught if "fall" in str(w.message).lower()})
            if msgs:
                out["fallback"] = msgs
            return out

        r = guarded(name, run, deadline, 0 if args.smoke else need)
        r["toggle"] = toggle
        payload["rows"][name] = r
        add_deltas(payload["rows"], notes)
        write_json(out_path, payload)
    print_table(payload)
    print(f"wrote {out_path}")
    if not args.no_report:
        try:
            import gpt2_report

            doc = Path(tempfile.mkdtemp()) / "gpt2.md" if args.smoke else None
            print(f"report: {gpt2_report.main(['--ablation', str(out_path)] + (['--doc', str(doc)] if doc else []))}")
        except Exception as err:  # noqa: BLE001 - the JSON is what matters on the device
            print(f"report not generated ({type(err).__name__}: {err}); run benchmarks/gpt2_report.py later")
    return payload


def print_table(payload: dict[str, Any]) -> None:
    print()
    print(f"{'row':20} {'tok/s':>9} {'d tok/s':>8} {'peak GB':>8} {'val loss':>9} {'d loss':>8}  verdict")
    for name, r in payload["rows"].items():
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        dt = f"{r['d_tokens_per_s_pct']:+.1f}%" if r.get("d_tokens_per_s_pct") is not None else "-"
        pk = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        vl = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-"
        dl = f"{r['d_val_loss']:+.4f}" if r.get("d_val_loss") is not None else "-"
        print(f"{name:20} {tps:>9} {dt:>8} {pk:>8} {vl:>9} {dl:>8}  {r.get('verdict', '')[:90]}")


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
