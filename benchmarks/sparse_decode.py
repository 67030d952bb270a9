"""Sparse vs dense CLT decode, and exact BatchTopK selection vs torch.topk, on one GPU.

Part 1 (decode): a 12-layer CLT decoder (``W_dec[l]`` ``[F, L-l, d]``, F=8192 per layer, d=768) applied to
sparse activations with ``k`` active entries per token (over all layers), 4096 tokens, k in {16, 64, 200}:
dense ``acts[l] @ W_dec[l]`` (what a dense CLT does) vs ``clt_sparse_decode`` with the Triton kernel and
with the ``embedding_bag`` fallback; forward and forward+backward.

Part 2 (selection): ``global_batch_topk`` (single process) on ``[4096, 12 * 8192]`` with k=200 (K = 819,200
of 402,653,184 entries) vs ``torch.topk(x.flatten(), K)``, float32 and bfloat16; dense output and sparse
``(indices, values)`` output.

Every variant is timed in this process with CUDA events (median of ``--iters`` after ``--warmup``); a failing
variant is recorded with its error and the others still run.

    python -m benchmarks.sparse_decode            # CUDA, about 1-2 minutes on an H100
    python -m benchmarks.sparse_decode --smoke    # CPU, seconds (checks the script runs)
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._results import RESULTS, command_line, environment, write_result
from lightning_opt.ops import global_topk
from lightning_opt.ops.global_topk import batch_topk_threshold_sparse, global_batch_topk
from lightning_opt.ops.sparse_decode import clt_sparse_decode


def timeit(fn: Callable[[], Any], warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sparse_acts(tokens: int, layers: int, features: int, k: int, device: torch.device, seed: int = 0):
    """Flat ascending indices into ``[L, N, F]`` with ``k`` entries per token over all layers, and values."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_token = torch.rand(tokens, layers * features, generator=gen).topk(k, dim=1).indices  # distinct
    layer, feat = per_token // features, per_token % features
    token = torch.arange(tokens)[:, None].expand_as(per_token)
    flat = ((layer * tokens + token) * features + feat).reshape(-1).sort().values
    vals = torch.rand(flat.numel(), generator=gen) + 0.1
    return flat.to(device), vals.to(device)


def decode_variants(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    n, L, nf, d = args.tokens, args.layers, args.features, args.d_model
    gen = torch.Generator(device="cpu").manual_seed(1)
    w_dec = [
        (torch.randn(nf, L - src, d, generator=gen) / 30).to(device=device, dtype=dtype).requires_grad_(True)
        for src in range(L)
    ]
    rows = []
    for k in args.ks:
        idx, vals = sparse_acts(n, L, nf, k, device)
        vals = vals.to(dtype).requires_grad_(True)
        dense_acts = torch.zeros(L * n * nf, device=device, dtype=dtype)
        dense_acts[idx] = vals.detach()
        dense_acts = dense_acts.view(L, n, nf).requires_grad_(True)

        def dense_fwd(acts: torch.Tensor = dense_acts) -> torch.Tensor:
            out = torch.zeros(n, L, d, device=device, dtype=torch.float32)
            for src in range(L):
                out[:, src:] += (acts[src] @ w_dec[src].reshape(nf, -1)).view(n, L - src, d).float()
            return out

        def sparse_fwd(
            backend: str, idx: torch.Tensor = idx, vals: torch.Tensor = vals
        ) -> Callable[[], torch.Tensor]:
            return lambda: clt_sparse_decode(idx, vals, w_dec, n, backend=backend)

        variants = {"dense_matmul": dense_fwd, "sparse_torch": sparse_fwd("torch")}
        if device.type == "cuda":
            variants["sparse_triton"] = sparse_fwd("triton")
        ref = None
        for name, fwd in variants.items():
            row: dict[str, Any] = {"part": "decode", "k": k, "variant": name, "dtype": str(dtype)}
            try:
                with torch.no_grad():
                    out = fwd()
                if ref is None:
                    ref = out.float()
                row["max_abs_diff_vs_dense"] = float((out.float() - ref).abs().max())
                with torch.no_grad():
                    row["fwd_ms"] = timeit(fwd, args.warmup, args.iters, device)

                def fwd_bwd(fwd: Callable[[], torch.Tensor] = fwd) -> None:
                    fwd().float().square().mean().backward()

                row["fwd_bwd_ms"] = timeit(fwd_bwd, args.warmup, args.iters, device)
            except Exception as err:  # one failing variant must not stop the others
                row["error"] = f"{type(err).__name__}: {err}"
                row["traceback"] = traceback.format_exc(limit=3)
            for t in (*w_dec, vals, dense_acts):
                t.grad = None
            rows.append(row)
            print(row, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bisection_kth_largest(x: torch.Tensor, kth: int) -> torch.Tensor:
    """Alternative exact method: bisection on order-preserving int32 keys, one count pass per bit (no sync)."""
    bits = x.float().reshape(-1).view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    lo = torch.tensor(-(2**31), dtype=torch.int64, device=x.device)
    hi = torch.tensor(2**31 - 1, dtype=torch.int64, device=x.device)
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        enough = (keys >= mid.to(torch.int32)).sum() >= kth
        lo = torch.where(enough, mid, lo)
        hi = torch.where(enough, hi, mid - 1)
    key = lo.to(torch.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).view(torch.float32)


def topk_variants(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    n, features, k = args.tokens, args.layers * args.features, args.k_select
    budget = k * n
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, features, device=device, dtype=dtype)
        variants: dict[str, Callable[[], Any]] = {
            "torch.topk(flat, K) [baseline]": lambda x=x: torch.topk(x.view(-1), budget, sorted=False),
            "global_batch_topk dense": lambda x=x: global_batch_topk(x, k, group="local"),
            "batch_topk_threshold_sparse": lambda x=x: batch_topk_threshold_sparse(x, k, group="local"),
        }
        variants["alternative: bisection on float bits (32 count passes)"] = lambda x=x: (
            bisection_kth_largest(x, budget)
        )
        # Phases of the default path, to see where the time goes.
        flat = x.view(-1)
        lo = global_topk._lower_bound(flat, k / features).to(dtype)
        cand = torch.nonzero(flat >= lo).squeeze(1)
        variants["phase: sampled bound"] = lambda flat=flat: global_topk._lower_bound(flat, k / features)
        variants["phase: candidates (x >= lo, nonzero)"] = lambda flat=flat, lo=lo: torch.nonzero(flat >= lo)
        variants["phase: K-th largest of candidates"] = lambda c=flat[cand]: global_topk._kth_largest(
            c, budget
        )
        variants["phase: dense output (zeros + index_put)"] = lambda flat=flat, cand=cand: torch.zeros_like(
            flat
        ).index_put((cand,), flat[cand])
        baseline = None
        for name, fn in variants.items():
            row: dict[str, Any] = {"part": "select", "variant": name, "dtype": str(dtype), "K": budget}
            try:
                out = fn()
                if name.startswith("global_batch_topk"):
                    row["kept"] = int((out != 0).sum())
                row["ms"] = timeit(fn, args.warmup, args.iters, device)
                if baseline is None:
                    baseline = row["ms"]
                row["speedup_vs_torch_topk"] = baseline / row["ms"]
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"
                row["traceback"] = traceback.format_exc(limit=3)
            rows.append(row)
            print(row, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/sparse_decode.json)"
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--features", type=int, default=8192, help="features per layer")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 64, 200])
    parser.add_argument("--k-select", type=int, default=200)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.layers, args.features, args.d_model = 64, 3, 256, 32
        args.ks, args.k_select, args.warmup, args.iters = [4, 16], 8, 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype)
    rows = decode_variants(args, device, dtype) + topk_variants(args, device)
    out = args.out or str(RESULTS / f"sparse_decode{'_smoke' if args.smoke else ''}.json")
    write_result(out, benchmark="sparse_decode", env=environment(on_gpu=device.type == "cuda"), command=command_line(),
                 baseline=None, results={"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows})
    print(
        f"\n{'part':7} {'variant':42} {'dtype':15} {'k':>4} {'fwd ms':>9} {'fwd+bwd ms':>11} {'ms':>9} {'x topk':>7}"
    )
    for r in rows:
        err = "  ERROR " + r["error"][:60] if "error" in r else ""
        print(
            f"{r['part']:7} {r['variant']:42} {r['dtype']:15} {r.get('k', ''):>4} "
            f"{r.get('fwd_ms', float('nan')):9.3f} {r.get('fwd_bwd_ms', float('nan')):11.3f} "
            f"{r.get('ms', float('nan')):9.3f} {r.get('speedup_vs_torch_topk', float('nan')):7.2f}{err}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
