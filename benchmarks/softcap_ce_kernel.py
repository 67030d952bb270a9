"""The fused head loss kernel (``lightning_opt.ops.softcap_ce``): its running-maximum methods, with and without a cap.

Times, on one GPU, the kernel's training sweep (per-row loss + the logit gradient written in place) and its
evaluation sweep (loss only) on 32,768 rows of 50,304 bfloat16 logits (the classic GPT-2 step's head: 32 x 1024
tokens, the padded vocabulary), for:

- no cap (the classic GPT-2 head), ``online_max="lane"`` (a running maximum per lane: two exps per logit in the
  first sweep; the baseline) and ``"block"`` (one per row, from each block's maximum: one exp per logit);
- cap 15 (the speedrun head: the cap is the row maximum, ``online_max`` plays no part);
- cap 50 (above ``FIXED_MAX_CAP``: a running maximum again), both methods.

Each case's time is the median of ``--repeats`` means of ``--iters`` calls, the cases interleaved within each
repeat (the training sweep runs repeatedly over the same buffer: the kernel's work does not depend on the values
it reads). Each case's loss and gradient are checked against float32 torch on the first ``--check-rows`` rows,
and ``"block"`` against ``"lane"`` on every row. Also the head's forward matmul in bfloat16 and in FP8
(:func:`lightning_opt.ops.fp8.fp8_matmul_t`, casts included), and, given ``--old`` (a ``softcap_ce.py`` from git
history), that version's kernel with its defaults.

    python -m benchmarks.softcap_ce_kernel           # CUDA: benchmarks/results/softcap_ce_kernel_<device>.json, ~30 s on an H100
    python -m benchmarks.softcap_ce_kernel --smoke   # 16 rows x 300 on the CPU (Triton's interpreter with
                                                     # TRITON_INTERPRET=1, else the torch path): checks the script runs
    git show 63b3550:lightning_opt/ops/softcap_ce.py > /tmp/softcap_ce_old.py
    python -m benchmarks.softcap_ce_kernel --old /tmp/softcap_ce_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import command_line, device_slug, environment, write_result
from lightning_opt.ops import softcap_ce as new
from lightning_opt.ops.fp8 import fp8_matmul_t

ROOT = Path(__file__).resolve().parents[1]

FULL = dict(rows=32768, vocab=50304, width=768, warmup=3, iters=20, repeats=5, check_rows=1024,
            block_v=new.BLOCK_V)
SMOKE = dict(rows=16, vocab=300, width=32, warmup=1, iters=1, repeats=1, check_rows=8, block_v=128)
# (case, cap, online_max): the baseline of each cap first
CASES = (("no_cap_lane", None, "lane"), ("no_cap_block", None, "block"), ("cap15", 15.0, None),
         ("cap50_lane", 50.0, "lane"), ("cap50_block", 50.0, "block"))
# (case, cap) of an earlier softcap_ce.py given with --old, timed with its defaults
OLD_CASES = (("old_no_cap", None), ("old_cap15", 15.0), ("old_cap50", 50.0))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_ms(fns: dict[str, Callable[[], Any]], warmup: int, iters: int, repeats: int,
                   device: torch.device) -> dict[str, float]:
    """Median over ``repeats`` of the mean milliseconds of ``iters`` calls of each function, the functions taking
    turns within each repeat (after ``warmup`` calls of each)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t) / iters * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def _rows_kwargs(online_max: str | None, block_v: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"block_v": block_v}
    if online_max is not None:
        kw["online_max"] = online_max
    return kw


def reference_errors(base: torch.Tensor, y: torch.Tensor, cap: float | None, rows_fn: Callable[..., torch.Tensor],
                     kw: dict[str, Any]) -> dict[str, float]:
    """Largest loss and gradient differences from float32 torch (the exact tanh; ``F.cross_entropy``'s
    gradient) on ``base``'s rows."""
    x = base.float().requires_grad_()
    z = cap * torch.tanh(x / cap) if cap is not None else x
    ref = F.cross_entropy(z, y, reduction="none")
    ref.sum().backward()
    got_grad = base.clone()
    got = rows_fn(got_grad, y, cap, **kw)
    evaluated = rows_fn(base.clone(), y, cap, write_grad=False, **kw)
    return {"max_abs_loss_diff_vs_torch": float((got - ref.detach()).abs().max()),
            "max_abs_eval_loss_diff_vs_torch": float((evaluated - ref.detach()).abs().max()),
            "max_abs_grad_diff_vs_torch": float((got_grad.float() - x.grad).abs().max())}


def block_vs_lane(base: torch.Tensor, y: torch.Tensor, cap: float | None, block_v: int,
                  chunk: int = 4096) -> dict[str, float]:
    """Largest loss and gradient differences between the two methods on every row (gradients compared in
    float32, ``chunk`` rows at a time)."""
    ga, gb = base.clone(), base.clone()
    la = new.softcap_ce_rows_(ga, y, cap, block_v=block_v, online_max="lane")
    lb = new.softcap_ce_rows_(gb, y, cap, block_v=block_v, online_max="block")
    grad = max(float((ga[i:i + chunk].float() - gb[i:i + chunk].float()).abs().max())
               for i in range(0, base.shape[0], chunk))
    del ga, gb
    return {"max_abs_loss_diff": float((la - lb).abs().max()), "max_abs_grad_diff": grad,
            "max_rel_loss_diff": float(((la - lb).abs() / la.abs().clamp(min=1e-6)).max())}


def load_old(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("softcap_ce_old", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small rows on the CPU (seconds)")
    p.add_argument("--old", default=None, help="path of an earlier softcap_ce.py to time with its defaults")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default on CUDA: benchmarks/results/softcap_ce_kernel_<device>.json)")
    args = p.parse_args(argv)
    spec = dict(SMOKE if args.smoke else FULL)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("softcap_ce_kernel.py times CUDA kernels: run it on a GPU machine (or pass --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    n, v, d, block_v = spec["rows"], spec["vocab"], spec["width"], spec["block_v"]
    base = (torch.randn(n, v, device=device) * 6).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=device)
    buf = base.clone()
    old = load_old(args.old) if args.old else None
    fns: dict[str, Callable[[], Any]] = {}
    for name, cap, online_max in CASES:
        kw = _rows_kwargs(online_max, block_v)
        fns[f"{name}/train"] = lambda cap=cap, kw=kw: new.softcap_ce_rows_(buf, y, cap, **kw)
        fns[f"{name}/eval"] = lambda cap=cap, kw=kw: new.softcap_ce_rows_(base, y, cap, write_grad=False, **kw)
    if old is not None:
        for label, cap in OLD_CASES:
            fns[f"{label}/train"] = lambda cap=cap: old.softcap_ce_rows_(buf, y, cap)
            fns[f"{label}/eval"] = lambda cap=cap: old.softcap_ce_rows_(base, y, cap, write_grad=False)
    ms = interleaved_ms(fns, spec["warmup"], spec["iters"], spec["repeats"], device)
    check = base[:spec["check_rows"]].contiguous()
    check_y = y[:spec["check_rows"]].contiguous()
    rows: list[dict[str, Any]] = []
    labels = [(name, cap, online_max, new) for name, cap, online_max in CASES]
    if old is not None:
        labels += [(label, cap, None, old) for label, cap in OLD_CASES]
    for name, cap, online_max, mod in labels:
        kw = _rows_kwargs(online_max, block_v) if mod is new else {}
        rows.append({"case": name, "cap": cap, "online_max": online_max or ("default" if mod is new else "old"),
                     "train_ms": ms[f"{name}/train"], "eval_ms": ms[f"{name}/eval"],
                     **reference_errors(check, check_y, cap, mod.softcap_ce_rows_, kw)})
    by_case = {r["case"]: r for r in rows}
    speedup = {prefix: {sweep: by_case[f"{prefix}_lane"][sweep] / by_case[f"{prefix}_block"][sweep]
                                             for sweep in ("train_ms", "eval_ms")}
               for prefix in ("no_cap", "cap50")}
    agreement = {f"{prefix}_block_vs_lane": block_vs_lane(base, y, cap, block_v)
                 for prefix, cap in (("no_cap", None), ("cap50", 50.0))}
    head: dict[str, float] | None = None
    if device.type == "cuda":
        h = F.rms_norm(torch.randn(n, d, device=device), (d,)).to(torch.bfloat16)
        w = (0.05 * torch.randn(v, d, device=device)).to(torch.bfloat16)
        head = interleaved_ms({"bf16_ms": lambda: h @ w.t(), "fp8_ms": lambda: fp8_matmul_t(h, w)},
                              spec["warmup"], spec["iters"], spec["repeats"], device)
    kernel = "torch"
    if new.kernel_available(base):
        kernel = ("triton-interpreted" if type(new._softcap_ce_kernel).__name__ == "InterpretedFunction"
                  else "triton")
    result = {
        "smoke": args.smoke,
        "kernel": kernel,
        "default_online_max": new.ONLINE_MAX,
        "spec": {**spec, "logits": f"{n} x {v} bfloat16, randn * 6", "num_warps": new.NUM_WARPS,
                 "old": args.old},
        "rows": rows,
        "lane_time_over_block_time": speedup,
        "block_vs_lane_every_row": agreement,
        "head_forward_matmul": head,
        "elapsed_s": time.perf_counter() - t0,
    }
    out = args.out
    if out is None and not args.smoke:
        out = ROOT / "benchmarks" / "results" / f"softcap_ce_kernel_{device_slug()}.json"
    if out is not None:
        write_result(out, benchmark="softcap_ce_kernel", env=environment(on_gpu=device.type == "cuda"),
                     command=command_line(argv), baseline=None, results=result)
        print(f"wrote {out}", flush=True)
    for r in rows:
        print(f"{r['case']:>14}: train {r['train_ms']:.3f} ms, eval {r['eval_ms']:.3f} ms per {n} rows; vs torch: "
              f"loss {r['max_abs_loss_diff_vs_torch']:.2e}, grad {r['max_abs_grad_diff_vs_torch']:.2e}", flush=True)
    for k, s in speedup.items():
        print(f"{k}: lane time / block time: train x{s['train_ms']:.3f}, eval x{s['eval_ms']:.3f}", flush=True)
    if head is not None:
        print(f"head fwd bf16 {head['bf16_ms']:.2f} ms, fp8 (casts included) {head['fp8_ms']:.2f} ms", flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
