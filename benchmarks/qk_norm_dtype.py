"""QK-norm gain dtype under bf16 autocast: does the "Mismatch dtype between input and weight ... Cannot dispatch to
fused implementation" warning cost training time?

The speedrun config's QK-norm (``RMSNorm`` with a learned float32 gain, ``norm_weight: true``) normalises queries
and keys straight out of the ``c_attn`` projection, which are bfloat16 under autocast. ``torch.rms_norm`` with a
bfloat16 input and a float32 gain warns once and runs its composite form (upcast, pow, mean, rsqrt, two muls, cast)
instead of the fused CUDA kernel; the output is bfloat16 either way. The candidate casts the gain to the input's
dtype first, as the model's MLA latent norms already do (``_norm_in_dtype``): the fused kernel in eager mode, but
the gain is rounded to bfloat16, so the numbers differ slightly once the gains have trained away from 1.

Rows: ``current`` (float32 gain) and ``gain_in_input_dtype``, each eager and under ``torch.compile``: forward +
backward of the ``gpt2-124m-speedrun`` model in its 1024-token geometry (``gpt2_common.SHORT_GEOMETRY``: causal attention over
1024-token windows, 32 x 1024 tokens; its execution otherwise, FP8 where the GPU has it), bfloat16 autocast.
Interleaved rounds, median step time (CUDA events). Also: which op the QK-norm dispatches to, and the loss and
gradient difference between the two at the same (perturbed) gains.

    python -m benchmarks.qk_norm_dtype            # CUDA: benchmarks/results/qk_norm_dtype_<device>.json, ~2 min
    python -m benchmarks.qk_norm_dtype --smoke    # a tiny model on the CPU, eager, in seconds

Measured (``results/qk_norm_dtype_nvidia-h200.json``, one H200, torch 2.11): compiled, as the recipe runs, 55.42 ms
per step with the float32 gain and 56.10 ms with the candidate (x1.012, within the rounds' spread): under
``torch.compile`` the warning is raised once while dynamo runs the op on fake tensors, and inductor generates the
norm's kernels from either form, so it costs nothing. Eager: 139.08 vs 116.06 ms (the candidate reaches
``aten._fused_rms_norm``). The model keeps the float32 gain: the candidate would change the numbers of compiled
runs for no speed.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._results import command_line, device_slug, environment, write_result
from benchmarks.attention_kv import timed
from benchmarks.gpt2_common import load_yaml_config, yaml_execution
from lightning_opt.models.gpt2 import GPT, RMSNorm, _norm_in_dtype

ROOT = Path(__file__).resolve().parents[1]

FULL = dict(batch=32, seq=1024, rounds=4, warmup=3, steps=10, compile=True)
SMOKE = dict(batch=2, seq=32, rounds=2, warmup=1, steps=2, compile=False,
             shape=dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32, skip_attn_layers=[],
                        n_value_embeds=1, eot_token=255))
VARIANTS = ("current", "gain_in_input_dtype")


class GainInInputDtype(RMSNorm):
    """The candidate: the gain cast to the input's dtype, so bfloat16 q/k meet a bfloat16 gain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm_in_dtype(self, x)


def build(spec: dict[str, Any], variant: str, device: torch.device) -> GPT:
    cfg, _, _, raw = load_yaml_config("gpt2-124m-speedrun", geometry="short")
    # zero-initialised projections and head would hide the queries and keys from the loss and its gradient
    cfg = replace(cfg, zero_init_proj=False, **spec.get("shape", {}))
    torch.manual_seed(0)
    model = GPT(cfg, yaml_execution(raw))
    g = torch.Generator().manual_seed(1)
    for mod in model.modules():
        if isinstance(mod, RMSNorm) and mod.weight is not None:  # trained gains are not all 1 (exact in bf16)
            with torch.no_grad():
                mod.weight.add_(0.1 * torch.randn(mod.weight.shape, generator=g))
        if variant == "gain_in_input_dtype" and type(mod) is RMSNorm:
            mod.__class__ = GainInInputDtype
    return model.to(device)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def qk_norm_ops(model: GPT, device: torch.device) -> list[str]:
    """The aten ops one QK-norm call dispatches to on a bfloat16 input (eager)."""
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm) and m.weight is not None)
    x = torch.randn(2, 4, 8, norm.weight.shape[0], device=device, dtype=torch.bfloat16)
    with torch.no_grad(), _Ops() as rec:
        norm(x)
    return rec.ops


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, eager only")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/qk_norm_dtype_<device>.json)")
    args = p.parse_args(argv)
    spec = SMOKE if args.smoke else FULL
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("error: no CUDA device; run with --smoke on a CPU")
    models = {v: build(spec, v, device) for v in VARIANTS}
    vocab = models["current"].config.vocab_size
    x = torch.randint(0, vocab, (spec["batch"], spec["seq"] + 1), generator=torch.Generator().manual_seed(2)).to(device)

    def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads = [q.grad.float().clone() for q in model.parameters() if q.grad is not None]
        model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads

    (la, ga), (lb, gb) = (loss_and_grads(models[v]) for v in VARIANTS)
    numerics = {"loss_current": la.item(), "loss_gain_in_input_dtype": lb.item(),
                "loss_abs_diff": (la - lb).abs().item(),
                "grad_max_rel_diff": max(((a - b).norm() / a.norm().clamp_min(1e-30)).item() for a, b in zip(ga, gb))}
    dispatch = {v: sorted(set(qk_norm_ops(models[v], device))) for v in VARIANTS}

    modes = ["eager"] + (["compiled"] if spec["compile"] else [])
    runners = {(v, mode): (torch.compile(models[v]) if mode == "compiled" else models[v])
               for v in VARIANTS for mode in modes}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for r in range(spec["rounds"]):
        for key, model in runners.items() if r % 2 == 0 else reversed(list(runners.items())):
            warm = spec["warmup"] if r == 0 else 1
            t = timed(lambda m=model: loss_and_grads(m), warm, spec["steps"], device)
            times[key].extend(t)
    rows = []
    for (v, mode), t in times.items():
        ms = statistics.median(t)
        rows.append({"variant": v, "mode": mode, "step_ms": round(ms, 3),
                     "tokens_per_s": round(spec["batch"] * spec["seq"] / ms * 1e3, 1), "step_ms_all": t})
        print(f"{mode:>8} {v:<20} {ms:9.3f} ms/step  ({rows[-1]['tokens_per_s']:,.0f} tokens/s)")
    ratio = {mode: next(r["step_ms"] for r in rows if r["variant"] == "gain_in_input_dtype" and r["mode"] == mode)
             / next(r["step_ms"] for r in rows if r["variant"] == "current" and r["mode"] == mode) for mode in modes}
    for mode, value in ratio.items():
        print(f"{mode}: gain_in_input_dtype / current step time = {value:.4f}")
    print(f"QK-norm ops: {dispatch}")
    print(f"numerics: {numerics}")
    result = {"spec": spec, "rows": rows,
              "step_time_ratio_candidate_over_current": ratio, "qk_norm_dispatch": dispatch, "numerics": numerics}
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "qk_norm_dtype_smoke.json" if args.smoke else f"qk_norm_dtype_{device_slug()}.json")
    write_result(out, benchmark="qk_norm_dtype", env=environment(device.type == "cuda"), command=command_line(argv),
                 baseline=None, results=result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
