"""Where one training step's time goes on a device timeline, from a ``torch.profiler`` trace.

:class:`StepProfiler` records one step (a Lightning callback's ``start``/``stop`` around it) and
:func:`split_timeline` reduces the trace to a few numbers that fit in a result JSON (the trace itself is not
kept): the step's window split into time when compute kernels run, time when only collective (NCCL) kernels
run and time when the device runs nothing (waiting for the host: launches, Python, host syncs), plus how long
the host blocked in syncs and the ten kernels that took the most time. On CPU (no device timeline) the same
split is made over the profiler's CPU ops (gloo collectives as "collective", time outside any op as idle).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from typing import Any

import torch

ANNOTATION = "benchmarks.profiled_step"
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_COLLECTIVE_WORDS = ("nccl", "gloo", "c10d::", "record_param_comms")
# host calls that wait for the device (``.item()``, ``.tolist()``, ``nonzero`` end in a stream sync)
_HOST_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _is_collective(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in _COLLECTIVE_WORDS)


def split_timeline(events: list[dict[str, Any]], top: int = 10) -> dict[str, Any]:
    """Summarise the chrome-trace ``events`` of one profiled step (marked by the :data:`ANNOTATION` range).

    Returns milliseconds: ``window_ms`` = ``compute_ms`` (some compute kernel runs) + ``collective_only_ms``
    (only collective kernels run) + ``idle_ms`` (nothing runs), and ``collective_ms`` (any collective runs,
    overlapped or not), ``host_sync_ms`` / ``host_syncs`` (host calls that wait for the device), the kernel
    counts and the ``top`` kernels by total time.
    """
    marks = [e for e in events if e.get("name") == ANNOTATION and e.get("ph") == "X"]
    if not marks:
        raise ValueError(f"no {ANNOTATION!r} range in the trace: record the step inside StepProfiler")
    t0 = min(float(e["ts"]) for e in marks)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in marks)

    def inside(e: dict[str, Any]) -> bool:
        return e.get("ph") == "X" and t0 <= float(e["ts"]) <= t1

    device = [e for e in events if e.get("cat") in _DEVICE_CATS and inside(e)]
    timeline = "device" if device else "cpu_ops"
    if not device:  # CPU run: the profiler's ops stand in for kernels
        device = [e for e in events if e.get("cat") == "cpu_op" and inside(e)]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e) for e in device]
    if timeline == "device":
        t1 = max(
            [t1, *(b for _, b, _ in spans)]
        )  # kernels launched in the step may finish after its host end
    coll = _union([(a, b) for a, b, e in spans if _is_collective(e["name"])])
    comp = _union([(a, b) for a, b, e in spans if not _is_collective(e["name"])])
    busy = _union(coll + comp)
    window = t1 - t0
    coll_len = _length(coll)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a, b, e in spans:
        entry = by_name[e["name"]]
        entry[0] += 1
        entry[1] += b - a
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and inside(e) and e["name"] in _HOST_SYNCS]
    return {
        "timeline": timeline,
        "window_ms": window / 1e3,
        "compute_ms": _length(comp) / 1e3,
        "collective_only_ms": (coll_len - _intersection(coll, comp)) / 1e3,
        "idle_ms": (window - _length(busy)) / 1e3,
        "collective_ms": coll_len / 1e3,
        "host_sync_ms": sum(float(e.get("dur", 0)) for e in syncs) / 1e3,
        "host_syncs": len(syncs),
        "kernels": len(spans),
        "collective_kernels": sum(1 for *_, e in spans if _is_collective(e["name"])),
        "top_kernels": [
            {"name": name[:160], "calls": int(n), "ms": ms / 1e3, "collective": _is_collective(name)}
            for name, (n, ms) in ranked
        ],
    }


class StepProfiler:
    """Profile one step: :meth:`start` before it, :meth:`stop` after it; :attr:`result` is the summary.

    The device is synchronised before the step (it starts with an empty queue, so its idle time includes the
    host's lead-in) and after it; the profiler's own per-op cost lengthens host-bound steps, so the profiled
    step is not one of the timed ones.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.result: dict[str, Any] | None = None
        self._prof: Any = None
        self._range: Any = None

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        self._sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._range = record_function(ANNOTATION)
        self._range.__enter__()

    def stop(self) -> None:
        if self._prof is None:
            return
        self._range.__exit__(None, None, None)
        self._sync()
        self._prof.__exit__(None, None, None)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            os.unlink(path)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        self.result = split_timeline(events)
        self._prof = self._range = None
