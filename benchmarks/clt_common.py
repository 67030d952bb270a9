"""Result file of the CLT benchmarks (sparse_decode.py, clt_scaling.py): environment, command, rows."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(name: str, args: argparse.Namespace, rows: list[dict[str, Any]], **extra: Any) -> str:
    """Write ``benchmarks/results/<name>[_smoke].json`` (or ``args.out``) and return the path."""
    import lightning

    on_gpu = torch.cuda.is_available() and not args.smoke
    out = args.out or os.path.join(RESULTS, f"{name}_smoke.json" if args.smoke else f"{name}.json")
    result = {
        "benchmark": name,
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "command": " ".join([sys.executable, *sys.argv]),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        **extra,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return out
