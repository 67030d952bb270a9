"""A cheaper PGD schedule against the fixed one: SPD on the 1-layer residual MLP, CPU.

    python -m benchmarks.spd_pgd_schedule            # -> benchmarks/results/spd_pgd_schedule_cpu.json
    python -m benchmarks.spd_pgd_schedule --smoke    # tiny sizes, seconds: checks that every variant runs

Every variant trains the same decomposition (same trained target, same initial components, same data stream
per seed) for the same number of optimizer steps with a ``pgd_recon`` term; only the number of PGD ascent
steps per optimizer step differs:

* ``fixed_1``: 1 ascent step throughout (the cheapest adversary);
* ``fixed_k``: ``k`` ascent steps throughout (the reference);
* ``schedule``: 1 ascent step for the first half, ``k`` from then on (``loss.pgd.n_steps_schedule``:
  ``[[steps // 2, k]]``).

Reported per variant (means over seeds, and each seed): wall time per optimizer step, the time share of the PGD
inner loop (:meth:`SPDModule.pgd_ascent`; on the CPU every op is synchronous, so the clock brackets it exactly),
both in process CPU time (one thread: not inflated by other processes on a shared machine) and wall time,
and after training, on held-out batches: the reconstruction under stochastic masks, under CI masks and under
an evaluation adversary with ``k_eval`` ascent steps (the same for every variant), faithfulness
(``mean (W - V U)^2``), alive components (importance above 0.1 on some held-out input, over both layers),
CI-L0 and the identity-CI error of ``mlp_in``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_opt.models import spd as S
from lightning_opt.models.toy import ResidMLPConfig, sparse_feature_batch, train_resid_mlp
from lightning_opt.modules.spd import PGDConfig, SPDLossConfig, SPDModule, SPDTrainConfig
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]


class _TimedSPD(SPDModule):
    """SPDModule that adds up the wall time of its PGD inner loop."""

    pgd_time_s = 0.0
    pgd_cpu_s = 0.0

    def pgd_ascent(self, *args: Any, **kwargs: Any) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            super().pgd_ascent(*args, **kwargs)
        finally:
            self.pgd_time_s += time.perf_counter() - t0
            self.pgd_cpu_s += time.process_time() - c0


def _sizes(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"n_features": 20, "d_embed": 64, "d_mlp": 10, "C": 20, "batch": 64, "target_steps": 50,
                "steps": 6, "k": 3, "k_eval": 4, "eval_batches": 1}
    return {"n_features": 100, "d_embed": 1000, "d_mlp": 50, "C": 100, "batch": 256, "target_steps": 1000,
            "steps": 800, "k": 4, "k_eval": 8, "eval_batches": 4}


def _module(target: torch.nn.Module, z: dict[str, Any], pgd: PGDConfig, seed: int) -> _TimedSPD:
    spd = S.SPDConfig(components=[{"pattern": "layers.*.mlp_in", "C": z["C"]}, {"pattern": "layers.*.mlp_out", "C": z["C"]}],
                      ci_fn="mlp", ci_hidden=[16])
    loss = SPDLossConfig(importance_minimality=1e-5, p=2.0, stochastic_recon=1.0, stochastic_recon_layerwise=1.0,
                         pgd_recon=1.0, pgd=pgd, output="mse")
    train = SPDTrainConfig(faithfulness_warmup_steps=200, seed=seed)
    import copy

    return _TimedSPD(target=copy.deepcopy(target), spd=spd, loss=loss, train=train,
                     optim=OptimConfig(lr=2e-3, betas=(0.9, 0.999), weight_decay=0.0),
                     schedule=ScheduleConfig(name="constant"))


@torch.no_grad()
def _evaluate(m: SPDModule, batches: list[torch.Tensor], k_eval: int, step_size: float) -> dict[str, float]:
    spd = m.spd
    acc: dict[str, float] = {}
    alive: dict[str, torch.Tensor] = {}
    for x in batches:
        spd.refresh_delta_weights()
        out, inputs = spd.target_forward(x)
        ci = spd.causal_importances(inputs).lower
        for n, g in ci.items():
            seen = (g > 0.1).flatten(0, -2).any(0)
            alive[n] = seen if n not in alive else alive[n] | seen
        stoch = spd.masked_forward(x, masks=spd.stochastic_masks(ci), delta_masks=spd.delta_masks(ci))
        ci_out = spd.masked_forward(x, masks=dict(ci))
        m.loss_cfg.pgd = PGDConfig(n_steps=k_eval, step_size=step_size)  # one adversary for every variant
        m.pgd_steps_now = None
        with torch.enable_grad():
            adv = m.pgd_recon(x, out, dict(ci), x.shape[:-1], routes=None)
        parts = {"recon_stochastic": S.recon_loss(stoch, out, "mse"), "recon_ci": S.recon_loss(ci_out, out, "mse"),
                 f"recon_pgd{k_eval}": adv, "ci_l0": sum(S.ci_l0(g) for g in ci.values())}
        for k, v in parts.items():
            acc[k] = acc.get(k, 0.0) + float(v) / len(batches)
        spd.state.delta_weights = {}
    acc["faithfulness"] = float(S.faithfulness_loss(spd.weight_deltas()))
    acc["alive_components"] = int(sum(int(a.sum()) for a in alive.values()))
    acc["identity_ci_error_mlp_in"] = float(m.toy_metrics().get("identity_ci_error/layers.0.mlp_in", float("nan")))
    return acc


def run_variant(name: str, pgd: PGDConfig, target: torch.nn.Module, z: dict[str, Any], seed: int,
                eval_batches: list[torch.Tensor]) -> dict[str, Any]:
    torch.manual_seed(seed)
    m = _module(target, z, pgd, seed)
    m.train_cfg.identity_patterns = ["layers.*.mlp_in"]
    m.faithfulness_warmup()
    opt = torch.optim.AdamW(m.spd.component_parameters() + m.spd.ci_parameters(), lr=m.optim_config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1000 + seed)  # the same data stream for every variant of a seed
    frac = torch.zeros(())
    step_times: list[float] = []
    step_cpu: list[float] = []
    pgd_times: list[float] = []
    pgd_cpu: list[float] = []
    losses: list[float] = []
    steps = z["steps"]
    for step in range(steps):
        x = sparse_feature_batch(z["batch"], z["n_features"], 0.01, (-1.0, 1.0), gen)
        frac.fill_(step / steps)
        m.pgd_steps_now = pgd.steps_at(step)  # what training_step sets
        m.pgd_time_s = m.pgd_cpu_s = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        total, terms = m.compute_losses(x, frac)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        pgd_times.append(m.pgd_time_s)
        pgd_cpu.append(m.pgd_cpu_s)
        losses.append(float(total.detach()))
    skip = min(5, steps // 4)  # first steps: allocator warmup
    t_step, t_pgd = statistics.fmean(step_times[skip:]), statistics.fmean(pgd_times[skip:])
    c_step, c_pgd = statistics.fmean(step_cpu[skip:]), statistics.fmean(pgd_cpu[skip:])
    tail = losses[-max(1, steps // 10):]
    row = {
        "variant": name, "seed": seed, "n_steps": pgd.n_steps, "n_steps_schedule": pgd.n_steps_schedule,
        "pgd_ascent_steps_total": sum(pgd.steps_at(s) for s in range(steps)),
        # process CPU time (one thread): what the step costs, unaffected by other processes on the machine
        "step_cpu_ms": 1e3 * c_step, "pgd_inner_loop_cpu_ms": 1e3 * c_pgd, "pgd_time_share": c_pgd / c_step,
        "step_ms": 1e3 * t_step, "pgd_inner_loop_ms": 1e3 * t_pgd, "pgd_time_share_wall": t_pgd / t_step,
        "train_loss_last10pct": statistics.fmean(tail),
        "train_time_s": sum(step_times),
    }
    row.update(_evaluate(m, eval_batches, z["k_eval"], pgd.step_size))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (default: 800, smoke 6)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/spd_pgd_schedule_cpu.json (smoke: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks._results import command_line, environment, write_result

    z = _sizes(args.smoke)
    if args.steps:
        z["steps"] = args.steps
    k, steps = z["k"], z["steps"]
    cfg = ResidMLPConfig(n_features=z["n_features"], d_embed=z["d_embed"], d_mlp=z["d_mlp"], n_layers=1)
    t0 = time.perf_counter()
    target = train_resid_mlp(cfg, z["target_steps"], 2048, 3e-3, 0.01, seed=0).cpu()
    eval_gen = torch.Generator().manual_seed(99)
    eval_batches = [sparse_feature_batch(z["batch"], z["n_features"], 0.01, (-1.0, 1.0), eval_gen)
                    for _ in range(z["eval_batches"])]
    variants = {
        "fixed_1": PGDConfig(n_steps=1, step_size=0.1),
        "fixed_k": PGDConfig(n_steps=k, step_size=0.1),
        "schedule": PGDConfig(n_steps=1, step_size=0.1, n_steps_schedule=[(steps // 2, k)]),
    }
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "workload": {"target": "resid_mlp", **{key: z[key] for key in ("n_features", "d_embed", "d_mlp", "C", "batch")},
                     "loss": "importance p=2 (1e-5) + stochastic + layerwise + pgd_recon (1.0), MSE, step_size 0.1",
                     "steps": steps, "k": k, "k_eval": z["k_eval"], "torch_threads": 1},
        "rows": [],
    }
    for seed in range(args.seeds):
        for name, pgd in variants.items():
            row = run_variant(name, pgd, target, z, seed, eval_batches)
            results["rows"].append(row)
            adv = row["recon_pgd{}".format(z["k_eval"])]
            print(f"seed {seed} {name:9s} {row['step_cpu_ms']:7.2f} CPU ms/step  pgd share {row['pgd_time_share']:.0%}  "
                  f"pgd{z['k_eval']} recon {adv:.4g}  stoch {row['recon_stochastic']:.4g}  "
                  f"faith {row['faithfulness']:.3g}  alive {row['alive_components']}", flush=True)
    keys = [key for key, v in results["rows"][0].items() if isinstance(v, (int, float)) and key != "seed"]
    results["mean_over_seeds"] = {
        name: {key: statistics.fmean(r[key] for r in results["rows"] if r["variant"] == name) for key in keys}
        for name in variants
    }
    ref = results["mean_over_seeds"]["fixed_k"]
    results["schedule_vs_fixed_k"] = {
        "step_cpu_time_ratio": results["mean_over_seeds"]["schedule"]["step_cpu_ms"] / ref["step_cpu_ms"],
        **{f"{key}_ratio": results["mean_over_seeds"]["schedule"][key] / ref[key] if ref[key] else None
           for key in (f"recon_pgd{z['k_eval']}", "recon_stochastic", "faithfulness", "alive_components")},
    }
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out = args.out or (None if args.smoke else str(ROOT / "benchmarks" / "results" / "spd_pgd_schedule_cpu.json"))
    if out:
        write_result(out, benchmark="spd_pgd_schedule", env=environment(on_gpu=False), command=command_line(argv),
                     baseline=None, results=results)
        print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
