"""Dead-feature resampling and AuxK against neither: CLTModule on a tiny GPT's MLP activations, CPU.

    python -m benchmarks.clt_resampling          # -> benchmarks/results/clt_resampling_cpu.json
                                                 #    and docs/benchmarks/clt_resampling.png
    python -m benchmarks.clt_resampling --smoke  # tiny sizes, seconds: checks that every variant runs
    python -m benchmarks.clt_resampling --variants none,resample --resample_weighting uniform \
        --out benchmarks/results/clt_resampling_uniform_cpu.json --plot /tmp/p.png   # another weighting

Activations: the MLP inputs and outputs of every layer of the repository's demo target
(:func:`lightning_opt.data.activations.train_demo_target`: a 4-layer, 64-wide byte-level GPT trained on the
built-in offline corpus, cached after its first training), through :class:`CLTDataModule`. Training batches
come from an activation cache of the corpus's *train* shard (written once, shared by every run); the FVU is
measured on the activations of the corpus's *val* shard, text the CLT never trains on (``val_tokens`` tokens,
always the same ones).

Variants (every one the same CLT, optimizer, schedule, losses, initialisation and batch order per seed; only
these arguments of :class:`CLTModule` differ):

* ``none``: ``aux_coef=0``, ``resample_dead_every=None``;
* ``auxk``: AuxK on (``aux_coef``, ``aux_k``);
* ``resample``: ``resample_dead_every`` set, AuxK off;
* ``both``: AuxK and resampling.

Each runs through a real Lightning ``Trainer`` (CPU, one process) for ``steps`` optimizer steps, validating
every ``eval_every`` steps (the curves). Reported per run:

* final held-out FVU (``val/fvu``), and the same pooled FVU of the windows' first tokens and of the other
  positions apart (a window's first token is an outlier of this target: a large share of the held-out variance);
* the dead fraction by the module's own definition (features that did not fire in the last ``dead_tokens``
  training tokens, ``val/dead_fraction``) and the fraction of features that fire on no held-out token (a
  second measure, which a resampling cannot reset); the last resampling is at least ``dead_tokens`` training
  tokens before the end (checked), so a revived feature that has not fired since counts as dead at the end;
* held-out L0; per resampling, the features re-initialised and the distinct encoder columns they got;
* step cost: process CPU time per training step (one thread; the clock brackets ``on_train_batch_start`` ..
  ``on_train_batch_end``, so the resampling inside ``optimizer_step`` is counted and validation is not), its
  inverse as steps/s, the wall time, the CPU time of the resampling steps alone, and their extra time over a
  plain step of the same run as a share of the run's step time (``resample_extra_cpu_share``: the
  resampling's cost without the drift between runs on a shared machine).

Per variant: mean, min and max over seeds, the steps/s ratio and the FVU difference to ``none`` of the same
seed. The learning rate is 5e-4 (``--lr``): the demo recipe's 2e-3 spikes the loss on this data's outlier
tokens.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_opt.data.activations import CLTDataModule, train_demo_target
from lightning_opt.models.clt import CLTConfig
from lightning_opt.modules.clt import RESAMPLE_WEIGHTINGS, CLTModule
from lightning_opt.optim.factory import OptimConfig
from lightning_opt.optim.schedules import ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]

NAME = "clt_resampling"
VARIANTS = ("none", "auxk", "resample", "both")
PLOT = ROOT / "docs" / "benchmarks" / "clt_resampling.png"


def sizes(smoke: bool) -> dict[str, Any]:
    """Workload sizes. ``dead_tokens`` is a window of ``dead_window_steps`` steps."""
    if smoke:
        return {"n_features": 64, "k": 8, "tokens_per_batch": 256, "steps": 20, "eval_every": 10,
                "dead_window_steps": 4, "resample_every": 8, "val_tokens": 512, "aux_k": 8, "aux_max_dead": 32,
                "target_steps": 30, "lr": 3e-3, "train_tokens": 256 * 20}
    return {"n_features": 512, "k": 16, "tokens_per_batch": 512, "steps": 600, "eval_every": 50,
            "dead_window_steps": 40, "resample_every": 125, "val_tokens": 16384, "aux_k": 16, "aux_max_dead": 512,
            "target_steps": 300, "lr": 5e-4, "train_tokens": None}


def variant_kwargs(name: str, z: dict[str, Any], aux_coef: float) -> dict[str, Any]:
    auxk = name in ("auxk", "both")
    resample = name in ("resample", "both")
    return {"aux_coef": aux_coef if auxk else 0.0, "aux_k": z["aux_k"], "aux_max_dead": z["aux_max_dead"],
            "resample_dead_every": z["resample_every"] if resample else None}


def resample_steps(z: dict[str, Any]) -> list[int]:
    """The 1-based optimizer steps after whose update a resampling runs (``(global_step + 1) % every == 0``)."""
    return [s for s in range(1, z["steps"] + 1) if s % z["resample_every"] == 0]


class _Probe(pl.Callback):
    """Per-step CPU and wall time of training batches, and the held-out metrics of every validation."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.curve: list[dict[str, float]] = []
        self.val_s = 0.0
        self.draws: list[dict[str, int]] = []  # per resampling: features re-initialised, distinct encoder columns
        self._t = (0.0, 0.0)
        self._v = 0.0
        self._resampled = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t = (time.process_time(), time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        c0, w0 = self._t
        self.cpu.append(time.process_time() - c0)
        self.wall.append(time.perf_counter() - w0)
        if pl_module.resampled_total != self._resampled:
            self.draws.append({"step": trainer.global_step, **resampled_draws(pl_module)})
            self._resampled = pl_module.resampled_total

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._v = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # after the module's on_validation_epoch_end has logged (callbacks' epoch-end hooks run before it)
        self.val_s += time.perf_counter() - self._v
        m = trainer.callback_metrics
        if "val/fvu" in m and not trainer.sanity_checking:
            self.curve.append({"step": trainer.global_step, "val_fvu": float(m["val/fvu"]),
                               "dead_fraction": float(m["val/dead_fraction"]), "val_l0": float(m["val/l0"])})


@torch.no_grad()
def resampled_draws(module: CLTModule) -> dict[str, int]:
    """The last resampling: features re-initialised, and how many distinct encoder columns they got (features
    that drew the same token of the same layer get the same column)."""
    mask = module.last_resampled
    distinct = 0
    for layer in range(mask.shape[0]):
        cols = module.model.W_enc[layer][:, mask[layer]]  # [d, D]
        if cols.shape[1]:
            distinct += int(torch.unique(cols.T, dim=0).shape[0])
    return {"features": int(mask.sum()), "distinct_columns": distinct}


@torch.no_grad()
def heldout_eval(module: CLTModule, dm: CLTDataModule) -> dict[str, float]:
    """On the held-out activations: the fraction of the CLT's features (all layers) that fire on no token, and
    the pooled FVU (the module's definition) of the windows' first tokens and of the other positions apart."""
    cfg = module.clt_config
    fired = torch.zeros(cfg.n_layers * cfg.n_features, dtype=torch.bool)
    parts: dict[str, list[torch.Tensor]] = {"first": [], "rest": []}
    module.eval()
    for batch in dm.val_dataloader():
        x, y = batch[0], batch[1].float()
        n = x.shape[0]
        out = module.model(x)
        if out.indices is not None:
            flat = torch.div(out.indices, n * cfg.n_features, rounding_mode="floor") * cfg.n_features \
                + out.indices % cfg.n_features
            fired[flat[out.values > 0]] = True
        else:
            fired |= (out.acts > 0).any(dim=1).flatten()
        first = torch.arange(n) % dm.seq_len == 0  # batches hold whole windows, in order
        recon = module.model.denormalize(out.recon).float()
        for key, rows in (("first", first), ("rest", ~first)):
            parts[key].append(torch.stack([recon[rows], y[rows]]))
    res = {"heldout_never_fired_fraction": 1.0 - fired.float().mean().item()}
    for key, name in (("first", "heldout_fvu_first_position"), ("rest", "heldout_fvu_other_positions")):
        r, y = torch.cat(parts[key], dim=1).double()
        res[name] = float((r - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    return res


def run(name: str, seed: int, z: dict[str, Any], dm: CLTDataModule, base: dict[str, Any],
        aux_coef: float) -> dict[str, Any]:
    """Train variant ``name`` with ``seed`` and measure it."""
    knobs = variant_kwargs(name, z, aux_coef)
    pl.seed_everything(seed, verbose=False)
    module = CLTModule(**base, **knobs, resample_seed=seed)
    probe = _Probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=z["steps"], val_check_interval=z["eval_every"],
        check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=z["eval_every"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )
    trainer.fit(module, datamodule=dm)
    if not probe.curve or probe.curve[-1]["step"] != trainer.global_step:
        trainer.validate(module, datamodule=dm, verbose=False)  # the probe records it
    final = probe.curve[-1]
    skip = min(5, len(probe.cpu) // 4)  # first steps: allocator warmup
    rs = [s - 1 for s in resample_steps(z)] if module.resample_every else []
    plain = [i for i in range(skip, len(probe.cpu)) if i not in rs]
    cpu_ms = 1e3 * statistics.fmean(probe.cpu[skip:])
    plain_mean = statistics.fmean(probe.cpu[i] for i in plain)
    row = {
        "variant": name, "seed": seed, **knobs,
        "steps": trainer.global_step,
        "final_val_fvu": final["val_fvu"],
        "final_dead_fraction": final["dead_fraction"],
        **heldout_eval(module, dm),
        "final_val_l0": final["val_l0"],
        "resampled_total": module.resampled_total,
        "step_cpu_ms": cpu_ms,
        "steps_per_s_cpu": 1e3 / cpu_ms,
        "step_wall_ms": 1e3 * statistics.fmean(probe.wall[skip:]),
        "plain_step_cpu_ms": 1e3 * plain_mean,
        "resample_step_cpu_ms": 1e3 * statistics.fmean(probe.cpu[i] for i in rs) if rs else None,
        # the resampling steps' CPU time above a plain step of the same run, as a share of the run's step time:
        # the resampling's cost measured within one run, free of the drift between runs on a shared machine
        "resample_extra_cpu_share": sum(probe.cpu[i] - plain_mean for i in rs) / sum(probe.cpu[skip:]) if rs else 0.0,
        "train_cpu_s": sum(probe.cpu),
        "validation_wall_s": probe.val_s,
        "resamplings": probe.draws,
        "curve": probe.curve,
    }
    return row


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict[str, Any]], seeds: list[int], variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    keys = ("final_val_fvu", "final_dead_fraction", "heldout_never_fired_fraction", "heldout_fvu_first_position",
            "heldout_fvu_other_positions", "final_val_l0", "resampled_total", "resample_extra_cpu_share", "step_cpu_ms", "steps_per_s_cpu", "step_wall_ms")
    by = {(r["variant"], r["seed"]): r for r in rows}
    out: dict[str, Any] = {}
    for name in variants:
        mine = [by[(name, s)] for s in seeds]
        entry = {k: spread([float(r[k]) for r in mine]) for k in keys}
        entry["steps_per_s_ratio_to_none"] = spread(
            [by[(name, s)]["steps_per_s_cpu"] / by[("none", s)]["steps_per_s_cpu"] for s in seeds])
        entry["val_fvu_minus_none"] = spread(
            [by[(name, s)]["final_val_fvu"] - by[("none", s)]["final_val_fvu"] for s in seeds])
        out[name] = entry
    return out


def plot(rows: list[dict[str, Any]], z: dict[str, Any], path: Path) -> str | None:
    """FVU (held-out) and dead fraction over steps, one colour per variant, one line per seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {"none": "tab:gray", "auxk": "tab:blue", "resample": "tab:orange", "both": "tab:green"}
    styles = ["-", "--", ":", "-."]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = sorted({r["seed"] for r in rows})
    for r in rows:
        steps = [p["step"] for p in r["curve"]]
        ls = styles[seeds.index(r["seed"]) % len(styles)]
        label = f"{r['variant']} (seed {r['seed']})"
        ax1.plot(steps, [p["val_fvu"] for p in r["curve"]], ls, color=colors[r["variant"]], label=label, lw=1.3)
        ax2.plot(steps, [p["dead_fraction"] for p in r["curve"]], ls, color=colors[r["variant"]], label=label, lw=1.3)
    for ax in (ax1, ax2):
        for s in resample_steps(z):
            ax.axvline(s, color="tab:orange", alpha=0.35, lw=1, ls=":")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("held-out FVU")
    ax1.set_yscale("log")
    ax2.set_ylabel(f"dead fraction (no fire in {z['dead_window_steps'] * z['tokens_per_batch']} tokens)")
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle("CLT on a 4 x 64 GPT's MLPs: AuxK and dead-feature resampling (dotted: resampling steps)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 600, smoke 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW learning rate (default 5e-4, smoke 3e-3; the demo recipe's 2e-3 spikes the loss on "
                         "this data's outlier tokens)")
    ap.add_argument("--aux_coef", type=float, default=0.03, help="AuxK weight of the auxk / both variants")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (must include none, the baseline)")
    ap.add_argument("--resample_weighting", default=None, choices=RESAMPLE_WEIGHTINGS,
                    help="CLTModule resample_weighting of the resample / both variants (default: the module's)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/clt_resampling_cpu.json (smoke: none)")
    ap.add_argument("--plot", default=None, help="default: docs/benchmarks/clt_resampling.png (smoke: none)")
    args = ap.parse_args(argv)
    threads, log = torch.get_num_threads(), logging.getLogger("lightning.pytorch")
    level = log.level
    torch.set_num_threads(args.threads)
    log.setLevel(logging.ERROR)
    try:
        return _main(args, argv)
    finally:  # called from a test: leave the process as it was
        torch.set_num_threads(threads)
        log.setLevel(level)


def _main(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks._results import command_line, environment, write_result

    t0 = time.perf_counter()
    z = sizes(args.smoke)
    if args.steps:
        z["steps"] = args.steps
    if args.lr:
        z["lr"] = args.lr
    dead_tokens = z["dead_window_steps"] * z["tokens_per_batch"]
    rsteps = resample_steps(z)
    if rsteps and z["steps"] - rsteps[-1] < z["dead_window_steps"]:
        raise ValueError(f"the last resampling (step {rsteps[-1]}) must precede the end ({z['steps']}) by at least "
                         f"the dead window ({z['dead_window_steps']} steps); change --steps")
    target = train_demo_target(steps=z["target_steps"])
    n_layers, d_model = len(target.blocks), target.config.n_embd
    seeds = list(range(args.seeds))
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if "none" not in variants or set(args.variants.split(",")) - set(VARIANTS):
        raise ValueError(f"--variants {args.variants!r}: a subset of {VARIANTS} that includes none")
    base: dict[str, Any] = {
        "clt": CLTConfig(n_layers=n_layers, d_model=d_model, n_features=z["n_features"],
                         activation="batchtopk_global", k=z["k"], normalization="mean_std"),
        # the demo recipe's optimizer, schedule and loss weights (lightning_opt/recipes/configs/clt_demo.yaml),
        # except the learning rate (--lr)
        "optim": OptimConfig(lr=z["lr"], betas=(0.9, 0.999), weight_decay=0.0),
        "schedule": ScheduleConfig(name="wsd", warmup_steps=10, decay_fraction=0.3, min_ratio=0.0),
        "sparsity_coef": 1e-4, "preact_coef": 1e-6, "dead_tokens": dead_tokens, "decode": "auto",
        "eval_replacement": False,
        **({"resample_weighting": args.resample_weighting} if args.resample_weighting else {}),
    }
    results: dict[str, Any] = {
        "smoke": args.smoke,
        "workload": {
            "target": f"demo GPT (train_demo_target(steps={z['target_steps']})): {n_layers} layers x {d_model}, "
                      "byte-level, built-in corpus",
            "train_activations": "CLTDataModule activation cache of the built-in corpus's train shard (shuffled)"
                                 + (f", its first {z['train_tokens']} tokens" if z["train_tokens"] else ""),
            "heldout_activations": f"the first {z['val_tokens']} tokens of the built-in corpus's val shard "
                                   "(never trained on)",
            "clt": {"n_features_per_layer": z["n_features"], "activation": "batchtopk_global", "k": z["k"],
                    "normalization": "mean_std", "decoder_tying": "untied"},
            "optim": f"AdamW lr {z['lr']:g}, betas (0.9, 0.999), no weight decay; wsd schedule (warmup 10, decay 30%)",
            "losses": "MSE + tanh sparsity 1e-4 (ramped) + pre-activation 1e-6; AuxK variants: aux_coef "
                      f"{args.aux_coef}, aux_k {z['aux_k']}, aux_max_dead {z['aux_max_dead']}",
            "dead_tokens": dead_tokens, "resample_dead_every": z["resample_every"], "resample_steps": rsteps,
            "resample_encoder_scale": "module default (1.0 for batchtopk_global)",
            "resample_weighting": f"{base.get('resample_weighting', 'loss')}: distinct tokens per layer",
            "variants": list(variants),
            **{key: z[key] for key in ("tokens_per_batch", "steps", "eval_every", "val_tokens")},
            "torch_threads": args.threads,
        },
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="clt_resampling_") as cache:
        dm = CLTDataModule(target=target, train_files="builtin", val_files="builtin", seq_len=64,
                           tokens_per_batch=z["tokens_per_batch"], train_tokens=z["train_tokens"],
                           val_tokens=z["val_tokens"], cache_dir=cache,
                           dtype="float32", shuffle=True)
        dm.setup("fit")  # writes the activation cache once; every run reads it
        for seed in seeds:
            for name in variants:
                row = run(name, seed, z, dm, base, args.aux_coef)
                results["rows"].append(row)
                print(f"seed {seed} {name:9s} val FVU {row['final_val_fvu']:.4f}  dead {row['final_dead_fraction']:.3f}"
                      f"  never fired (held-out) {row['heldout_never_fired_fraction']:.3f}  resampled "
                      f"{row['resampled_total']:5d}  {row['steps_per_s_cpu']:6.1f} steps/s (CPU)", flush=True)
    results["summary"] = summarize(results["rows"], seeds, variants)
    out = args.out or (None if args.smoke else str(ROOT / "benchmarks" / "results" / f"{NAME}_cpu.json"))
    plot_path = args.plot or (None if args.smoke else str(PLOT))
    results["plot"] = plot(results["rows"], z, Path(plot_path)) if plot_path else None
    if results["plot"]:
        results["plot"] = str(Path(results["plot"]).resolve().relative_to(ROOT)) \
            if Path(results["plot"]).resolve().is_relative_to(ROOT) else results["plot"]
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if out:
        write_result(out, benchmark=NAME, env=environment(on_gpu=False), command=command_line(argv),
                     baseline=None, results=results)
        print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
