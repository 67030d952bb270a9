"""How close Muon's five Newton-Schulz steps get to the exact orthogonalisation, per coefficient set (CPU).

For wide matrices with singular values spread log-uniformly over [1/cond, 1] (cond 10, 100, 1000), the
relative Frobenius distance of ``newton_schulz(g, 5, coefficients=c)`` to the exact polar factor ``U V^T``,
and the range of its singular values, for ``jordan`` (one quintic every step) and ``polar_express`` (a quintic
per step). ``newton_schulz`` computes in float32 on a CPU (bfloat16 on a GPU).

    python -m benchmarks.muon_orthogonality            # seconds on a CPU

Writes ``benchmarks/results/muon_orthogonality_cpu.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from benchmarks._results import command_line, environment, write_result
from lightning_opt.optim.muon import NS_COEFFICIENTS, newton_schulz


def spectrum_matrix(cond: float, m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    sv = torch.logspace(0, -math.log10(cond), m)
    return u @ torch.diag(sv) @ v.T, u @ v.T


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "muon_orthogonality_cpu.json"))
    a = p.parse_args(argv)
    rows = []
    for cond in (10.0, 100.0, 1000.0):
        g, polar = spectrum_matrix(cond, a.rows, a.cols, seed=0)
        row = {"cond": cond}
        for c in NS_COEFFICIENTS:
            x = newton_schulz(g, 5, coefficients=c)
            sv = torch.linalg.svdvals(x)
            row[c] = {"rel_distance_to_polar": round(float((x - polar).norm() / polar.norm()), 4),
                      "sv_min": round(float(sv.min()), 3), "sv_max": round(float(sv.max()), 3)}
        row["polar_express_over_jordan"] = round(row["polar_express"]["rel_distance_to_polar"]
                                                 / row["jordan"]["rel_distance_to_polar"], 3)
        rows.append(row)
        print(row)
    out = {"shape": [a.rows, a.cols], "rows": rows}
    write_result(a.out, benchmark="muon_orthogonality", env=environment(on_gpu=False), command=command_line(argv),
                 baseline=None, results=out)
    return out


if __name__ == "__main__":
    main()
