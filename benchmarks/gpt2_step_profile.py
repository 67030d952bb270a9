"""Where a step of the GPT-2 speedrun recipe spends its GPU time, and tokens/s under a few throughput levers.

Bare loop (our model and optimizer factory, ``torch.compile``, bf16 autocast) on the novels shards, full
optimizer steps of 16 micro-batches of 32 x 1024 tokens. Variants, each timed over 4 steps after 2 warm-up
steps, in one process on one GPU:

- ``base``: the recipe as configured; then one step under ``torch.profiler``: GPU busy time and the 40
  kernels that take the most of it;
- ``cudnn``: the same with SDPA forced to cuDNN attention;
- ``mb64``: micro-batches of 64 x 1024, half the accumulation (same tokens per step);
- ``torchce`` / ``fp8head``: ``loss_impl="torch"`` without / with the FP8 head;
- ``cdt``: inductor's ``coordinate_descent_tuning``;
- ``mb64prof``: ``mb64`` with the kernel profile; ``mb128``: micro-batches of 128 x 1024 (4 per step);
- ``fp8mlp64prof`` / ``fp8mlp128``: ``mlp_fp8="auto"`` (both MLP matmuls in FP8) at 64 (profiled) / 128 x 1024;
- ``nofp8mm64`` / ``fp8mm64prof``: at 64 x 1024, without / with (profiled) FP8 MLP and attention projections;
- ``fp8mm64`` and ``fp8mm64-fastacc`` (FP8 backward matmuls with fast accumulation,
  ``GPTConfig.fp8_backward_fast_accum``).

    python -m benchmarks.gpt2_step_profile --data-dir .data/novels --only base,cudnn,mb64   # GPU, ~40 s each

Prints the figures and writes them as JSON to ``--out`` (default ``$OUT/g1_probe.json`` or /tmp).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import defaultdict
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks._results import command_line, environment, write_result
from benchmarks.gpt2_common import (
    RunSpec,
    Tokens,
    build_model_and_optimizer,
    find_shards,
    load_yaml_config,
    with_model,
    yaml_execution,
)


def run(spec: RunSpec, data: Tokens, ctx=contextlib.nullcontext, profile: bool = False,
        inductor: dict | None = None) -> dict:
    import torch._dynamo
    import torch._inductor.config as ic

    dev = data.device
    torch._dynamo.reset()
    restore = contextlib.ExitStack()
    restore.enter_context(ic.patch(inductor or {}))  # inductor settings for this variant only
    try:
        model, opt, sched = build_model_and_optimizer(spec, dev)
        model.compile(dynamic=False)
        pos = [0]

        def step() -> None:
            with ctx():
                for _ in range(spec.accum):
                    x, y = data.train_batch(pos[0], spec.micro_batch, spec.seq_len)
                    pos[0] += 1
                    with torch.autocast(dev.type, torch.bfloat16):
                        loss = model(x, y)
                    (loss / spec.accum).backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        n = 4
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        out = dict(step_ms=round(dt * 1000, 1), tokens_per_s=round(spec.micro_batch * spec.accum * spec.seq_len / dt),
                   compile_and_2_steps_s=round(warm_s, 1), peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof

            with prof(activities=[ProfilerActivity.CUDA]) as p:
                step()
                torch.cuda.synchronize()
            by: dict[str, float] = defaultdict(float)
            for e in p.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by[e.name[:90]] += e.device_time / 1000
            out["gpu_busy_ms"] = round(sum(by.values()), 1)
            out["top_kernels_ms"] = {k: round(v, 2) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:40]}
        return out
    finally:
        restore.close()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="novels shards (default: $LIGHTNING_OPT_DATA_DIR, else .data/novels)")
    p.add_argument("--only", default="base,cudnn,mb64,torchce,fp8head,cdt")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "g1_probe.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpt2_step_profile.py profiles CUDA kernels: run it on a GPU machine")
    torch.set_float32_matmul_precision("high")
    dev = torch.device("cuda")
    m, o, s, raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    base = RunSpec(m, o, s, yaml_execution(raw), steps=20, micro_batch=32, accum=16)
    tr, va = find_shards(a.data_dir)
    data = Tokens(tr, va, dev, val_tokens=65536)
    fp8mm64 = with_model(replace(base, micro_batch=64, accum=8), mlp_fp8="auto", attn_fp8="auto")

    variants = {
        "base": lambda: run(base, data, profile=True),
        "cudnn": lambda: run(base, data, ctx=lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
        "mb64": lambda: run(replace(base, micro_batch=64, accum=8), data),
        "torchce": lambda: run(with_model(base, loss_impl="torch", head_fp8=False), data),
        "fp8head": lambda: run(with_model(base, loss_impl="torch", head_fp8=True), data),
        "cdt": lambda: run(base, data, inductor={"coordinate_descent_tuning": True}),
        "mb64prof": lambda: run(replace(base, micro_batch=64, accum=8), data, profile=True),
        "mb128": lambda: run(replace(base, micro_batch=128, accum=4), data),
        "fp8mlp64prof": lambda: run(with_model(replace(base, micro_batch=64, accum=8), mlp_fp8="auto"), data,
                                    profile=True),
        "fp8mlp128": lambda: run(with_model(replace(base, micro_batch=128, accum=4), mlp_fp8="auto"), data),
        "fp8mm64": lambda: run(fp8mm64, data),
        "fp8mm64-fastacc": lambda: run(with_model(fp8mm64, fp8_backward_fast_accum=True), data),
        "nofp8mm64": lambda: run(with_model(replace(base, micro_batch=64, accum=8), mlp_fp8=False, attn_fp8=False),
                                 data),
        "fp8mm64prof": lambda: run(with_model(replace(base, micro_batch=64, accum=8), mlp_fp8="auto", attn_fp8="auto"),
                                   data, profile=True),
    }
    res: dict = {}
    for name in a.only.split(","):
        try:
            res[name] = variants[name]()
        except Exception as err:  # one failing variant must not lose the others
            res[name] = {"error": repr(err)[:300]}
        r = res[name]
        print(name, {k: v for k, v in r.items() if k != "top_kernels_ms"}, flush=True)
        for k, v in r.get("top_kernels_ms", {}).items():
            print(f"  {v:8.2f} {k}")
    write_result(a.out, benchmark="gpt2_step_profile", env=environment(), command=command_line(argv), baseline=None,
                 results=res)
    return res


if __name__ == "__main__":
    main()
