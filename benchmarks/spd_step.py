"""SPD training-step time: ours (lightning_opt) side by side with goodfire's ``spd`` in one run.

    python -m benchmarks.spd_step             # CUDA: -> benchmarks/results/spd_step_gpt2_layer_<device>.json
    python -m benchmarks.spd_step --smoke     # CPU, tiny sizes: checks that every variant runs

Workloads (same target weights, same batches, same hyperparameters for both implementations; each workload's
``differences`` in the JSON lists what still differs):

* ``gpt2_layer`` (default): one MLP of GPT-2 small (124M shape, random weights: the GPU machine has no hub access),
  ``blocks.6.mlp.c_fc`` / ``c_proj`` at C=3072, as ``spd_gpt2_layer.yaml`` decomposes it: batch 8 x 512 tokens,
  shared CI MLP [1024], importance p 2 -> 0.5 (1e-3), stochastic + layerwise + PGD reconstruction (KL on the
  logits; PGD one signed-gradient step of 0.1 from a random start, one adversary for the batch).
* ``resid_mlp1``: the paper's 1-layer residual MLP (100 features, d_embed 1000, 50 neurons), C=100 on
  ``mlp_in`` and ``mlp_out``, scalar CI MLPs [16], importance p=2 (1e-5) + stochastic + layerwise
  reconstruction (MSE), batch 2048: goodfire's ``resid_mlp1_config.yaml``; with a ``parity`` check.
* ``lm``: our GPT (4 layers, d 256, vocab 4096, seq 128, batch 16) with MLP and attention projections
  decomposed, shared CI MLP [550], importance p 2->0.3 with the log term, stochastic-subset and
  PGD-subset reconstruction (KL), faithfulness 1e6: goodfire's ``ss_llama_simple_mlp`` recipe scaled down.

Variants, in the order they run (headline first, so a short budget still gives the goal ratio):

1. ``peer_bf16`` (their ComponentModel + ``compute_total_loss`` + AdamW, bf16 autocast as their default; their
   training has no compile option), ``ours_eager_bf16``, ``ours_regional_bf16`` (``compile=
   "regional"``: the target's repeated blocks, the masked linear layers and the KL compiled once each, fused
   AdamW); then the ``parity`` check on ``resid_mlp1``.
2. ablations: ``peer_fp32``, ``ours_eager_fp32``, ``ours_eager_fp32_sync`` (reads the loss back every step, as
   their loop reads every term and CI-L0).
3. ``ours_regional_fp32`` (a second compile).
4. ``ours_full_bf16`` (``compile="full"``: the whole step as one graph, for its compile time; ``--no-full-compile``
   skips it).

On request only (``--variants``): ``ours_full_bf16_lean`` (``compile="full"`` with inductor ``options``
``{"triton.autotune_pointwise": false}``: each pointwise kernel compiled in its heuristic launch configuration
instead of several benchmarked on the first call, a shorter cold compile) and ``ours_full_bf16_lean_cg`` (the same
plus ``"triton.cudagraphs": true``: every compiled graph replays as a CUDA graph). ``--variants a,b,c`` runs just
those variants, in that order (e.g. ``peer_bf16,ours_full_bf16_lean`` for the headline ratio alone). Each compiled
variant compiles with fresh inductor and Triton cache directories (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``),
so nothing an earlier variant compiled to disk is reused; the compile workers and the kernels an earlier variant
loaded into this process are, so the first compiled variant of a run (``row["compile_order"]`` 1) is the one whose
``compile_s`` is fully cold.

Every variant with PGD is timed a second time without its PGD terms (same module and optimizer; nothing
recompiled, but for ``compile="full"``'s small part that sums the terms): ``step_ms_nopgd``, ``pgd_ms`` (PGD cost per step), ``pgd_share``. Compiled variants report
``compile_s`` (first step minus a timed step), the regions compiled, graphs and graph breaks. Each variant runs
under its own time limit (SIGALRM, so a slow ``torch.compile`` is cut off too and recorded as timed out) inside a
global budget (270 s by default: the whole run stays under 5 minutes); an error or timeout is recorded in its row
and the run goes on. The JSON is rewritten after every variant, so a run killed from outside still leaves its
numbers; its ``summary`` holds best peer vs best ours against the goal (``--goal``, ``--compile-limit-s``). Host
syncs per step are counted with ``torch.cuda.set_sync_debug_mode``. The peer needs ``.peers/spd`` (their checkout)
and ``.peers/wheels`` (pydantic and its dependencies, unpacked on first use): see ``spd_peer_runner.py``; without
them the JSON records the peer as not runnable, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import spd_peer_runner as peer
from benchmarks._results import command_line, device_slug, environment, write_result
from lightning_opt.models import spd as S
from lightning_opt.modules.base import CompileConfig
from lightning_opt.modules.spd import PGDConfig, SPDLossConfig, SPDModule, SPDTrainConfig
from lightning_opt.optim.factory import OptimConfig

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# Workloads: (target, batches, our configs, their config)
# --------------------------------------------------------------------------------------------------


def resid_mlp1(device: str, smoke: bool) -> dict[str, Any]:
    from lightning_opt.models.toy import ResidMLP, ResidMLPConfig, sparse_feature_batch

    n, d, h, bs, C = (20, 64, 10, 64, 20) if smoke else (100, 1000, 50, 2048, 100)
    torch.manual_seed(0)
    target = ResidMLP(ResidMLPConfig(n_features=n, d_embed=d, d_mlp=h)).requires_grad_(False).eval()
    g = torch.Generator().manual_seed(1)
    batches = [sparse_feature_batch(bs, n, 0.01, (-1.0, 1.0), g).to(device) for _ in range(4)]
    patterns = [("layers.*.mlp_in", C), ("layers.*.mlp_out", C)]
    spd = S.SPDConfig(components=[{"pattern": p, "C": c} for p, c in patterns], ci_fn="mlp", ci_hidden=[16])
    loss = SPDLossConfig(importance_minimality=1e-5, p=2.0, stochastic_recon=1.0, stochastic_recon_layerwise=1.0, output="mse")
    theirs = {
        "ci_fn_type": "mlp",
        "ci_fn_hidden_dims": [16],
        "lr": 2e-3,
        "output_loss_type": "mse",
        "steps": 20_000,
        "loss_metric_configs": [
            {"classname": "ImportanceMinimalityLoss", "coeff": 1e-5, "pnorm": 2.0, "beta": 0.0},
            {"classname": "StochasticReconLayerwiseLoss", "coeff": 1.0},
            {"classname": "StochasticReconLoss", "coeff": 1.0},
        ],
    }
    return {"target": target, "batches": batches, "patterns": patterns, "spd": spd, "loss": loss, "lr": 2e-3, "theirs": theirs}


def lm(device: str, smoke: bool) -> dict[str, Any]:
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    if smoke:
        shape = {"vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}
        bs, T, Cs, hid = 2, 16, (16, 16, 8, 8), [16]
    else:
        shape = {"vocab_size": 4096, "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128}
        bs, T, Cs, hid = 16, 128, (650, 600, 300, 300), [550]
    torch.manual_seed(0)
    target = GPT(GPTConfig(**shape)).requires_grad_(False).eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (bs, T), generator=g).to(device) for _ in range(4)]
    patterns = [
        ("blocks.*.mlp.c_fc", Cs[0]),
        ("blocks.*.mlp.c_proj", Cs[1]),
        ("blocks.*.attn.c_attn", Cs[2]),
        ("blocks.*.attn.c_proj", Cs[3]),
    ]
    spd = S.SPDConfig(components=[{"pattern": p, "C": c} for p, c in patterns], ci_fn="shared_mlp", ci_hidden=hid)
    loss = SPDLossConfig(
        faithfulness=1e6, importance_minimality=2e-3, p=2.0, p_final=0.3, p_anneal_start=0.0, p_anneal_end=1.0, beta=0.1,
        stochastic_recon=0.0, stochastic_recon_layerwise=0.0, stochastic_recon_subset=0.5, pgd_recon_subset=0.5,
        pgd=PGDConfig(n_steps=1, step_size=1.0, init="random", scope="shared"), output="kl",
    )
    theirs = {
        "ci_fn_type": "shared_mlp",
        "ci_fn_hidden_dims": hid,
        "lr": 2e-4,
        "output_loss_type": "kl",
        "steps": 400_000,
        "loss_metric_configs": [
            {"classname": "ImportanceMinimalityLoss", "coeff": 2e-3, "pnorm": 2.0, "beta": 0.1,
             "p_anneal_start_frac": 0.0, "p_anneal_final_p": 0.3, "p_anneal_end_frac": 1.0},
            {"classname": "StochasticReconSubsetLoss", "coeff": 0.5},
            {"classname": "PGDReconSubsetLoss", "coeff": 0.5, "init": "random", "step_size": 1.0, "n_steps": 1,
             "mask_scope": "shared_across_batch"},
            {"classname": "FaithfulnessLoss", "coeff": 1e6},
        ],
    }
    return {"target": target, "batches": batches, "patterns": patterns, "spd": spd, "loss": loss, "lr": 2e-4, "theirs": theirs}


def gpt2_layer(device: str, smoke: bool) -> dict[str, Any]:
    """One MLP of GPT-2 small (124M shape; random weights, the GPU machine has no hub access), as
    ``spd_gpt2_layer.yaml`` decomposes it: ``blocks.6.mlp.c_fc`` and ``c_proj``, shared CI MLP, stochastic +
    layerwise + PGD reconstruction (KL on the logits)."""
    from lightning_opt.models.gpt2 import GPT, GPTConfig

    if smoke:
        shape = {"vocab_size": 64, "n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16}
        bs, T, C, hid, layer = 2, 16, 16, [16], 1
    else:
        shape = {"block_size": 512}  # GPT-2 small otherwise
        bs, T, C, hid, layer = 8, 512, 3072, [1024], 6
    torch.manual_seed(0)
    target = GPT(GPTConfig(**shape)).requires_grad_(False).eval()
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (bs, T), generator=g).to(device) for _ in range(4)]
    patterns = [(f"blocks.{layer}.mlp.c_fc", C), (f"blocks.{layer}.mlp.c_proj", C)]
    spd = S.SPDConfig(components=[{"pattern": p, "C": c} for p, c in patterns], ci_fn="shared_mlp", ci_hidden=hid)
    loss = SPDLossConfig(
        importance_minimality=1e-3, p=2.0, p_final=0.5, p_anneal_start=0.0, p_anneal_end=1.0,
        stochastic_recon=1.0, stochastic_recon_layerwise=1.0, pgd_recon=1.0,
        pgd=PGDConfig(n_steps=1, step_size=0.1, init="random", scope="shared"), output="kl",
    )
    differences = [
        "theirs reads every loss term and each layer's CI-L0 back to the host every step (.item()), and asserts on "
        "the PGD sources (a device sync); ours keeps them on the device",
        f"theirs attaches forward hooks per pass and recomputes the frozen blocks before block {layer} in every masked "
        f"pass; ours replaces the two layers once and reuses the target pass' outputs of those {layer} blocks (the "
        "same values)",
        "theirs computes the target's log-softmax in every KL term; ours once per step (the same values)",
        "initial V, U and CI weights are drawn by each implementation's own initialisation (same shapes)",
        "ours compiled variants use fused AdamW; their loop uses torch's default AdamW (foreach)",
    ]
    theirs = {
        "ci_fn_type": "shared_mlp",
        "ci_fn_hidden_dims": hid,
        "lr": 5e-4,
        "output_loss_type": "kl",
        "steps": 20_000,
        "loss_metric_configs": [
            {"classname": "ImportanceMinimalityLoss", "coeff": 1e-3, "pnorm": 2.0, "beta": 0.0,
             "p_anneal_start_frac": 0.0, "p_anneal_final_p": 0.5, "p_anneal_end_frac": 1.0},
            {"classname": "StochasticReconLoss", "coeff": 1.0},
            {"classname": "StochasticReconLayerwiseLoss", "coeff": 1.0},
            {"classname": "PGDReconLoss", "coeff": 1.0, "init": "random", "step_size": 0.1, "n_steps": 1,
             "mask_scope": "shared_across_batch"},
        ],
    }
    return {"target": target, "batches": batches, "patterns": patterns, "spd": spd, "loss": loss, "lr": 5e-4, "theirs": theirs,
            "differences": differences}


# --------------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------------


def our_step(
    w: dict[str, Any], device: str, bf16: bool, compile_mode: str, steps: int, smoke: bool = False,
    sync_each_step: bool = False, compile_options: dict[str, Any] | None = None,
) -> Any:
    """One of our training steps (forward, every loss term, backward, AdamW) as a closure.

    ``compile_mode`` is the module's ``compile.mode`` (``none``, ``regional`` or ``full``), applied by the module
    itself (:meth:`SPDModule.apply_compile`); ``step.compiled`` lists what it compiled. ``sync_each_step`` reads
    the loss back to the host every step, as goodfire's loop does (ablation for "fewer syncs");
    ``step.set_pgd(False)`` drops the PGD terms (their cost: the same module, nothing recompiled under regional
    compilation).
    """
    loss = copy.deepcopy(w["loss"])
    m = SPDModule(
        target=copy.deepcopy(w["target"]),
        spd=copy.deepcopy(w["spd"]),
        loss=loss,
        # smoke: trace with dynamo (graph breaks, guards) but skip inductor's slow CPU code generation
        train=SPDTrainConfig(autocast_bf16=bf16, faithfulness_warmup_steps=0),
        optim=OptimConfig(lr=w["lr"], betas=(0.9, 0.999), weight_decay=0.0),
        compile=CompileConfig(mode=compile_mode, backend="eager" if smoke else "inductor",
                              # inductor's options mean nothing to the eager backend of the smoke run
                              options={} if smoke else dict(compile_options or {})),
    ).to(device)
    params = m.spd.component_parameters() + m.spd.ci_parameters()
    fused = compile_mode != "none" and device.startswith("cuda")
    opt = torch.optim.AdamW(params, lr=w["lr"], weight_decay=0.0, fused=fused)
    compiled = m.apply_compile()
    frac = torch.zeros((), device=device)
    state = {"step": 0}
    pgd_coeffs = {k: getattr(loss, k) for k in ("pgd_recon", "pgd_recon_subset")}

    def step(batch: Any) -> Any:
        frac.fill_(state["step"] / steps)
        total, _terms = m.losses(batch, frac)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        state["step"] += 1
        return float(total.detach()) if sync_each_step else total.detach()

    def set_pgd(on: bool) -> None:
        for k, v in pgd_coeffs.items():
            setattr(m.loss_cfg, k, v if on else 0.0)

    step.compiled = compiled  # type: ignore[attr-defined]
    step.set_pgd = set_pgd  # type: ignore[attr-defined]
    # under compile="full" the PGD terms are a compiled part of their own: switching them off recompiles only the
    # small part that sums the terms (in the untimed step before the timing without PGD)
    step.pgd_switch_recompiles = False  # type: ignore[attr-defined]
    return step


def peer_step(w: dict[str, Any], device: str, bf16: bool) -> Any:
    cfg = dict(w["theirs"], autocast_bf16=bf16)
    return peer.build_step(copy.deepcopy(w["target"]).to(device), w["patterns"], cfg, device)


@torch.no_grad()
def parity(w: dict[str, Any], device: str) -> dict[str, Any]:
    """Same parameters in both implementations -> the same CI and loss values (deterministic terms).

    Copies V, U and the scalar CI MLPs of goodfire's model into ours, then compares causal
    importances, importance minimality, faithfulness and CI-masked reconstruction on one batch.
    """
    from spd.metrics import ci_masked_recon_loss, faithfulness_loss, importance_minimality_loss

    theirs = peer_step(w, device, False).model
    ours = SPDModule(target=copy.deepcopy(w["target"]), spd=copy.deepcopy(w["spd"]), loss=copy.deepcopy(w["loss"]),
                     train=SPDTrainConfig(faithfulness_warmup_steps=0)).to(device)
    for name in ours.spd.layer_names:
        layer, comp = ours.spd.layers[name], theirs.components[name]
        layer.V.copy_(comp.V)
        layer.U.copy_(comp.U)
        mine = ours.spd.ci_fns[name.replace(".", "-")].mlp
        lin = [m for m in theirs.ci_fns[name].layers if hasattr(m, "W")]
        for i, m in enumerate(lin):
            mine.weights[i].copy_(m.W)
            mine.biases[i].copy_(m.b)
    x = w["batches"][0]
    out_t = theirs(x, cache_type="input")
    ci_t = theirs.calc_causal_importances(pre_weight_acts=out_t.cache, sampling="continuous")
    target, inputs = ours.spd.target_forward(x)
    ci_o = ours.spd.causal_importances(inputs)
    lc = ours.loss_cfg
    res = {
        "target_out_max_abs_diff": float((target - out_t.output).abs().max()),
        "ci_lower_max_abs_diff": max(float((ci_o.lower[n] - ci_t.lower_leaky[n]).abs().max()) for n in ours.spd.layer_names),
        "importance_minimality": [
            float(S.importance_minimality_loss(ci_o.upper, lc.p, lc.beta, lc.eps)),
            float(importance_minimality_loss(ci_upper_leaky=ci_t.upper_leaky, current_frac_of_training=0.0, eps=lc.eps,
                                             pnorm=lc.p, beta=lc.beta, p_anneal_start_frac=1.0, p_anneal_final_p=None,
                                             p_anneal_end_frac=1.0)),
        ],
        "faithfulness": [float(S.faithfulness_loss(ours.spd.weight_deltas())), float(faithfulness_loss(theirs.calc_weight_deltas()))],
        "ci_masked_recon": [
            float(S.recon_loss(ours.spd.masked_forward(x, masks=dict(ci_o.lower)), target, lc.output)),
            float(ci_masked_recon_loss(model=theirs, output_loss_type=lc.output, batch=x, target_out=out_t.output, ci=ci_t.lower_leaky)),
        ],
    }
    res["max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in (res[k] for k in ("importance_minimality", "faithfulness", "ci_masked_recon")))
    return res


def count_syncs(step: Any, batch: Any, device: str) -> int | None:
    """Host-device synchronisations in one step (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(c.message) for c in caught)


class VariantTimeout(Exception):
    """A variant ran past its time budget (raised from SIGALRM, so also inside torch.compile)."""


def preimport_compile_stack() -> None:
    """Import torch.compile's machinery now, outside any time limit.

    The first ``torch.compile`` of a process imports inductor and AOTAutograd; a SIGALRM that lands inside
    those imports leaves them half-registered (``prims`` ops defined twice, "Library object has been
    destroyed"), and every later compile or ``torch._dynamo.explain`` in the process then fails.
    """
    import torch._dynamo.backends.debugging  # noqa: F401  (pulls in functorch.compile / partitioners)
    import torch._inductor.compile_fx  # noqa: F401


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`VariantTimeout` in the main thread after ``seconds`` (no-op where SIGALRM is missing)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise VariantTimeout(f"ran past its budget of {seconds:.1f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ``compile="full"`` variants with inductor options (``CompileConfig.options``), run on request
FULL_OPTION_VARIANTS: dict[str, dict[str, Any]] = {
    "ours_full_bf16_lean": {"triton.autotune_pointwise": False},
    "ours_full_bf16_lean_cg": {"triton.autotune_pointwise": False, "triton.cudagraphs": True},
}


@contextlib.contextmanager
def fresh_compile_cache(on: bool) -> Iterator[None]:
    """New, empty inductor and Triton cache directories for one compiled variant (so none of an earlier variant's
    compiled graphs or kernels on disk is reused), removed afterwards; the previous settings come back."""
    if not on:
        yield
        return
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="spd_step_inductor_") as d:
        os.environ.update({keys[0]: d, keys[1]: os.path.join(d, "triton")})
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _timed(step: Any, batches: list[Any], device: str, iters: int, measure_s: float) -> tuple[int, float, Any]:
    """Time up to ``iters`` steps, in synced chunks of 5, stopping after ``measure_s`` seconds: (steps, ms/step, last)."""
    _sync(device)
    done, last, t0 = 0, None, time.perf_counter()
    while done < iters:
        for _ in range(min(5, iters - done)):
            last = step(batches[done % len(batches)])
            done += 1
        _sync(device)
        if time.perf_counter() - t0 > measure_s:
            break
    return done, 1000 * (time.perf_counter() - t0) / done, last


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process (reset between variants)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values()))


def run_variant(
    name: str, make: Any, w: dict[str, Any], device: str, warmup: int, iters: int, budget_s: float, measure_s: float,
    pgd_share: bool = False,
) -> dict[str, Any]:
    """Build, warm up (compiles here), count syncs, then time up to ``iters`` steps or ``measure_s`` seconds.

    ``first_step_s`` is the first step's wall time (compilation included: ``compile_s`` is it minus one timed
    step). With ``pgd_share`` (and a step that can switch its PGD terms off without recompiling), the same step is
    timed again without PGD: ``step_ms_nopgd``, ``pgd_ms`` (the PGD cost per step) and ``pgd_share``. The whole
    variant runs under ``budget_s``; any error or timeout is recorded in the row, never raised.
    """
    row: dict[str, Any] = {"variant": name, "budget_s": round(budget_s, 1)}
    batches = w["batches"]
    t_start = time.perf_counter()
    step = None
    try:
        preimport_compile_stack()  # never under the alarm (see its docstring)
        torch._dynamo.utils.counters.clear()
        with time_limit(budget_s):
            step = make()
            row["build_s"] = round(time.perf_counter() - t_start, 2)
            if getattr(step, "compiled", None):
                row["compiled"] = list(step.compiled)
            last = None
            for i in range(warmup):
                t_first = time.perf_counter()
                last = step(batches[i % len(batches)])
                _sync(device)
                if i == 0:
                    row["first_step_s"] = round(time.perf_counter() - t_first, 2)
            row["setup_and_warmup_s"] = round(time.perf_counter() - t_start, 2)
            row["syncs_per_step"] = count_syncs(step, batches[0], device)
            done, ms, last = _timed(step, batches, device, iters, measure_s)
            row["timed_iters"], row["step_ms"] = done, ms
            row["final_loss"] = float(last) if last is not None else None
            if "first_step_s" in row and row.get("compiled"):
                row["compile_s"] = round(max(row["first_step_s"] - ms / 1000, 0.0), 2)
            row["graphs"], row["graph_breaks"] = _dynamo_counts()
            if device.startswith("cuda"):
                row["peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            if pgd_share and hasattr(step, "set_pgd") and not getattr(step, "pgd_switch_recompiles", False):
                step.set_pgd(False)
                step(batches[0])  # a step without PGD first (allocator, any new region variant)
                done, ms_nopgd, _ = _timed(step, batches, device, iters, measure_s)
                step.set_pgd(True)
                row["step_ms_nopgd"] = ms_nopgd
                row["pgd_ms"] = ms - ms_nopgd
                row["pgd_share"] = ms / ms_nopgd
    except Exception as err:  # one failing variant must not kill the others
        row["error"] = f"{type(err).__name__}: {err}"
        row["traceback"] = traceback.format_exc()[-2000:]
        if "VariantTimeout" in row["traceback"]:  # dynamo may wrap it (BackendCompilerFailed)
            row["error"] = f"timeout: ran past its budget of {budget_s:.1f} s ({row['error'][:200]})"
    finally:
        row["wall_s"] = round(time.perf_counter() - t_start, 2)
        del step
        # compiled code of this variant (or a compile cut off half-way) must not count against the
        # next variant's recompile limit or hold its memory
        torch._dynamo.reset()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return row


# (ratio name, numerator variant, denominator variant): numerator time / denominator time
RATIOS = [
    ("goal: peer_bf16 / ours_regional_bf16 (both at their defaults)", "peer_bf16", "ours_regional_bf16"),
    ("peer_fp32 / ours_regional_bf16", "peer_fp32", "ours_regional_bf16"),
    ("peer_bf16 / ours_eager_bf16 (no compile)", "peer_bf16", "ours_eager_bf16"),
    ("structure (module replacement, cached target weights, prefix replay; both read values back every step, fp32 eager)",
     "peer_fp32", "ours_eager_fp32_sync"),
    ("fewer syncs (ours fp32 eager: loss read every step / never)", "ours_eager_fp32_sync", "ours_eager_fp32"),
    ("bf16 autocast, ours eager (fp32 / bf16)", "ours_eager_fp32", "ours_eager_bf16"),
    ("bf16 autocast, peer (fp32 / bf16)", "peer_fp32", "peer_bf16"),
    ("regional compile + fused AdamW, bf16 (eager / compiled)", "ours_eager_bf16", "ours_regional_bf16"),
    ("regional compile + fused AdamW, fp32 (eager / compiled)", "ours_eager_fp32", "ours_regional_fp32"),
    ("bf16 autocast, ours compiled (fp32 / bf16)", "ours_regional_fp32", "ours_regional_bf16"),
    ("whole-step graph vs regional, bf16 (full / regional)", "ours_full_bf16", "ours_regional_bf16"),
]


def speedups(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["variant"]: r for r in rows if "step_ms" in r}
    out = {name: by[a]["step_ms"] / by[b]["step_ms"] for name, a, b in RATIOS if a in by and b in by}
    peers = [r["step_ms"] for n, r in by.items() if n.startswith("peer")]
    ours = [r["step_ms"] for n, r in by.items() if n.startswith("ours") and "sync" not in n]
    if peers and ours:
        out["best peer / best ours"] = min(peers) / min(ours)
    return out


def summary(rows: list[dict[str, Any]], goal_ratio: float, compile_limit_s: float) -> dict[str, Any]:
    """The headline: best peer vs best ours (which variants, the ratio, the goal), our best compile time, and
    the PGD cost per step of each implementation's best variant."""
    by = {r["variant"]: r for r in rows if "step_ms" in r}
    peers = {n: r for n, r in by.items() if n.startswith("peer")}
    ours = {n: r for n, r in by.items() if n.startswith("ours") and "sync" not in n}
    out: dict[str, Any] = {}
    if ours:
        best = min(ours, key=lambda n: ours[n]["step_ms"])
        out["best_ours"] = {"variant": best, "step_ms": ours[best]["step_ms"]}
        compiled = {n: r["compile_s"] for n, r in ours.items() if "compile_s" in r}
        if compiled:
            out["ours_compile_s"] = compiled
    # the compile mode the GPT-2 layer config uses: every regional variant compiled, each within the limit
    regional = [r for r in rows if r["variant"].startswith("ours_regional") and "skipped" not in r]
    if regional:
        out[f"ours_regional_compile_within_{compile_limit_s:.0f}_s"] = all(
            "compile_s" in r and r["compile_s"] <= compile_limit_s for r in regional)
    if ours and "pgd_ms" in ours[out["best_ours"]["variant"]]:
        r = ours[out["best_ours"]["variant"]]
        out["best_ours"].update(pgd_ms=r["pgd_ms"], pgd_share=r["pgd_share"])
    if ours and "compile_s" in ours[out["best_ours"]["variant"]]:
        out["best_ours"]["compile_s"] = ours[out["best_ours"]["variant"]]["compile_s"]
    if peers:
        best = min(peers, key=lambda n: peers[n]["step_ms"])
        out["best_peer"] = {"variant": best, "step_ms": peers[best]["step_ms"]}
        if "pgd_ms" in peers[best]:
            out["best_peer"].update(pgd_ms=peers[best]["pgd_ms"], pgd_share=peers[best]["pgd_share"])
    if ours and peers:
        ratio = out["best_peer"]["step_ms"] / out["best_ours"]["step_ms"]
        out["best_vs_best"] = ratio
        out[f"best_vs_best_at_least_{goal_ratio:g}x"] = ratio >= goal_ratio
        # the goal: that ratio with our best variant compiling within the limit
        out[f"goal_{goal_ratio:g}x_within_{compile_limit_s:.0f}_s_compile"] = (
            ratio >= goal_ratio and out["best_ours"].get("compile_s", 0.0) <= compile_limit_s)
    timed_out = [r["variant"] for r in rows if str(r.get("error", "")).startswith("timeout")]
    if timed_out:
        out["timed_out"] = timed_out
    return out


def print_table(results: dict[str, Any], env: dict[str, Any]) -> None:
    print(f"\nSPD step time on {env['device']} (torch {env['torch']})", flush=True)
    print(f"{'workload':<12}{'variant':<22}{'ms/step':>9}{'no PGD':>9}{'iters':>6}{'syncs':>6}{'compile s':>10}"
          f"{'loss':>11}  note")
    for wname, res in results["workloads"].items():
        for r in res["rows"]:
            ms = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
            nopgd = f"{r['step_ms_nopgd']:.2f}" if "step_ms_nopgd" in r else "-"
            syncs = "-" if r.get("syncs_per_step") is None else str(r["syncs_per_step"])
            comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            loss = f"{r['final_loss']:.4g}" if r.get("final_loss") is not None else "-"
            note = (r.get("error") or r.get("skipped") or "")[:60]
            print(f"{wname:<12}{r['variant']:<22}{ms:>9}{nopgd:>9}{r.get('timed_iters', '-'):>6}{syncs:>6}{comp:>10}"
                  f"{loss:>11}  {note}")
        for k, v in res.get("speedup", {}).items():
            print(f"{'':<12}{v:6.2f}x  {k}")
        if res.get("summary"):
            print(f"{'':<12}summary: {json.dumps(res['summary'])}")
        if "parity" in res:
            print(f"{'':<12}parity (same parameters, ours vs theirs): {json.dumps(res['parity'])[:300]}")


def _versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("lightning", "triton", "pydantic", "einops", "jaxtyping"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    out["cuda"] = torch.version.cuda
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU-sized shapes and 2 iterations")
    ap.add_argument("--out", default=None,
                    help="result JSON (default benchmarks/results/spd_step_<workloads>_<device>.json, _smoke with --smoke)")
    ap.add_argument("--iters", type=int, default=50, help="timed steps per variant (at most)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch.compile compiles here)")
    ap.add_argument("--measure-s", type=float, default=4.0, help="stop timing a variant after this many seconds")
    ap.add_argument("--budget-s", type=float, default=270.0, help="whole run, from start to JSON; later variants are skipped")
    ap.add_argument("--eager-budget-s", type=float, default=40.0, help="one eager variant (build, warmup, timing)")
    ap.add_argument("--compile-budget-s", type=float, default=90.0,
                    help="one compiled variant, compile and timing included (a longer one is recorded as timed out)")
    ap.add_argument("--compile-limit-s", type=float, default=60.0, help="the compile time the summary checks against")
    ap.add_argument("--goal", type=float, default=4.0, help="best peer / best ours ratio the summary checks against")
    ap.add_argument("--workloads", default="gpt2_layer", help="comma-separated: gpt2_layer, resid_mlp1, lm")
    ap.add_argument("--no-peer", action="store_true", help="skip goodfire's spd")
    ap.add_argument("--no-ablations", action="store_true", help="only the headline variants")
    ap.add_argument("--no-full-compile", action="store_true", help="skip ours_full_bf16 (the whole step as one graph)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names: run only these, in this order (see the module docstring)")
    args = ap.parse_args(argv)
    t_begin = time.perf_counter()
    deadline = t_begin + args.budget_s
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    iters, warmup = (2, 1) if args.smoke else (args.iters, args.warmup)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    builders = {"resid_mlp1": resid_mlp1, "lm": lm, "gpt2_layer": gpt2_layer}
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {sorted(builders)}")
    env = environment(on_gpu=device == "cuda")
    env.update({k: v for k, v in _versions().items() if k not in env})  # with the peer's own dependencies
    goal = {"best_vs_best_at_least": args.goal, "compile_s_at_most": args.compile_limit_s}
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "iters": iters,
        "warmup": warmup,
        "budgets_s": {"total": args.budget_s, "eager": args.eager_budget_s, "compiled": args.compile_budget_s,
                      "measure": args.measure_s},
        "workloads": {},
    }
    slug = "smoke" if args.smoke else device_slug()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"spd_step_{'_'.join(names)}_{slug}.json"

    def save() -> None:  # after every variant, so a run killed from outside still leaves its numbers
        results["elapsed_s"] = round(time.perf_counter() - t_begin, 1)
        write_result(out, benchmark="spd_step", env=env, command=command_line(argv), baseline=None, results=results,
                     goals=goal)

    use_peer = not args.no_peer
    if use_peer:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results["peer_stubbed_imports"] = peer.install()
            commit = peer.PEER_DIR / "COMMIT"
            results["peer_commit"] = commit.read_text().strip() if commit.exists() else None
            results["peer_runnable"] = True
        except Exception as err:
            results["peer_runnable"] = False
            results["peer_error"] = f"{type(err).__name__}: {err}"
            use_peer = False
    else:
        results["peer_runnable"] = None  # not asked for
    results["peer_compiled"] = ("not offered: goodfire spd's training loop (spd/run_spd.py) has no torch.compile "
                                "option, so only its eager step runs")
    ws = {n: builders[n](device, args.smoke) for n in names}
    for n in names:
        results["workloads"][n] = {"rows": [], "speedup": {}, "differences": ws[n].get("differences", [])}

    def variants(wname: str, phase: int) -> list[tuple[str, Any, bool]]:
        w, steps = ws[wname], int(ws[wname]["theirs"]["steps"])

        def ours(bf16: bool, mode: str, **kw: Any) -> Any:
            return lambda: our_step(w, device, bf16, mode, steps, args.smoke, **kw)

        v: list[tuple[str, Any, bool]] = []  # (name, factory, compiled)
        if phase == 1:
            if use_peer:
                v.append(("peer_bf16", lambda: peer_step(w, device, True), False))
            v += [("ours_eager_bf16", ours(True, "none"), False), ("ours_regional_bf16", ours(True, "regional"), True)]
        elif phase == 2 and not args.no_ablations:
            if use_peer:
                v.append(("peer_fp32", lambda: peer_step(w, device, False), False))
            v += [("ours_eager_fp32", ours(False, "none"), False),
                  ("ours_eager_fp32_sync", ours(False, "none", sync_each_step=True), False)]
        elif phase == 3 and not args.no_ablations:
            v = [("ours_regional_fp32", ours(False, "regional"), True)]
        elif phase == 4 and not args.no_ablations and not args.no_full_compile:
            v = [("ours_full_bf16", ours(True, "full"), True)]
        return v

    def requested(wname: str) -> list[tuple[str, Any, bool]]:
        """``--variants``: every known variant by name, in the order asked."""
        w, steps = ws[wname], int(ws[wname]["theirs"]["steps"])
        known = {name: (make, compiled) for phase in (1, 2, 3, 4) for name, make, compiled in variants(wname, phase)}
        for name, opts in FULL_OPTION_VARIANTS.items():
            known[name] = (lambda o=opts: our_step(w, device, True, "full", steps, args.smoke, compile_options=o), True)
        if use_peer:
            known["peer_bf16"] = (lambda: peer_step(w, device, True), False)
            known["peer_fp32"] = (lambda: peer_step(w, device, False), False)
        wanted = [n for n in args.variants.split(",") if n]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(known)}")
        return [(n, *known[n]) for n in wanted]

    reserve_s = 5.0  # parity check + writing the JSON
    compile_order = 0
    # headline variants first, then cheap ablations, then the extra compiles; or the ones asked for
    for phase in (1, 2, 3, 4) if args.variants is None else (0,):
        for wname in names:
            res = results["workloads"][wname]
            has_pgd = any(c["classname"].startswith("PGD") for c in ws[wname]["theirs"]["loss_metric_configs"])
            for vname, make, compiled in variants(wname, phase) if phase else requested(wname):
                left = deadline - time.perf_counter() - reserve_s
                cap = args.compile_budget_s if compiled else args.eager_budget_s
                if left < min(cap, 30.0 if compiled else 5.0):  # a compile cut off at once is wasted time
                    res["rows"].append({"variant": vname, "skipped": f"global budget of {args.budget_s:.0f} s used up"})
                    print(f"[{time.perf_counter() - t_begin:6.1f}s] {wname}/{vname}: skipped (budget)", flush=True)
                    continue
                print(f"[{time.perf_counter() - t_begin:6.1f}s] {wname}/{vname} ...", flush=True)
                if compiled:
                    compile_order += 1
                with fresh_compile_cache(compiled and not args.smoke):
                    row = run_variant(vname, make, ws[wname], device, warmup, iters, min(cap, left), args.measure_s,
                                      pgd_share=has_pgd and "sync" not in vname)
                if compiled:
                    row["compile_order"] = compile_order
                    opts = FULL_OPTION_VARIANTS.get(vname)
                    if opts:
                        row["compile_options"] = opts
                res["rows"].append(row)
                res["speedup"] = speedups(res["rows"])
                res["summary"] = summary(res["rows"], args.goal, args.compile_limit_s)
                msg = f"{row['step_ms']:.2f} ms/step" if "step_ms" in row else row.get("error", "")[:120]
                if "step_ms_nopgd" in row:
                    msg += f", {row['step_ms_nopgd']:.2f} without PGD"
                if "compile_s" in row:
                    msg += f", compile {row['compile_s']:.1f} s"
                print(f"[{time.perf_counter() - t_begin:6.1f}s] {wname}/{vname}: {msg} (wall {row['wall_s']} s)", flush=True)
                save()
            if phase == 1 and wname == "resid_mlp1" and use_peer:
                try:
                    with time_limit(max(deadline - time.perf_counter(), 1.0)):
                        res["parity"] = parity(ws[wname], device)
                except Exception as err:
                    res["parity"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
                save()
    print_table(results, env)
    save()
    print(f"wrote {out} ({results['elapsed_s']} s)")
    return results


if __name__ == "__main__":
    main()
