"""The soft-capped cross-entropy kernel against an earlier version of itself, and the FP8 head matmul.

Times, on one GPU, the training sweep (loss + in-place logit gradient) and the evaluation sweep of
``lightning_opt.ops.softcap_ce`` and of a previous version of that module (a file given with ``--old``, e.g.
taken from git history), on 32,768 rows of 50,304 bfloat16 logits, and the head's forward matmul in bfloat16
and in FP8 (:func:`lightning_opt.ops.fp8.fp8_matmul_t`, casts included). Prints the numbers and the largest
loss and gradient differences between the two kernels.

    git show 63b3550:lightning_opt/ops/softcap_ce.py > /tmp/softcap_ce_old.py
    python benchmarks/softcap_ce_kernel.py --old /tmp/softcap_ce_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from lightning_opt.ops import softcap_ce as new
from lightning_opt.ops.fp8 import fp8_matmul_t


def bench(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="path of the earlier softcap_ce.py to compare with")
    p.add_argument("--rows", type=int, default=32768)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("softcap_ce_kernel.py times CUDA kernels: run it on a GPU machine")
    spec = importlib.util.spec_from_file_location("softcap_ce_old", a.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    torch.manual_seed(0)
    n, v, d = a.rows, 50304, 768
    base = (torch.randn(n, v, device="cuda") * 6).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda")
    buf = base.clone()
    for name, mod in (("old", old), ("new", new)):
        ms = bench(lambda mod=mod: (buf.copy_(base), mod.softcap_ce_rows_(buf, y, 15.0)))
        cp = bench(lambda: buf.copy_(base))
        ev = bench(lambda mod=mod: mod.softcap_ce_rows_(base, y, 15.0, write_grad=False))
        print(f"{name}: train sweep {ms - cp:.2f} ms (copy {cp:.2f} excluded), eval sweep {ev:.2f} ms per {n} rows")
    ga, gb = base.clone(), base.clone()
    la, lb = old.softcap_ce_rows_(ga, y, 15.0), new.softcap_ce_rows_(gb, y, 15.0)
    print("max |loss diff|", float((la - lb).abs().max()), "max |grad diff|", float((ga.float() - gb.float()).abs().max()))
    h = torch.nn.functional.rms_norm(torch.randn(n, d, device="cuda"), (d,)).to(torch.bfloat16)
    w = (0.05 * torch.randn(v, d, device="cuda")).to(torch.bfloat16)
    print(f"head fwd bf16 {bench(lambda: h @ w.t()):.2f} ms, fp8 (casts included) {bench(lambda: fp8_matmul_t(h, w)):.2f} ms")


if __name__ == "__main__":
    main()
