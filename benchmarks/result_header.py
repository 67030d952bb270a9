"""The metadata every benchmark result JSON carries (what ran, where, with which versions, how) and the device's
peak FLOP/s for MFU (:func:`lightning_opt.callbacks.speed_monitor.peak_flops`)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_opt.callbacks.speed_monitor import peak_flops  # noqa: F401  (the benchmarks' MFU peak)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(on_gpu: bool | None = None) -> str:
    """The GPU's name, else ``cpu (<processor>, <N> cores)``."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if on_gpu:
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug() -> str:
    """The device part of a result file's name: ``nvidia-h100-80gb-hbm3``, ``cpu``."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(on_gpu: bool | None = None) -> dict[str, Any]:
    """``device``, ``date_utc``, ``command``, the versions (python, torch, cuda, lightning, triton, flash_attn,
    bitsandbytes; None when not installed) and ``peak_bf16_flops`` (None when not known)."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    info: dict[str, Any] = {
        "device": device_name(on_gpu),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peak_bf16_flops": peak_flops("cuda" if on_gpu else "cpu"),
    }
    for mod in ("lightning", "triton", "flash_attn", "bitsandbytes"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    return info


def result_header(name: str, on_gpu: bool | None = None) -> dict[str, Any]:
    """``benchmark`` followed by :func:`environment`: the top-level fields a result JSON starts with."""
    return {"benchmark": name, **environment(on_gpu)}


def write_result(name: str, args: argparse.Namespace, rows: list[dict[str, Any]], **extra: Any) -> str:
    """Write ``benchmarks/results/<name>[_smoke].json`` (or ``args.out``): header, ``config`` (the arguments),
    ``extra``, ``rows``; return the path."""
    on_gpu = torch.cuda.is_available() and not args.smoke
    out = args.out or os.path.join(RESULTS, f"{name}_smoke.json" if args.smoke else f"{name}.json")
    result = {
        **result_header(name, on_gpu),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        **extra,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return out
