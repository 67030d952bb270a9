"""The one result schema of ``benchmarks/results/*.json`` and its one writer.

Every result file is an object with these keys, in this order::

    schema     "lightning-opt-benchmark/1"
    benchmark  the benchmark's name (its module: ``python -m benchmarks.<benchmark>``)
    env        where and with what it ran: ``device``, ``gpus``, ``host``, ``date_utc``, ``python``, ``torch``,
               ``cuda``, ``lightning``, ``triton``, ``flash_attn``, ``bitsandbytes``, ``peak_bf16_flops``
               (None where not known or not recorded); more keys may follow
    command    the command line that produced it, or None where not recorded
    baseline   what the ratios are against: ``{"name": ..., ...its figures}``, or None where the benchmark
               compares nothing against a baseline
    results    the measurements (the benchmark's rows, summaries and settings)
    goals      the targets the benchmark checks, or None
    notes      a string or a list of strings about the run, or None

:func:`write_result` writes it; :func:`load_result` reads a file and checks it (``python -m benchmarks.make_docs``
reads nothing else).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import socket
import sys
from pathlib import Path
from typing import Any

from lightning_opt.callbacks.speed_monitor import peak_flops
from lightning_opt.cli import device_name as _library_device_name

SCHEMA = "lightning-opt-benchmark/1"
KEYS = ("schema", "benchmark", "env", "command", "baseline", "results", "goals", "notes")
ENV_KEYS = ("device", "gpus", "host", "date_utc", "python", "torch", "cuda", "lightning", "triton", "flash_attn",
            "bitsandbytes", "peak_bf16_flops")
RESULTS = Path(__file__).resolve().parent / "results"


def device_name(on_gpu: bool | None = None) -> str:
    """The GPU's name, else ``cpu (<processor>, <N> cores)`` (the library's
    :func:`lightning_opt.cli.device_name`; ``on_gpu=False`` names the CPU of a GPU machine, for smoke runs)."""
    import torch

    if on_gpu is None or on_gpu == torch.cuda.is_available():
        return _library_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug(on_gpu: bool | None = None) -> str:
    """The device part of a result file's name: ``nvidia-h100-80gb-hbm3``, ``cpu``."""
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def command_line(argv: list[str] | None = None) -> str:
    """How this run was started, as a user reruns it: ``python -m benchmarks.<name> <args>``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    args = sys.argv[1:] if argv is None else argv
    head = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", *sys.argv[:1]]
    return " ".join([*head, *args])


def environment(on_gpu: bool | None = None, gpus: int | None = None) -> dict[str, Any]:
    """The ``env`` of a result: the device and GPU count, host, UTC date, versions and the device's peak bf16
    FLOP/s (None when not known)."""
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    env: dict[str, Any] = {
        "device": device_name(on_gpu),
        "gpus": (gpus if gpus is not None else torch.cuda.device_count()) if on_gpu else 0,
        "host": f"{socket.gethostname()} ({platform.system()} {platform.machine()}, {os.cpu_count()} cores)",
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for mod in ("lightning", "triton", "flash_attn", "bitsandbytes"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    env["peak_bf16_flops"] = peak_flops(torch.device("cuda" if on_gpu else "cpu"))
    return env


def make_result(*, benchmark: str, env: dict[str, Any], command: str | None, baseline: dict[str, Any] | None,
                results: Any, goals: Any = None, notes: str | list[str] | None = None) -> dict[str, Any]:
    """The result object in the schema's key order; raises ``ValueError`` naming what does not fit."""
    result = {"schema": SCHEMA, "benchmark": benchmark, "env": env, "command": command, "baseline": baseline,
              "results": results, "goals": goals, "notes": notes}
    problems = validate(result)
    if problems:
        raise ValueError(f"benchmark result {benchmark!r} does not fit the schema: " + "; ".join(problems))
    return result


def write_result(path: str | os.PathLike, *, benchmark: str, env: dict[str, Any], command: str | None,
                 baseline: dict[str, Any] | None, results: Any, goals: Any = None,
                 notes: str | list[str] | None = None) -> dict[str, Any]:
    """Write one result file in the schema (folders created) and return the object written."""
    result = make_result(benchmark=benchmark, env=env, command=command, baseline=baseline, results=results,
                         goals=goals, notes=notes)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return result


def validate(obj: Any) -> list[str]:
    """What in ``obj`` does not fit the schema (empty when it fits)."""
    if not isinstance(obj, dict):
        return [f"a result is a JSON object, not {type(obj).__name__}"]
    problems = []
    if list(obj) != list(KEYS):
        problems.append(f"keys {list(obj)}, expected {list(KEYS)}")
    if obj.get("schema") != SCHEMA:
        problems.append(f"schema {obj.get('schema')!r}, expected {SCHEMA!r}")
    if not isinstance(obj.get("benchmark"), str) or not obj.get("benchmark"):
        problems.append("benchmark is a non-empty string")
    env = obj.get("env")
    if not isinstance(env, dict):
        problems.append("env is an object")
    else:
        missing = [k for k in ENV_KEYS if k not in env]
        if missing:
            problems.append(f"env lacks {missing}")
        if not isinstance(env.get("device"), str):
            problems.append("env.device is a string")
    if obj.get("command") is not None and not isinstance(obj["command"], str):
        problems.append("command is a string or null")
    baseline = obj.get("baseline")
    if baseline is not None and not (isinstance(baseline, dict) and isinstance(baseline.get("name"), str)):
        problems.append("baseline is null or an object with a string name")
    if obj.get("results") is None:
        problems.append("results is present (an object or a list)")
    notes = obj.get("notes")
    if notes is not None and not isinstance(notes, str) and not (
            isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        problems.append("notes is null, a string or a list of strings")
    return problems


def load_result(path: str | os.PathLike) -> dict[str, Any]:
    """Read one result file; raises ``ValueError`` naming the file and what does not fit the schema."""
    obj = json.loads(Path(path).read_text())
    problems = validate(obj)
    if problems:
        raise ValueError(f"{path}: not a benchmark result ({'; '.join(problems)}); rewrite it with "
                         "benchmarks._results.write_result")
    return obj


def payload(result: dict[str, Any]) -> dict[str, Any]:
    """A page generator's view of a result: the ``results`` object with the schema's other fields beside it
    under their own names (``env``, ``command``, ``baseline``, ``goals``, ``notes``)."""
    body = result["results"] if isinstance(result["results"], dict) else {"rows": result["results"]}
    return {**body, **{k: result[k] for k in ("benchmark", "env", "command", "baseline", "goals", "notes")}}


def note_lines(notes: str | list[str] | None) -> list[str]:
    """A result's ``notes`` as a list of strings."""
    return [] if notes is None else [notes] if isinstance(notes, str) else list(notes)
