"""Stochastic parameter decomposition (SPD) recipe.

    python recipes/spd.py --config recipes/configs/spd_tms_5-2.yaml
    python recipes/spd.py --config recipes/configs/spd_resid_mlp1.yaml --trainer.max_steps 2000
    python recipes/spd.py --config recipes/configs/spd_lm_demo.yaml

Toy targets (TMS, residual MLP) and the demo language model are trained by the recipe itself before
SPD starts, so no download is needed. ``metrics.json`` (for TMS: ``mmcs``, ``ml2r``, ``ci_l0``,
identity-CI errors; for language models: CE / KL under CI, stochastic, unmasked and zero masks) is
written into the run directory. See ``docs/spd.md``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_opt.cli import RecipeCLI, device_name, run_dir, write_metrics  # noqa: E402
from lightning_opt.modules.spd import SPDModule  # noqa: E402


def main(args: list[str] | None = None) -> dict:
    cli = RecipeCLI(SPDModule, args=args, run=False, save_config_kwargs={"overwrite": True})
    trainer, model = cli.trainer, cli.model
    t0 = time.perf_counter()
    trainer.fit(model, ckpt_path=cli.config.get("ckpt_path"))
    metrics = {
        **model.final_metrics,
        "steps": trainer.global_step,
        "train_time_s": time.perf_counter() - t0,
        "device": device_name(trainer),
        "seed": model.train_cfg.seed,
        "target_seed": getattr(model.target_cfg, "seed", None),
        "versions": {"torch": torch.__version__, "lightning": L.__version__},
    }
    path = run_dir(trainer) / cli.config.get("metrics_file", "metrics.json")
    write_metrics(path, metrics)
    if trainer.is_global_zero:
        keys = [k for k in ("mmcs", "ml2r", "ci_l0", "recon/stochastic", "ce/ci", "kl/ci") if k in metrics]
        print("  ".join(f"{k} {metrics[k]:.4f}" for k in keys))
        print(f"metrics: {path}")
    return metrics


if __name__ == "__main__":
    main()
