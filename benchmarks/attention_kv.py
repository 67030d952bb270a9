"""MHA vs GQA vs multi-latent attention (MLA) in a 124M-shape GPT: parameters, KV-cache size, speed.

Variants (12 layers, width 768, 12 heads of 64, RoPE, vocabulary 50304, otherwise GPT-2's blocks): MHA, GQA with
4 and 2 key/value heads, MLA with a 256- and a 128-dim latent and a 32-dim rope key (``GPTConfig.attention="mla"``).
For each: parameters, KV-cache bytes per token (``GPT.kv_cache_bytes_per_token``, checked against the bytes the
generation's ``KVCache`` allocated), training FLOPs per token, the training step (forward + backward, bfloat16
autocast, batch 16 x 1024 tokens; median over the timed steps after warm-up, CUDA events), and generation with the
cache (model in bfloat16, batch 8: a 1024 - ``--new-tokens`` token prompt prefilled, then one token per step up to
the 1024-token context, each step what ``GPT.generate`` runs once its cache is filled; median step time). Peak
memory per phase on CUDA. Eager PyTorch (no ``torch.compile``); a failing variant is recorded with its error and
the others still run.

    python -m benchmarks.attention_kv           # CUDA: benchmarks/results/attention_kv_<device>.json, ~1 min on an H100
    python -m benchmarks.attention_kv --smoke   # a tiny model on the CPU in seconds (checks the script runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import command_line, device_slug, environment, write_result
from lightning_opt.models.gpt2 import GPT, GPTConfig, KVCache

ROOT = Path(__file__).resolve().parents[1]

FULL = dict(shape=dict(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024),
            gqa=(4, 2), mla_ranks=(256, 128), rope_dim=32, batch=16, seq=1024, gen_batch=8, new_tokens=64,
            warmup=3, steps=10)
SMOKE = dict(shape=dict(vocab_size=256, n_layer=2, n_head=8, n_embd=64, block_size=32),
             gqa=(4, 2), mla_ranks=(32, 16), rope_dim=4, batch=2, seq=32, gen_batch=2, new_tokens=4,
             warmup=1, steps=2)


def variants(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Name -> the ``GPTConfig`` fields that differ from the MHA baseline."""
    out: dict[str, dict[str, Any]] = {"mha": {}}
    for kv in spec["gqa"]:
        out[f"gqa_kv{kv}"] = dict(n_kv_head=kv)
    for rank in spec["mla_ranks"]:
        out[f"mla_r{rank}_rope{spec['rope_dim']}"] = dict(attention="mla", mla_kv_rank=rank,
                                                         mla_rope_dim=spec["rope_dim"])
    return out


def timed(fn: Callable[[], Any], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``steps`` calls after ``warmup`` (CUDA events, read after one final sync)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def train_step_ms(model: GPT, spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Forward + backward of one ``batch x seq`` batch under bfloat16 autocast (float32 weights)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (spec["batch"], spec["seq"] + 1), generator=g).to(device)
    model.train()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    _peak_reset(device)
    times = timed(step, spec["warmup"], spec["steps"], device)
    ms = statistics.median(times)
    tokens = spec["batch"] * spec["seq"]
    return {"train_step_ms": ms, "train_step_ms_all": times, "train_tokens_per_s": tokens / ms * 1e3,
            "train_peak_mib": _peak_mib(device)}


def generation_ms(model: GPT, spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Prefill ``block_size - new_tokens`` tokens into a bfloat16 cache, then time one-token steps to the end."""
    cfg = model.config
    b, new = spec["gen_batch"], spec["new_tokens"]
    prompt_len = cfg.block_size - new
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).to(device)
    model.eval()
    model.to(torch.bfloat16)
    cache = KVCache(model, b, cfg.block_size)
    state: dict[str, torch.Tensor] = {}

    def prefill() -> None:
        cache.reset()
        state["next"] = model(prompt, kv_cache=cache)[:, -1].argmax(-1)

    def decode_step() -> None:  # GPT.generate's step with a filled cache: run the newest token, pick the next
        state["next"] = model(state["next"][:, None], kv_cache=cache)[:, -1].argmax(-1)

    _peak_reset(device)
    with torch.no_grad():
        prefill_ms = statistics.median(timed(prefill, 1, 2, device))
        prefill()
        warm = min(4, new // 4)
        for _ in range(warm):
            decode_step()
        times = timed(decode_step, 0, new - warm, device)
    assert cache.length == cfg.block_size, cache.length
    allocated = cache.nbytes()
    ms = statistics.median(times)
    return {"prefill_ms": prefill_ms, "prefill_tokens": b * prompt_len, "decode_step_ms": ms,
            "decode_step_ms_all": times, "decode_tokens_per_s": b / ms * 1e3,
            "cache_bytes_allocated": allocated, "cache_context": cfg.block_size,
            "generate_peak_mib": _peak_mib(device)}


def run_variant(name: str, fields: dict[str, Any], spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": name, **fields}
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(**spec["shape"], pos_emb="rope", **fields)
        model = GPT(cfg).to(device)
        attn = next(blk.attn for blk in model.blocks if blk.attn is not None)
        row.update(params=model.num_params(non_embedding=False), params_non_embedding=model.num_params(),
                   attn_params_per_layer=sum(p.numel() for p in attn.parameters()),
                   flops_per_token=model.flops_per_token(spec["seq"]),
                   kv_cache_bytes_per_token_bf16=model.kv_cache_bytes_per_token(torch.bfloat16))
        row.update(train_step_ms(model, spec, device))
        row.update(generation_ms(model, spec, device))
        expected = row["kv_cache_bytes_per_token_bf16"] * spec["gen_batch"] * cfg.block_size
        row["cache_bytes_match_formula"] = row["cache_bytes_allocated"] == expected
    except Exception as err:  # one failing variant must not stop the others
        row["error"] = f"{type(err).__name__}: {err}"
        row["traceback"] = traceback.format_exc(limit=4)
    finally:
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print({k: v for k, v in row.items() if not k.endswith("_all") and k != "traceback"}, flush=True)
    return row


def relative(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant over MHA: cache bytes, training step time, decode step time, parameters."""
    base = next((r for r in rows if r["variant"] == "mha" and "error" not in r), None)
    if base is None:
        return {}
    keys = ("kv_cache_bytes_per_token_bf16", "train_step_ms", "decode_step_ms", "params")
    return {r["variant"]: {k: r[k] / base[k] for k in keys} for r in rows if "error" not in r}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (seconds)")
    p.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps (default 10; smoke 2)")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default on CUDA: benchmarks/results/attention_kv_<device>.json)")
    args = p.parse_args(argv)
    spec = dict(SMOKE if args.smoke else FULL)
    if args.steps is not None:
        spec["steps"] = args.steps
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    t0 = time.perf_counter()
    rows = [run_variant(name, fields, spec, device) for name, fields in variants(spec).items()]
    result = {
        "smoke": args.smoke,
        "device_type": device.type,
        "spec": {k: v for k, v in spec.items()},
        "rows": rows,
        "relative_to_mha": relative(rows),
        "elapsed_s": time.perf_counter() - t0,
    }
    out = args.out
    if out is None and device.type == "cuda" and not args.smoke:
        out = ROOT / "benchmarks" / "results" / f"attention_kv_{device_slug()}.json"
    if out is not None:
        write_result(out, benchmark="attention_kv", env=environment(on_gpu=device.type == "cuda"),
                     command=command_line(argv), baseline=None, results=result)
        print(f"wrote {out}", flush=True)
    for name, rel in result["relative_to_mha"].items():
        print(f"{name:>18}: " + ", ".join(f"{k} x{v:.3f}" for k, v in rel.items()), flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
