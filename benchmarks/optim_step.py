"""Optimizer step time and state memory on GPT-2 124M: torch fused AdamW vs bitsandbytes 8-bit AdamW (and Lion).

Builds ``lightning_opt.models.gpt2.GPT`` at the classic 124M shape (fp32 parameters), gives every parameter a
random gradient, and times ``optimizer.step()`` alone with CUDA events (median over ``--steps`` after
``--warmup``), through the product's own factory (``build_optimizer`` with ``OptimConfig(name=...)``), so each
row is what a recipe with that ``model.optim.name`` gets. Reports the optimizer state's bytes (every tensor
in ``optimizer.state``) next to the parameters' bytes. ``adamw8bit`` is measured only when bitsandbytes imports
and ``AdamW8bit`` is what the factory built (otherwise the row says the fallback was taken and has no time).

    python -m benchmarks.optim_step                # CUDA, under a minute
    python -m benchmarks.optim_step --smoke        # CPU, a tiny model, seconds

Writes ``benchmarks/results/optim_step_<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings
from pathlib import Path

import torch

from benchmarks._results import command_line, environment, write_result
from lightning_opt.models.gpt2 import GPT, GPTConfig
from lightning_opt.optim.factory import OptimConfig, build_optimizer

NAMES = ("adamw", "adamw8bit", "lion")


def _device_tag(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


def measure(name: str, cfg: GPTConfig, device: torch.device, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opts = build_optimizer(model, OptimConfig(name=name, lr=6e-4, weight_decay=0.1))
    built = [type(o).__module__ + "." + type(o).__name__ for o in opts]
    row: dict = {"optimizer": name, "built": built, "warnings": [str(w.message) for w in caught]}
    if name == "adamw8bit" and not any("bitsandbytes" in b for b in built):
        row["note"] = "bitsandbytes not used (fallback taken); no time recorded"
        return row
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for o in opts:
                o.step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            for o in opts:
                o.step()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    row.update(
        step_ms_median=round(statistics.median(times), 4),
        step_ms_min=round(min(times), 4),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        state_bytes=sum(_state_bytes(o) for o in opts),
    )
    row["state_over_param_bytes"] = round(row["state_bytes"] / row["param_bytes"], 4)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU; proves the script end to end")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64)
        a.steps, a.warmup = 3, 1
    else:
        cfg = GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except Exception as err:  # noqa: BLE001 - any import failure means the extra is unusable here
        bnb_version = f"not importable: {type(err).__name__}: {err}"
    rows = []
    for name in NAMES:
        row = measure(name, cfg, device, a.steps, a.warmup)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "warnings"}, flush=True)
    base = next(r for r in rows if r["optimizer"] == "adamw")
    for r in rows:
        if "step_ms_median" in r:
            r["step_time_over_adamw"] = round(r["step_ms_median"] / base["step_ms_median"], 4)
            r["state_bytes_over_adamw"] = round(r["state_bytes"] / base["state_bytes"], 4)
    out = {
        "bitsandbytes": bnb_version,
        "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size, "params_dtype": "float32"},
        "steps": a.steps,
        "warmup": a.warmup,
        "rows": rows,
    }
    path = Path(a.out) if a.out else Path(__file__).parent / "results" / f"optim_step_{_device_tag(device)}.json"
    if not a.smoke or a.out:
        write_result(path, benchmark="optim_step", env=environment(on_gpu=device.type == "cuda"),
                     command=command_line(argv), baseline=None, results=out)
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
