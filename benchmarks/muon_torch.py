"""``torch.optim.Muon`` against ``lightning_opt.optim.Muon``: time per optimizer step, loss after N steps, features.

    python -m benchmarks.muon_torch            # CUDA: benchmarks/results/muon_torch_<device>.json, about a minute
    python -m benchmarks.muon_torch --smoke    # CPU, small matrices, seconds
    python -m benchmarks.muon_torch --cpu      # CPU, the same sizes as on a GPU (minutes on 2 cores)

Both optimizers get the same parameters, the same gradients and matched hyper-parameters: ``lr``, ``momentum``,
``nesterov``, ``weight_decay``, ``ns_steps``, the Jordan quintic, and torch's ``adjust_lr_fn="original"``
(``sqrt(max(1, rows / cols))``, the scaling ours applies to tall matrices).

* **step**: the time of one ``optimizer.step()`` on fixed random gradients, for each parameter set (GPT-2 124M's
  48 hidden matrices; 8 square 2048 matrices; smoke: a tiny GPT-2 block's shapes), median over ``--iters`` steps
  after ``--warmup`` (CUDA events on a GPU, the wall clock on the CPU).
* **loss**: a bias-free 3-layer MLP regressing a fixed random teacher on fixed data, trained ``--train-steps``
  steps by each optimizer from the same initialisation; the final loss of each, and the relative difference of
  their first updates (torch runs Newton-Schulz in bfloat16 everywhere, ours in float32 on the CPU).
* **features**: what each accepts, probed where a probe is cheap (a 4-D parameter, ``foreach=True``, custom
  coefficients) and read from the code otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks._results import RESULTS, command_line, device_slug, environment, write_result
from lightning_opt.optim.muon import Muon as OursMuon

HYPER = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, ns_steps=5)

# GPT-2 124M's hidden matrices as nn.Linear weights (out, in): per layer c_attn, attn.c_proj, c_fc, mlp.c_proj
PARAM_SETS = {
    "gpt2_124m": [(3 * 768, 768), (768, 768), (4 * 768, 768), (768, 4 * 768)] * 12,
    "square_2048x8": [(2048, 2048)] * 8,
}
SMOKE_SETS = {"gpt2_tiny": [(3 * 64, 64), (64, 64), (4 * 64, 64), (64, 4 * 64)] * 2}


def build(which: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """One of the two optimizers on ``params`` with :data:`HYPER`."""
    if which == "torch":
        return torch.optim.Muon(params, adjust_lr_fn="original", **HYPER)
    return OursMuon(params, **HYPER)


def _params(shapes: list[tuple[int, int]], device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        out.append(p)
    return out


def time_step(which: str, shapes: list[tuple[int, int]], device: torch.device, warmup: int,
              iters: int) -> dict[str, float]:
    """Median and min milliseconds of one ``step()`` on fixed gradients."""
    opt = build(which, _params(shapes, device, seed=0))
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()  # the measurement needs the finished step
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


class _MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def train_loss(which: str, width: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Train :class:`_MLP` on a fixed teacher's outputs with one optimizer; the losses at a few steps."""
    torch.manual_seed(0)
    teacher, student = _MLP(width).to(device), _MLP(width).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, width, generator=gen).to(device)
    with torch.no_grad():
        y = teacher(x)
    opt = build(which, list(student.parameters()))
    losses = []
    first_update = None
    for step in range(steps):
        before = [p.detach().clone() for p in student.parameters()] if step == 0 else None
        loss = torch.nn.functional.mse_loss(student(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a tiny model on a benchmark's loss curve: the sync is the measurement
        if before is not None:
            first_update = torch.cat([(p.detach() - b).flatten() for p, b in zip(student.parameters(), before)])
    final = torch.nn.functional.mse_loss(student(x), y).item()
    marks = sorted({0, steps // 4, steps // 2, steps - 1})
    return {"final_loss": final, "loss_at": {str(s + 1): losses[s] for s in marks}, "first_update": first_update}


def _raises(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # the probe's answer: what the optimizer says about this input
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return None


def features() -> list[dict[str, str]]:
    """What each optimizer supports; ``probed`` rows were tried here, the others are read from the code."""
    conv = lambda: [torch.nn.Parameter(torch.randn(8, 4, 3, 3))]  # noqa: E731
    torch_conv = _raises(lambda: torch.optim.Muon(conv()))
    ours_conv = _raises(lambda: OursMuon(conv()))
    torch_foreach = _raises(lambda: _step_once(torch.optim.Muon(_params([(8, 4)], torch.device("cpu"), 0),
                                                                foreach=True)))
    torch_coeffs = _raises(lambda: torch.optim.Muon([torch.nn.Parameter(torch.randn(4, 4))],
                                                    ns_coefficients=(2.0, -1.5, 0.5)))
    yes_no = lambda err: "yes" if err is None else f"no ({err})"  # noqa: E731
    return [
        {"feature": "parameters of more than 2 dims (conv kernels)", "torch": yes_no(torch_conv),
         "ours": yes_no(ours_conv) + (" (flattened after dim 0)" if ours_conv is None else ""), "how": "probed"},
        {"feature": "batched Newton-Schulz (same-shape matrices stacked)", "torch":
            "no: one matrix at a time" + (f"; foreach=True gives {torch_foreach}" if torch_foreach else ""),
         "ours": "yes (batched=True; tall matrices transposed into the wide bucket)", "how": "probed + code"},
        {"feature": "fused projections orthogonalised per block (muon_row_splits)", "torch": "no",
         "ours": "yes (split_fused=True)", "how": "code"},
        {"feature": "distributed / sharded split of the Newton-Schulz work", "torch": "no", "ours": "no",
         "how": "code"},
        {"feature": "Newton-Schulz precision", "torch": "bfloat16 on every device",
         "ours": "bfloat16 on CUDA, float32 on the CPU", "how": "code"},
        {"feature": "Newton-Schulz coefficients", "torch": "any (a, b, c) tuple, the same every step"
            + ("" if torch_coeffs is None else f" ({torch_coeffs})"),
         "ours": "'jordan' or 'polar_express' (a quintic per step)", "how": "probed + code"},
        {"feature": "learning-rate scaling by shape (adjust_lr_fn)",
         "torch": "'original' sqrt(max(1, rows/cols)) or 'match_rms_adamw' 0.2*sqrt(max(rows, cols))",
         "ours": "sqrt(max(1, rows/cols)) only", "how": "code"},
        {"feature": "Nesterov momentum", "torch": "yes (nesterov=True)", "ours": "yes (nesterov=True)",
         "how": "code"},
        {"feature": "momentum warm-up (0.85 -> 0.95, the speedrun's)", "torch": "no",
         "ours": "yes (momentum_start, momentum_warmup_steps)", "how": "code"},
        {"feature": "NorMuon per-neuron second moment", "torch": "no", "ours": "yes (normuon_beta2)",
         "how": "code"},
        {"feature": "decoupled weight decay", "torch": "yes (default 0.1)", "ours": "yes (default 0)",
         "how": "code"},
        {"feature": "torch.compile of the step / capturable", "torch": "dynamo-disabled functional path",
         "ours": "plain eager step (torch._foreach calls, no host sync)", "how": "code"},
    ]


def _step_once(opt: torch.optim.Optimizer) -> None:
    opt.step()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, small matrices, few steps (seconds)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per parameter set (default 50, smoke 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, smoke 2)")
    ap.add_argument("--train-steps", type=int, default=None, help="steps of the loss comparison (default 200)")
    ap.add_argument("--width", type=int, default=None, help="the MLP's width (default 256, smoke 32)")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/muon_torch_<device>.json)")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not (args.smoke or args.cpu)
    device = torch.device("cuda" if on_gpu else "cpu")
    sets = SMOKE_SETS if args.smoke else PARAM_SETS
    iters = args.iters or (5 if args.smoke else 50)
    warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 5)
    width = args.width or (32 if args.smoke else 256)
    train_steps = args.train_steps or (20 if args.smoke else 200)

    step_rows = []
    for name, shapes in sets.items():
        row: dict[str, Any] = {"params": name, "matrices": len(shapes),
                               "numel": sum(r * c for r, c in shapes)}
        for which in ("torch", "ours"):
            row[which] = time_step(which, shapes, device, warmup, iters)
        row["ours_over_torch"] = row["ours"]["median_ms"] / row["torch"]["median_ms"]
        step_rows.append(row)
        print(f"{name}: torch {row['torch']['median_ms']:.2f} ms, ours {row['ours']['median_ms']:.2f} ms "
              f"(ours/torch {row['ours_over_torch']:.2f})", flush=True)

    runs = {which: train_loss(which, width, train_steps, device) for which in ("torch", "ours")}
    torch_update = runs["torch"].pop("first_update")
    first_rel = ((runs["ours"].pop("first_update") - torch_update).norm() / torch_update.norm()).item()
    loss = {"model": f"3-layer bias-free MLP, width {width}, 512 samples, MSE to a random teacher",
            "steps": train_steps, "torch": runs["torch"], "ours": runs["ours"],
            "first_update_relative_diff": first_rel,
            "final_loss_ours_over_torch": runs["ours"]["final_loss"] / runs["torch"]["final_loss"]}
    print(f"loss after {train_steps} steps: torch {runs['torch']['final_loss']:.5f}, "
          f"ours {runs['ours']['final_loss']:.5f}", flush=True)

    out = args.out or str(RESULTS / f"muon_torch_{'smoke' if args.smoke else device_slug(on_gpu)}.json")
    return write_result(
        out, benchmark="muon_torch", env=environment(on_gpu, gpus=1 if on_gpu else 0),
        command=command_line(argv), baseline={"name": "torch.optim.Muon", "hyper": {**HYPER,
                                                                                     "adjust_lr_fn": "original"}},
        results={"iters": iters, "warmup": warmup, "step": step_rows, "loss": loss, "features": features()},
        notes=["ours_over_torch < 1: ours is faster. Both optimizers see the same parameters and gradients; "
               "torch's Newton-Schulz runs in bfloat16 on every device, ours in float32 on the CPU."])


if __name__ == "__main__":
    main()
