"""CLT training step: lightning_opt vs crosslayer-coding, side by side in one run.

Shapes: 12 layers x 768, 4096 tokens per step, global BatchTopK k=200, bf16 autocast, AdamW,
synthetic activations; 4096 / 8192 / 16384 / 32768 features per layer. Per feature count it measures:

* ``ours_dense``: ``CLT`` forward (batched encoder, exact global BatchTopK), dense decode (its default plain
  dense gradients), MSE + tanh sparsity + pre-activation loss, backward, fused AdamW: the "raw step".
* ``ours_dense_sparsegrad``: the same with the activation gradient of the dense decode as a gather-dot at the
  kept entries (``CLT.execution.dense_sparse_grad = True``). (``ours_dense_plaingrad`` is an alias of ``ours_dense``.)
* ``ours_sparse``: the same with the sparse decode (``ops.sparse_decode``: Triton on CUDA).
* ``module``: the real ``CLTModule`` in a Lightning ``Trainer`` (bf16-mixed) with the gpt2-small config's
  loss terms (tanh sparsity, pre-activation, AuxK with aux_k=16 and its default ``aux_max_dead`` active from
  the second step - ``dead_tokens`` is one batch, so every feature silent in the last batch is dead -,
  dead-feature tracking, train metrics every ``log_every_n_steps=50``) and ``decode=auto`` (the decode the
  module picks by F) and the model's default ``CLT.execution.dense_sparse_grad`` (True: gather-dot activation gradient of
  the dense decode). ``module_noaux``: the same with ``aux_coef=0``; ``module_sparsegrad`` / ``module_plaingrad``:
  ``module`` with ``dense_sparse_grad`` forced True / False; ``module_compile``: ``module`` with
  ``CLTModule(compile=True)`` (the encoder and loss regions through ``torch.compile``; the compilation happens in
  the warmup steps, so it is outside the step time and reported apart as ``compile_s``: the warmup's wall time
  minus ``warmup`` median steps, with ``warmup_s`` and the ``compiled_graphs``). All also count the host syncs of one
  extra step (``torch.cuda.set_sync_debug_mode``) and, at ``--profile-features``, profile one step
  (``torch.profiler``): device time per part of ``training_step`` (its ``clt/...`` record_function regions),
  the top ops, and op-call counts (``aten::copy_``, ``aten::index``, all ops).
* ``select_ours`` / ``select_torch_topk`` / ``select_global_topk``: the BatchTopK selection alone on the bf16
  pre-activations ``[12 * 4096 * F]`` (ours = ``ops.topk.batch_topk_rows``; ``torch.topk`` of k*tokens; the
  single-process ``global_batch_topk`` with ``group="local"``). ``select_path`` says which path ``select_ours``
  took (``triton_1pass``: ``_topk_triton.select_16bit_1pass``, one read of ``x``, no host sync;
  ``triton_2pass``: ``_topk_triton.select_16bit``, two reads and one host sync; ``candidates``: candidate step +
  threshold step). Beside it, in the same run: the two-pass selection (``select_ours_2pass``, also per layer),
  the candidate path (``select_ours_candidates``), with the top-k threshold step (``select_ours_topk_threshold``)
  and with torch candidates, the two-pass candidate phase alone (``phase_candidates``), the one-pass selection's
  read of ``x`` alone (``phase_stash``) and the whole one-pass selection forced through its device-side fallback
  (``select_ours_fallback``); the host syncs of one call of each Triton path (``select_host_syncs``); sweeps of
  the Triton launch shapes (``select_sweep``: the one-pass stash pass, ``select_sweep_2pass``: the two-pass
  selection; ``batch_topk_rows``'s ``triton_block`` x ``triton_num_warps``); and exactness: the kept multiset
  against ``torch.topk`` (``select_exact``), every path's indices alike (``select_backends_agree``), the tie rule
  on coarse values (``select_ties_exact``), the fallback's answer (``select_fallback_exact``) and whether the
  sample's bound held (``select_fast_path``).
* ``peer``: crosslayer-coding's own ``CrossLayerTranscoder`` + ``LossManager.compute_total_loss`` step
  (its trainer's step: activations, total loss, backward, AdamW; sparsity and pre-activation terms on), and
  its BatchTopK helper alone. Runs in a subprocess per size (own memory accounting, OOM isolated), only
  when ``.peers/crosslayer-coding`` exists (``git clone https://github.com/curt-tigges/crosslayer-coding
  .peers/crosslayer-coding``; it needs only torch for these modules). Otherwise "peer not run".

Step time: median of CUDA-event intervals over ``--steps`` steps after ``--warmup``. Peak memory:
``torch.cuda.max_memory_allocated`` over the measured steps (process-wide peak incl. parameters, grads,
AdamW state).

Selection times (``select_*``, ``phase_*`` and the sweeps; :func:`time_interleaved`): every variant and every
sweep shape runs on the same bf16 tensor, after ``--select-warmup`` untimed calls each, in ``--select-rounds``
interleaved rounds of ``--select-steps`` calls (each round runs every variant in turn, so clock, thermal and
allocator drift hit all alike). Each variant reports ``device`` (the GPU's own time per call: the launch queue
is filled behind a ``torch.cuda._sleep`` kernel first, so host launch work is hidden; only for variants without a
host sync), ``e2e`` (back-to-back calls after a sync, host work included where it is the slower side) and
``host`` (the host's enqueue time per call), each as median, p10, p90, min, max and n over all calls;
``median_ms`` is the device median where there is one, else the e2e median (``timing`` says which), and
``allocator_mallocs`` counts cudaMalloc calls during the timed calls (0: the allocator's state played no part).
``select_rare_paths``: device counters (``select_16bit_1pass(stats=...)``) over ``--select-steps`` one-pass
calls per stash shape on the same input and with the bound ``batch_topk_rows`` computes: how often the exact
fallback answered and how many blocks had more hits than slots (read again from ``x``), per call.
``stash_sweep`` times the one-pass selection's read alone per stash shape, with its bandwidth (2 bytes per entry).

    python -m benchmarks.clt_step                   # CUDA, about 3 min on an H100; writes
                                                    # benchmarks/results/clt_step_<device>.json
    python -m benchmarks.clt_step --features 8192 --variants ours_dense module select peer   # the goals only
    python -m benchmarks.clt_step --features 8192 16384 --variants select --select-variants select_ours \
        select_ours_2pass phase_sample phase_stash phase_compact phase_keep phase_fallback_gated
                                                    # the selection, its phases and sweeps only, about a minute
    python -m benchmarks.clt_step --smoke           # CPU, seconds (tiny shapes; checks the script runs and
                                                    # prints the module step's op profile)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks._results import command_line, device_slug, environment, write_result
from lightning_opt.models.clt import (
    CLT,
    CLTConfig,
    preactivation_loss,
    tanh_sparsity_penalty_sparse,
)
from lightning_opt.ops.topk import batch_topk_rows

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PEER_DIR = os.path.join(ROOT, ".peers", "crosslayer-coding")

SPARSITY, PREACT = 1e-3, 3e-6
VARIANTS = ("ours_dense", "ours_dense_sparsegrad", "ours_sparse", "module", "module_noaux", "module_sparsegrad",
            "module_plaingrad", "module_compile", "select", "peer")
MODULE_VARIANTS = ("module", "module_noaux", "module_sparsegrad", "module_plaingrad", "module_compile")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn: Callable[[], Any], dev: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """Median/mean milliseconds of ``fn`` between CUDA events (wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        ev[0].record()
        for i in range(steps):
            fn()
            ev[i + 1].record()
        _sync(dev)
        ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]
        peak = torch.cuda.max_memory_allocated(dev)
    else:
        ms = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
        peak = 0
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "peak_memory_gb": peak / 1e9}


def _quantiles(ms: list[float]) -> dict[str, float]:
    q = sorted(ms)
    at = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
    return {"median_ms": statistics.median(q), "p10_ms": at(0.1), "p90_ms": at(0.9), "min_ms": q[0],
            "max_ms": q[-1], "n": len(q)}


def _mallocs(dev: torch.device) -> int:
    """cudaMalloc calls of the caching allocator so far (0 on CPU)."""
    return torch.cuda.memory_stats(dev).get("segment.all.allocated", 0) if dev.type == "cuda" else 0


def _sleep_cycles_per_ms(dev: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond (measured, so the queue-filling sleep is long
    enough whatever the clock)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1 << 20)  # warm
    a.record()
    torch.cuda._sleep(10 << 20)
    b.record()
    torch.cuda.synchronize(dev)
    return (10 << 20) / max(a.elapsed_time(b), 1e-3)


def _event_calls(fn: Callable[[], Any], ev: list) -> float:
    """``len(ev) - 1`` calls of ``fn`` between the CUDA events ``ev``; returns the host's wall seconds."""
    ev[0].record()
    t = time.perf_counter()
    for e in ev[1:]:
        fn()
        e.record()
    return time.perf_counter() - t


def time_interleaved(fns: dict[str, Callable[[], Any]], dev: torch.device, warmup: int, rounds: int,
                     per_round: int) -> dict[str, dict[str, Any]]:
    """Time every function of ``fns`` on the same inputs, interleaved: ``rounds`` rounds, each running every
    function in turn (so clock, thermal or allocator drift hits all alike), ``per_round`` calls per function
    and round; ``warmup`` calls of each first (compilation, self-checks, the allocator's blocks).

    Per function, over all ``rounds * per_round`` calls (median, p10, p90, min, max, n):

    * ``e2e``: CUDA-event intervals between back-to-back calls after a sync: what a loop of calls costs when
      nothing else runs (the host's launch work included when it is the slower side).
    * ``device``: the same intervals with the launch queue filled first (a ``torch.cuda._sleep`` kernel holds
      the GPU while the host enqueues the round), so each interval is the GPU's own time for one call. Only for
      functions that never wait for the GPU (no host sync); ``None`` for the others (the sleep had ended before
      the host finished enqueueing).
    * ``host``: the host's wall time to enqueue one call (from the device rounds; from the e2e rounds where the
      function syncs).

    ``median_ms`` is the device median where measured, else the e2e median (``timing`` says which);
    ``allocator_mallocs`` counts the allocator's cudaMalloc calls during the timed calls (0: the allocator's
    state played no part). On CPU: wall clock per call only.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(dev)
    cuda = dev.type == "cuda"
    rate = _sleep_cycles_per_ms(dev) if cuda else 0.0
    acc = {name: {"e2e": [], "device": [], "host": [], "held": 0, "mallocs": 0} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            a = acc[name]
            m0 = _mallocs(dev)
            if not cuda:
                for _ in range(per_round):
                    t = time.perf_counter()
                    fn()
                    a["e2e"].append((time.perf_counter() - t) * 1e3)
                continue
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(per_round + 1)]
            wall = _event_calls(fn, ev)
            _sync(dev)
            a["e2e"] += [ev[i].elapsed_time(ev[i + 1]) for i in range(per_round)]
            # device time: hold the GPU with a sleep long enough for the host to enqueue the whole round
            sleep_done = torch.cuda.Event()
            torch.cuda._sleep(int(rate * (2 * wall * 1e3 + 2.0)))
            sleep_done.record()
            enqueue = _event_calls(fn, ev)
            held = not sleep_done.query()  # the GPU was still asleep: every call was queued before it ran
            _sync(dev)
            a["host"].append(enqueue * 1e3 / per_round if held else wall * 1e3 / per_round)
            if held:
                a["held"] += 1
                a["device"] += [ev[i].elapsed_time(ev[i + 1]) for i in range(per_round)]
            a["mallocs"] += _mallocs(dev) - m0
    out: dict[str, dict[str, Any]] = {}
    for name, a in acc.items():
        e2e = _quantiles(a["e2e"])
        device = _quantiles(a["device"]) if cuda and a["held"] == rounds else None
        host = _quantiles(a["host"]) if a["host"] else None
        out[name] = {"median_ms": (device or e2e)["median_ms"], "timing": "device" if device else "end_to_end",
                     "device": device, "e2e": e2e, "host": host, "allocator_mallocs": a["mallocs"],
                     "device_rounds_held": a["held"]}
    return out


def synthetic(n: int, layers: int, d: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, layers, d, device=dev, generator=g)
    y = torch.randn(n, layers, d, device=dev, generator=g)
    return x, y


def ours_step(nf: int, args: argparse.Namespace, dev: torch.device, sparse: bool,
              sparse_grad: bool = False) -> dict[str, Any]:
    cfg = CLTConfig(n_layers=args.layers, d_model=args.d_model, n_features=nf, activation="batchtopk_global", k=args.k)
    with torch.device(dev):
        clt = CLT(cfg)
    clt.execution.dense_sparse_grad = sparse_grad
    opt = torch.optim.AdamW(clt.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x, y = synthetic(args.tokens, args.layers, args.d_model, dev)
    amp = dev.type == "cuda"

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            out = clt(x, dense=not sparse)
            mse = (out.recon - y).pow(2).mean()
            sp = tanh_sparsity_penalty_sparse(out.indices, out.values, clt.decoder_norms(), args.tokens)
            loss = mse + SPARSITY * sp + PREACT * preactivation_loss(out.pre)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_fn(step, dev, args.warmup, args.steps)


def module_step(nf: int, args: argparse.Namespace, dev: torch.device, aux: bool = True,
                sparse_grad: bool | None = None, compile: bool = False) -> dict[str, Any]:
    """The real ``CLTModule`` under a Lightning ``Trainer`` (bf16-mixed), with the gpt2-small config's loss terms
    (tanh sparsity, pre-activation, AuxK unless ``aux=False``, dead tracking, train metrics): step time, peak
    memory, host syncs of one step and (at ``--profile-features``) its top ops. ``compile``: ``CLTModule(compile=True)``;
    its compilation falls in the warmup steps (``compile_s``, apart from the step time)."""
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_opt.modules.clt import CLTModule

    cfg = CLTConfig(n_layers=args.layers, d_model=args.d_model, n_features=nf, activation="batchtopk_global", k=args.k)
    with torch.device(dev):
        module = CLTModule(cfg, sparsity_coef=1e-4, preact_coef=PREACT, aux_coef=0.03 if aux else 0.0, aux_k=16,
                           aux_max_dead=args.aux_max_dead,
                           dead_tokens=args.tokens, decode=args.module_decode, eval_replacement=False,
                           compile=compile)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if sparse_grad is not None:  # None: the model's default
        module.model.execution.dense_sparse_grad = sparse_grad
    decode = "sparse" if module._use_sparse(True) else "dense"
    x, y = synthetic(args.tokens, args.layers, args.d_model, dev)

    class Repeat(IterableDataset):
        def __iter__(self):
            while True:
                yield x, y

    times: list[float] = []
    state: dict[str, Any] = {}
    last = args.warmup + args.steps  # the extra step after the timed ones: sync count and profile
    profile = nf == args.profile_features

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:
                state["warmup_start"] = time.perf_counter()
            if batch_idx == args.warmup:
                _sync(dev)  # the warmup steps (and a compiled module's compilation) are done
                state["warmup_s"] = time.perf_counter() - state["warmup_start"]
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
            if batch_idx == last:
                _record(times, dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                    state["peak"] = torch.cuda.max_memory_allocated(dev)
                    torch.cuda.set_sync_debug_mode("warn")
                state["warnings"] = warnings.catch_warnings(record=True)
                state["caught"] = state["warnings"].__enter__()
                warnings.simplefilter("always")
                if profile:
                    acts = [torch.profiler.ProfilerActivity.CPU]
                    if dev.type == "cuda":
                        acts.append(torch.profiler.ProfilerActivity.CUDA)
                    try:  # a profiler failure (no CUPTI) must not lose the timings
                        prof = torch.profiler.profile(activities=acts)
                        prof.__enter__()
                        state["prof"] = prof
                    except Exception as err:
                        state["prof_error"] = repr(err)
                return
            if args.warmup <= batch_idx < last:
                _record(times, dev)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx != last:
                return
            if "prof" in state:
                _sync(dev)
                try:
                    state["prof"].__exit__(None, None, None)
                except Exception as err:
                    state["prof_error"] = repr(err)
                    del state["prof"]
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            state["warnings"].__exit__(None, None, None)
            syncs = [str(w.message) for w in state["caught"] if "synchroniz" in str(w.message)]
            state["syncs"] = len(syncs)

    trainer = L.Trainer(
        accelerator="gpu" if dev.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if dev.type == "cuda" else "32-true", max_steps=last + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock()],
    )
    trainer.fit(module, train_dataloaders=DataLoader(Repeat(), batch_size=None))
    if dev.type == "cuda":
        ms = [a.elapsed_time(b) for a, b in zip(times[:-1], times[1:])]
    else:
        ms = [(b - a) * 1e3 for a, b in zip(times[:-1], times[1:])]
    res = {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
           "peak_memory_gb": state.get("peak", 0) / 1e9, "decode": decode, "aux": aux,
           "aux_max_dead": module.aux_max_dead, "log_every_n_steps": trainer.log_every_n_steps,
           "host_syncs_per_step": state.get("syncs") if dev.type == "cuda" else "not counted on CPU"}
    if compile:
        res["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        res["warmup_s"] = state.get("warmup_s")
        if res["warmup_s"] is not None:
            res["compile_s"] = max(0.0, res["warmup_s"] - args.warmup * res["median_ms"] / 1e3)
    try:
        if "prof" in state:
            res["profile_top_ops"] = _top_ops(state["prof"], dev)
            res.update(_regions(state["prof"], dev))
    except Exception as err:
        state["prof_error"] = repr(err)
    if "prof_error" in state:
        res["profile_error"] = state["prof_error"]
    return res


def _record(times: list, dev: torch.device) -> None:
    if dev.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        times.append(ev)
    else:
        times.append(time.perf_counter())


def _top_ops(prof: Any, dev: torch.device, n: int = 15) -> list[dict[str, Any]]:
    """The ``n`` ops with the largest self time (device time on CUDA) of one profiled step."""
    rows = []
    for e in prof.key_averages():
        if e.key.startswith(("clt/", "Optimizer.", "ProfilerStep")):
            continue  # regions (see _regions), not ops: their "self" time includes whatever ran inside
        t = _dev_us(e, self_time=True) if dev.type == "cuda" else e.self_cpu_time_total
        rows.append({"op": e.key, "self_ms": t / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:n]


def _dev_us(e: Any, self_time: bool) -> float:
    names = ("self_device_time_total", "self_cuda_time_total") if self_time else ("device_time_total", "cuda_time_total")
    for name in names:
        v = getattr(e, name, None)
        if v is not None:
            return v
    return 0.0


def _regions(prof: Any, dev: torch.device) -> dict[str, Any]:
    """Time per ``clt/...`` region of ``CLTModule.training_step`` (device time on CUDA, CPU time otherwise; the
    backward and optimizer are outside them) and op-call counts of the whole profiled step."""
    regions: dict[str, float] = {}
    counts = {"all_ops": 0, "aten::copy_": 0, "aten::index": 0, "aten::item": 0, "aten::nonzero": 0}
    for e in prof.key_averages():
        if e.key.startswith("clt/"):
            t = _dev_us(e, self_time=False) if dev.type == "cuda" else e.cpu_time_total
            regions[e.key] = regions.get(e.key, 0.0) + t / 1e3
        elif e.key.startswith("aten::"):
            counts["all_ops"] += e.count
            if e.key in counts:
                counts[e.key] += e.count
    return {"regions_ms": regions, "op_calls": counts}


def _triton_ok(x: torch.Tensor) -> bool:
    try:
        from lightning_opt.ops import _topk_triton

        return _topk_triton.available(x)
    except Exception:
        return False


def _host_syncs(fn: Callable[[], Any], dev: torch.device) -> int | str:
    """Host syncs of one call of ``fn`` (CUDA: ``torch.cuda.set_sync_debug_mode`` warnings)."""
    if dev.type != "cuda":
        return "not counted on CPU"
    fn()  # warm: first calls compile and run self-checks (one-time syncs)
    torch.cuda.synchronize(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


# the selection's timings, printed side by side
SELECT_KEYS = ("select_ours", "select_ours_2pass", "select_ours_candidates", "select_ours_torch_candidates",
               "select_ours_topk_threshold", "select_ours_per_layer", "select_ours_per_layer_2pass", "phase_sample",
               "phase_stash", "phase_compact", "phase_keep", "phase_fallback_gated",
               "phase_candidates", "phase_candidates_torch", "select_ours_fallback", "select_torch_topk",
               "select_global_topk", "peer_select")
SELECT_PATHS = {"triton": "triton_1pass", "triton_2pass": "triton_2pass", "candidates": "candidates"}
# launch shapes (entries per program x warps) swept for the one-pass stash pass and the two-pass selection
STASH_SWEEP = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
TWO_PASS_SWEEP = ((2048, 4), (2048, 8), (4096, 8))


def selection(nf: int, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """BatchTopK selection alone on bf16 pre-activations [L * N * F]: ours (the one-pass Triton selection that
    ``auto`` takes, the two-pass Triton selection, the candidate paths), torch.topk, global_batch_topk."""
    n_keep = args.k * args.tokens
    g = torch.Generator(device=dev).manual_seed(1)
    pre = torch.randn(args.layers * args.tokens * nf, device=dev, generator=g).to(torch.bfloat16)
    out: dict[str, Any] = {}

    from lightning_opt.ops import topk as topk_mod

    def select(rows: int = 1, x: torch.Tensor = pre, n: int = n_keep, **paths: Any) -> Callable[[], Any]:
        """``batch_topk_rows`` on ``x`` as ``rows`` rows, with its path options ``paths``."""
        return lambda: batch_topk_rows(x.view(rows, -1), n, **paths)

    lo, expect = topk_mod._row_lower_bounds(pre.view(1, -1), n_keep)
    lo = lo.to(pre.dtype)
    out["select_candidates_backend"] = "triton" if _triton_ok(pre) else "torch"
    # which path select_ours takes: the one-pass or two-pass Triton selection, or candidates + threshold step
    with warnings.catch_warnings(record=True) as caught:  # a failed Triton self-check warns: keep its message
        warnings.simplefilter("always")
        out["select_path"] = SELECT_PATHS[topk_mod._select_path(pre.view(1, -1))]
    if caught:
        out["select_warnings"] = [str(w.message)[:300] for w in caught]
    one_pass = out["select_path"] == "triton_1pass"

    variants: dict[str, Callable[[], Any]] = {
        "select_ours": select(),
        "select_ours_candidates": select(select_backend="candidates"),
        "select_ours_torch_candidates": select(select_backend="candidates", candidates_backend="torch"),
        "select_ours_topk_threshold": select(select_backend="candidates", threshold_method="topk"),
        "select_ours_per_layer": select(args.layers),
        "phase_candidates": lambda: topk_mod.candidates_ge(pre, lo, pre.numel()),
        "phase_candidates_torch": lambda: topk_mod.candidates_ge(pre, lo, pre.numel(), backend="torch"),
        "select_torch_topk": lambda: torch.topk(pre, n_keep, sorted=False),
    }
    two_pass = _triton_ok(pre)  # the two-pass Triton selection, where Triton runs
    if two_pass:
        variants["select_ours_2pass"] = select(select_backend="triton_2pass")
        variants["select_ours_per_layer_2pass"] = select(args.layers, select_backend="triton_2pass")
    if one_pass:
        from lightning_opt.ops import _topk_triton as kt

        cap = kt.stash_capacity(expect, kt.STASH_BLOCK)
        # the one read of x alone, and the whole selection forced through its device-side fallback (a bound
        # no entry reaches: every row short)
        variants["phase_stash"] = lambda: kt.stash_pass(pre, lo, pre.numel(), cap)
        never = torch.full((1,), float("inf"), device=dev).to(pre.dtype)
        variants["select_ours_fallback"] = lambda: kt.select_16bit_1pass(pre.view(1, -1), n_keep, never, expect)
        # the one-pass selection's other phases alone, on the intermediate results of this input (their device
        # times add up to select_ours' less the value gather): the sampled bound, the compaction of the stash,
        # the cut-off and keep step (sort of the candidate keys, running counts, scatter), and the exact
        # fallback's five launches when the fast path held (they return at once)
        n_cand = kt.candidate_capacity(expect, 1, pre.numel())
        stash = kt.stash_pass(pre, lo, pre.numel(), cap)
        variants["phase_sample"] = lambda: topk_mod._row_lower_bounds(pre.view(1, -1), n_keep)
        variants["phase_compact"] = partial(kt.compact_stash, pre, lo, 1, pre.numel(), *stash, cap, n_cand,
                                            kt.STASH_BLOCK)
        cand = kt.compact_stash(pre, lo, 1, pre.numel(), *stash, cap, n_cand, kt.STASH_BLOCK)
        variants["phase_keep"] = partial(kt._keep_by_keys, cand[0], cand[1], 1, n_keep)
        held = torch.ones((), dtype=torch.bool, device=dev)
        fb_out = torch.empty(n_keep, dtype=torch.int64, device=dev)
        fb_hist = torch.zeros(2 * 256, dtype=torch.int64, device=dev)
        variants["phase_fallback_gated"] = partial(kt._fallback, pre, 1, pre.numel(), n_keep, held, fb_hist, fb_out)
    try:
        from lightning_opt.ops.global_topk import global_batch_topk

        variants["select_global_topk"] = lambda: global_batch_topk(pre.view(args.tokens, -1), args.k, group="local")
    except ImportError as err:
        out["select_global_topk"] = {"error": repr(err)}
    wanted = set(args.select_variants or variants)
    fns = {name: fn for name, fn in variants.items() if name in wanted}
    timed_names = list(fns)
    # the Triton passes' launch shapes, timed in the same interleaved rounds as the variants (same input, same
    # GPU state): the whole one-pass selection per stash shape (select_sweep), its stash pass alone per shape
    # (stash_sweep, with the read's bandwidth) and the two-pass selection per shape (select_sweep_2pass)
    sweeps: dict[str, dict[str, Any]] = {}
    if _triton_ok(pre) and args.sweep:
        from lightning_opt.ops import _topk_triton as kt

        specs = [("select_sweep_2pass", "triton_2pass", TWO_PASS_SWEEP, (kt.BLOCK, kt.NUM_WARPS))]
        if one_pass:
            specs = [("select_sweep", "triton", STASH_SWEEP, (kt.STASH_BLOCK, kt.STASH_WARPS)),
                     ("stash_sweep", "stash", STASH_SWEEP, (kt.STASH_BLOCK, kt.STASH_WARPS)), *specs]
        for key, path, shapes, default in specs:
            sweeps[key] = {"path": SELECT_PATHS.get(path, "triton_1pass"), "default": f"{default[0]}x{default[1]}",
                           "shapes": {}}
            for block, warps in shapes:
                name = f"{key}:{block}x{warps}"
                sweeps[key]["shapes"][f"{block}x{warps}"] = name
                if path == "stash":
                    fns[name] = partial(kt.stash_pass, pre, lo, pre.numel(), kt.stash_capacity(expect, block),
                                        block=block, num_warps=warps)
                else:
                    fns[name] = select(select_backend=path, triton_block=block, triton_num_warps=warps)
    timed: dict[str, Any] = {}
    try:
        timed = time_interleaved(fns, dev, args.select_warmup, args.select_rounds, args.select_steps)
    except Exception as err:  # one failing variant fails the round: say which by timing them alone
        for name, fn in fns.items():
            try:
                timed[name] = time_interleaved({name: fn}, dev, args.select_warmup, args.select_rounds,
                                               args.select_steps)[name]
            except Exception as err2:
                timed[name] = {"error": repr(err2), "round_error": repr(err)}
    for name in timed_names:
        out[name] = timed[name]
    for key, spec in sweeps.items():
        ms_ = {shape: (round(timed[name]["median_ms"], 4) if "median_ms" in timed[name] else timed[name]["error"])
               for shape, name in spec["shapes"].items()}
        detail = {shape: {k: timed[name].get(k) for k in ("timing", "device", "e2e", "host")}
                  for shape, name in spec["shapes"].items() if "median_ms" in timed[name]}
        out[key] = {"path": spec["path"], "default": spec["default"], "ms": ms_, "detail": detail}
        if key == "stash_sweep":  # the read's bandwidth: 2 bytes per entry in median_ms
            out[key]["read_tb_per_s"] = {shape: round(2 * pre.numel() / (t * 1e-3) / 1e12, 3)
                                         for shape, t in ms_.items() if isinstance(t, float)}
    phases = ("phase_sample", "phase_stash", "phase_compact", "phase_keep", "phase_fallback_gated")
    if all("median_ms" in out.get(k, {}) for k in phases):
        out["one_pass_phases_sum_ms"] = sum(out[k]["median_ms"] for k in phases)
    if "phase_stash" in out and "median_ms" in out["phase_stash"]:
        out["phase_stash"]["read_tb_per_s"] = 2 * pre.numel() / (out["phase_stash"]["median_ms"] * 1e-3) / 1e12
    if one_pass:  # how often the rare paths ran: device counters over calls on the same input as the timing
        from lightning_opt.ops import _topk_triton as kt

        counts = {}
        for shape in dict.fromkeys([(kt.STASH_BLOCK, kt.STASH_WARPS), *(STASH_SWEEP if args.sweep else ())]):
            stats = torch.zeros(3, dtype=torch.int64, device=dev)
            lo_b, expect_b = topk_mod._row_lower_bounds(pre.view(1, -1), n_keep)  # what batch_topk_rows computes
            for _ in range(args.select_steps):
                kt.select_16bit_1pass(pre.view(1, -1), n_keep, lo_b.to(pre.dtype), expect_b, block=shape[0],
                                      num_warps=shape[1], stats=stats)
            calls, fallbacks, over = stats.tolist()
            counts[f"{shape[0]}x{shape[1]}"] = {"calls": calls, "fallback_per_call": fallbacks / calls,
                                                "overflow_blocks_per_call": over / calls}
        out["select_rare_paths"] = counts
    try:
        out["select_host_syncs"] = {name: _host_syncs(variants[name], dev)
                                    for name in ("select_ours", "select_ours_2pass", "select_ours_candidates")
                                    if name in timed_names}
    except Exception as err:
        out["select_host_syncs"] = repr(err)
    if dev.type == "cuda":
        out["select_timing"] = {"rounds": args.select_rounds, "calls_per_round": args.select_steps,
                                "warmup": args.select_warmup, "interleaved": True}
    # exactness: same kept multiset as torch.topk
    try:
        idx, vals = batch_topk_rows(pre.view(1, -1), n_keep)
        ref = torch.topk(pre.float(), n_keep, sorted=False).values
        out["select_exact"] = bool(idx.numel() == n_keep and torch.equal(vals.float().sort().values, ref.sort().values))
        if one_pass:  # whether the sample's bound held on this data (no fallback), and the fallback's answer
            got, fast = kt.select_16bit_1pass(pre.view(1, -1), n_keep, lo, expect)
            out["select_fast_path"] = bool(fast)
            out["select_fallback_exact"] = bool(torch.equal(variants["select_ours_fallback"]()[0], idx)
                                                and torch.equal(got, idx))
    except Exception as err:
        out["select_exact"] = repr(err)
    try:  # every path (one-pass, two-pass, Triton and torch candidates, both threshold steps): the same indices
        a = variants["select_ours"]()[0]
        others = [variants[v]()[0] for v in ("select_ours_2pass", "select_ours_candidates",
                                             "select_ours_torch_candidates", "select_ours_topk_threshold")
                  if v in variants]
        layer_rows_c = select(args.layers, select_backend="candidates")()[0]
        layer_rows = [variants[v]()[0] for v in ("select_ours_per_layer", "select_ours_per_layer_2pass")
                      if v in variants]
        out["select_backends_agree"] = bool(all(torch.equal(a, b) for b in others)
                                            and all(torch.equal(b, layer_rows_c) for b in layer_rows))
        # ties: coarse values (many equal to the cut-off) against a stable-sort reference of the tie rule
        coarse = (pre[: 1 << 24].float() * 4).round().to(pre.dtype)
        n_small = min(1 << 14, coarse.numel() // 4)
        ref = torch.sort(coarse.float(), descending=True, stable=True).indices[:n_small].sort().values
        backends = ("auto", "triton_2pass", "candidates") if two_pass else ("auto", "candidates")
        out["select_ties_exact"] = bool(all(
            torch.equal(select(x=coarse, n=n_small, select_backend=b)()[0], ref) for b in backends))
    except Exception as err:
        out["select_backends_agree"] = repr(err)
    return out


# ------------------------------------------------------------------ peer
def peer_worker(args: argparse.Namespace) -> None:
    """Time crosslayer-coding's own step in this (sub)process; print one JSON line."""
    sys.path.insert(0, PEER_DIR)
    from clt.config import CLTConfig as PeerConfig
    from clt.config import TrainingConfig
    from clt.models.activations import _apply_batch_topk_helper
    from clt.models.clt import CrossLayerTranscoder
    from clt.training.losses import LossManager

    dev = torch.device(args.device)
    nf, layers, d, n = args.peer_features, args.layers, args.d_model, args.tokens
    amp = dev.type == "cuda"
    res: dict[str, Any] = {}
    try:
        cfg = PeerConfig(num_features=nf, num_layers=layers, d_model=d, activation_fn="batchtopk", batchtopk_k=args.k)
        model = CrossLayerTranscoder(cfg, process_group=None, device=dev)
        tcfg = TrainingConfig(
            learning_rate=1e-4, training_steps=1000, train_batch_size_tokens=n, activation_path="unused",
            precision="bf16" if amp else "fp32", sparsity_lambda=SPARSITY, preactivation_coef=PREACT,
            aux_loss_factor=None, normalization_method="none",
        )
        losses = LossManager(tcfg, clt_config=cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = synthetic(n, layers, d, dev)
        inputs = {i: x[:, i].contiguous() for i in range(layers)}
        targets = {i: y[:, i].contiguous() for i in range(layers)}
        state = {"step": 0}
        dead = torch.zeros(layers, nf, dtype=torch.bool, device=dev)  # what its trainer passes early on

        def step() -> None:
            # what its trainer does per step (clt/training/trainer.py): activations, total loss, backward, AdamW
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                acts = model.get_feature_activations(inputs)
                loss, _ = losses.compute_total_loss(model, inputs, targets, state["step"], 1000,
                                                    precomputed_activations=acts, dead_neuron_mask=dead)
            loss.backward()
            opt.step()
            # its trainer drops the cached decoder norms after each step (they hold the previous graph)
            model.decoder_module._cached_decoder_norms = None
            state["step"] += 1

        res["peer_step"] = time_fn(step, dev, args.warmup, args.steps)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            pre, _ = model._encode_all_layers(inputs)
            res["peer_select"] = time_fn(
                lambda: _apply_batch_topk_helper(pre, cfg, dev, torch.float32, 0, None), dev, 2, args.select_steps
            )
    except torch.cuda.OutOfMemoryError as err:
        res["peer_step" if "peer_step" not in res else "peer_select"] = {"error": "out of memory", "detail": str(err)[:200]}
    except Exception as err:
        res["peer_error"] = {"error": repr(err), "trace": traceback.format_exc()[-1500:]}
    print("PEER_JSON " + json.dumps(res), flush=True)


def run_peer(nf: int, args: argparse.Namespace) -> dict[str, Any]:
    if not os.path.isdir(os.path.join(PEER_DIR, "clt")):
        return {"peer": "peer not run (.peers/crosslayer-coding missing)"}
    cmd = [sys.executable, "-m", "benchmarks.clt_step", "--peer-worker", "--peer-features", str(nf),
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--tokens", str(args.tokens),
           "--k", str(args.k), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--select-steps", str(args.select_steps), "--device", args.device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"peer": f"peer timed out after {args.peer_timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_JSON "):
            return json.loads(line[len("PEER_JSON "):])
    return {"peer": f"peer failed (rc={proc.returncode})", "stderr": proc.stderr[-2000:]}


# ------------------------------------------------------------------ main
def default_out(smoke: bool) -> str:
    """``benchmarks/results/clt_step_<device>.json`` (``clt_step_smoke.json`` for ``--smoke``)."""
    name = "clt_step_smoke.json" if smoke else f"clt_step_{device_slug()}.json"
    return os.path.join(ROOT, "benchmarks", "results", name)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (seconds)")
    p.add_argument("--features", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=200)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--select-steps", type=int, default=10,
                   help="calls per round of each selection variant (see time_interleaved)")
    p.add_argument("--select-rounds", type=int, default=10,
                   help="interleaved rounds of the selection variants and sweeps (every variant once per round)")
    p.add_argument("--select-warmup", type=int, default=3, help="untimed calls of each selection variant first")
    p.add_argument("--select-variants", nargs="+", default=None,
                   help="time only these selection variants (default: all; e.g. select_ours select_ours_2pass "
                        "phase_stash); the exactness checks run either way")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="time the Triton launch-shape sweeps with the selection variants")
    p.add_argument("--variants", nargs="+",
                   default=list(VARIANTS), help=f"what to measure (default: all of {VARIANTS})")
    p.add_argument("--module-decode", default="auto", help="CLTModule decode of the module variants (auto|dense|sparse)")
    p.add_argument("--aux-max-dead", type=int, default=512, help="CLTModule aux_max_dead (512 = its default)")
    p.add_argument("--profile-features", type=int, default=8192,
                   help="profile one module step (top ops) at this feature count")
    p.add_argument("--device", default=None)
    p.add_argument("--peer-timeout", type=int, default=240)
    p.add_argument("--out", default=None,
                   help="result JSON (default: benchmarks/results/clt_step_<device>.json, clt_step_smoke.json)")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-features", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = ["ours_dense" if v == "ours_dense_plaingrad" else v for v in args.variants]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.peer_worker:
        peer_worker(args)
        return None
    if args.smoke:
        args.features, args.layers, args.d_model, args.tokens, args.k = [64, 128], 3, 16, 64, 4
        args.steps, args.warmup, args.select_steps, args.select_rounds, args.select_warmup = 2, 1, 2, 2, 1
        args.profile_features, args.aux_max_dead = 128, 32
    if args.out is None:
        args.out = default_out(args.smoke)
    dev = torch.device(args.device)
    results: dict[str, Any] = {}
    for nf in args.features:
        row: dict[str, Any] = {}
        for variant in args.variants:
            try:
                if variant in ("ours_dense", "ours_sparse", "ours_dense_sparsegrad"):
                    row[variant] = ours_step(nf, args, dev, sparse=variant == "ours_sparse",
                                             sparse_grad=variant == "ours_dense_sparsegrad")
                elif variant in MODULE_VARIANTS:
                    grad = {"module_sparsegrad": True, "module_plaingrad": False}.get(variant)
                    row[variant] = module_step(nf, args, dev, aux=variant != "module_noaux", sparse_grad=grad,
                                               compile=variant == "module_compile")
                elif variant == "select":
                    row.update(selection(nf, args, dev))
                elif variant == "peer":
                    row.update(run_peer(nf, args))
            except torch.cuda.OutOfMemoryError as err:
                row[variant] = {"error": "out of memory", "detail": str(err)[:200]}
            except Exception as err:  # one failing variant must not kill the others
                row[variant] = {"error": repr(err), "trace": traceback.format_exc()[-1500:]}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        results[str(nf)] = row
        print(f"features {nf}: " + json.dumps({k: v.get("median_ms", v.get("ms", v)) if isinstance(v, dict) else v
                                               for k, v in row.items()}), flush=True)

    def ms(row: dict, key: str) -> float | None:
        v = row.get(key)
        return v.get("median_ms") if isinstance(v, dict) else None

    ratios = {}
    for nf, row in results.items():
        peer, peer_sel = ms(row, "peer_step"), ms(row, "peer_select")
        best = min([t for t in (ms(row, "ours_dense"), ms(row, "ours_sparse"), ms(row, "ours_dense_sparsegrad"))
                    if t is not None], default=None)
        mod, mod_noaux = ms(row, "module"), ms(row, "module_noaux")
        ratios[nf] = {
            "step_speedup_vs_peer": peer / best if peer and best else None,
            "module_speedup_vs_peer": peer / mod if peer and mod else None,
            "module_noaux_speedup_vs_peer": peer / mod_noaux if peer and mod_noaux else None,
            "module_sparsegrad_speedup_vs_peer": (peer / ms(row, "module_sparsegrad")
                                                  if peer and ms(row, "module_sparsegrad") else None),
            "module_plaingrad_speedup_vs_peer": (peer / ms(row, "module_plaingrad")
                                                 if peer and ms(row, "module_plaingrad") else None),
            "select_speedup_vs_peer": peer_sel / ms(row, "select_ours") if peer_sel and ms(row, "select_ours") else None,
            "module_compile_over_module": (ms(row, "module_compile") / mod
                                           if mod and ms(row, "module_compile") else None),
            # the goal: the module (what a user runs) no slower than the raw step (ours_dense)
            "module_over_raw_step": mod / ms(row, "ours_dense") if mod and ms(row, "ours_dense") else None,
        }
    report = {
        "shapes": {"layers": args.layers, "d_model": args.d_model, "tokens": args.tokens, "k": args.k},
        "loss": f"MSE + {SPARSITY} * tanh sparsity + {PREACT} * pre-activation loss (both sides)",
        "results": results,
        "ratios": ratios,
    }
    write_result(args.out, benchmark="clt_step", env=environment(on_gpu=dev.type == "cuda"),
                 command=command_line(argv), baseline=None, results=report)
    print(f"\n{'features':>9} | {'ours dense':>10} | {'dense sparse-grad':>17} | {'ours sparse':>11} | {'peer step':>9} | {'speedup':>7} | "
          f"{'sel ours':>8} | {'sel topk':>8} | {'sel peer':>8} | {'module':>7} | {'mod-aux':>7} | {'mod-plain':>9} | {'mod x':>6} | "
          f"{'peak GB dense/sparse/module/peer':>32}")
    for nf, row in results.items():
        def f(key: str, row: dict = row) -> str:
            v = ms(row, key)
            return f"{v:.1f}" if v is not None else ("OOM" if "memory" in str(row.get(key, "")) else "-")

        peaks = []
        for key in ("ours_dense", "ours_sparse", "module", "peer_step"):
            v = row.get(key)
            peaks.append(f"{v['peak_memory_gb']:.1f}" if isinstance(v, dict) and "peak_memory_gb" in v else "-")
        sp, msp = ratios[nf]["step_speedup_vs_peer"], ratios[nf]["module_speedup_vs_peer"]
        print(f"{nf:>9} | {f('ours_dense'):>10} | {f('ours_dense_sparsegrad'):>17} | {f('ours_sparse'):>11} | {f('peer_step'):>9} | "
              f"{(f'{sp:.2f}x' if sp else '-'):>7} | {f('select_ours'):>8} | {f('select_torch_topk'):>8} | "
              f"{f('peer_select'):>8} | {f('module'):>7} | {f('module_noaux'):>7} | {f('module_plaingrad'):>9} | "
              f"{(f'{msp:.2f}x' if msp else '-'):>6} | {'/'.join(peaks):>32}")
    for nf, row in results.items():
        times = {k: ms(row, k) for k in SELECT_KEYS}
        if times["select_ours"] is not None:
            print(f"\nselection at {nf} features, ms (select_ours took {row.get('select_path')}): " + ", ".join(
                f"{k}={t:.3f}" for k, t in times.items() if t is not None))
            print(f"  host syncs per call: {row.get('select_host_syncs')}; exact: {row.get('select_exact')}, "
                  f"paths agree: {row.get('select_backends_agree')}, ties: {row.get('select_ties_exact')}, "
                  f"fallback: {row.get('select_fallback_exact')}, sample's bound held: {row.get('select_fast_path')}")
            for key in ("select_ours", "select_ours_2pass", "phase_stash"):
                v = row.get(key)
                if isinstance(v, dict) and "e2e" in v:
                    part = {k: (round(v[k]["median_ms"], 3), round(v[k]["p10_ms"], 3), round(v[k]["p90_ms"], 3))
                            for k in ("device", "e2e", "host") if v.get(k)}
                    print(f"  {key} (median, p10, p90 ms): {part}; allocator mallocs: {v['allocator_mallocs']}")
            if row.get("one_pass_phases_sum_ms") is not None:
                print(f"  one-pass phases sum (sample + stash + compact + keep + gated fallback): "
                      f"{row['one_pass_phases_sum_ms']:.3f} ms")
            if row.get("select_rare_paths"):
                print(f"  one-pass rare paths per call: {row['select_rare_paths']}")
            for key in ("select_sweep", "stash_sweep", "select_sweep_2pass"):
                if isinstance(row.get(key), dict):
                    print(f"  {key} ({row[key]['path']}, default {row[key]['default']}): {row[key]['ms']}")
                    if "read_tb_per_s" in row[key]:
                        print(f"    read TB/s: {row[key]['read_tb_per_s']}")
    for nf, row in results.items():
        comp = row.get("module_compile")
        if isinstance(comp, dict) and "median_ms" in comp:
            base = ms(row, "module")
            print(f"\nmodule_compile at {nf} features: {comp['median_ms']:.2f} ms per step (module: "
                  f"{f'{base:.2f}' if base is not None else '-'} ms), "
                  f"compile {comp.get('compile_s') or float('nan'):.1f} s "
                  f"({comp.get('compiled_graphs')} graphs)")
        for key in MODULE_VARIANTS:
            v = row.get(key)
            if isinstance(v, dict) and "profile_top_ops" in v:
                print(f"\n{key} at {nf} features: decode={v['decode']}, host syncs per step: "
                      f"{v['host_syncs_per_step']}; op calls: {v.get('op_calls')}")
                print("  regions of training_step (ms): " + ", ".join(
                    f"{r}={t:.2f}" for r, t in sorted(v.get("regions_ms", {}).items())))
                print("  top ops of one step (self time, ms):")
                for op in v["profile_top_ops"][:12]:
                    print(f"  {op['self_ms']:9.3f}  x{op['calls']:<4} {op['op'][:90]}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
