"""Result file of the CLT benchmarks (sparse_decode.py, clt_scaling.py): environment, command, rows."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from result_header import result_header

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(name: str, args: argparse.Namespace, rows: list[dict[str, Any]], **extra: Any) -> str:
    """Write ``benchmarks/results/<name>[_smoke].json`` (or ``args.out``) and return the path."""

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
