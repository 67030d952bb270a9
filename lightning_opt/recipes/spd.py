"""Stochastic parameter decomposition (SPD) recipe.

    lightning-opt-spd --config spd_tms_5-2
    lightning-opt-spd --config spd_resid_mlp1 --trainer.max_steps 2000
    lightning-opt-spd --config spd_lm_demo
    lightning-opt-spd --config spd_gpt2_layer \
        --data.init_args.train_files '/data/fineweb/fineweb_train_*.bin' \
        --data.init_args.val_files '/data/fineweb/fineweb_val_*.bin'

Toy targets (TMS, residual MLP) and the demo language model are trained by the recipe itself before
SPD starts, so no download is needed. A language model from a recipe checkpoint or Hugging Face weights
(``model.target.checkpoint`` / ``model.target.pretrained``) reads token batches from the ``data:`` section
(``class_path: lightning_opt.data.TokenShardDataModule``: shards or ``builtin``), which also gives the
``val/`` metrics and the final metrics' held-out batches. ``metrics.json`` (for TMS: ``mmcs``, ``ml2r``, ``ci_l0``,
identity-CI errors; for language models: CE / KL under CI, stochastic, unmasked and zero masks) is
written into the run directory, and for toy targets ``components.png`` (components vs features);
``--plot_path FILE`` writes a second copy of the plot to FILE; ``--ckpt_path FILE`` resumes a run (add a
checkpoint callback, e.g. ``--trainer.enable_checkpointing true --trainer.callbacks+=ModelCheckpoint``).
See ``docs/spd.md``.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import matplotlib
import torch

from lightning_opt._errors import run_console
from lightning_opt.cli import RecipeCLI, build_recipe_cli, run_dir, run_recipe, write_metrics
from lightning_opt.models import spd as S
from lightning_opt.models.toy import ResidMLPConfig, TMSConfig
from lightning_opt.modules.spd import SPDModule


def plot_decomposition(model: SPDModule, path: Path) -> Path | None:
    """Components vs features for toy targets: single-feature causal importances of each layer
    (rows: features, columns: subcomponents, best-matched order), and for TMS the target's feature
    directions next to the subcomponents of ``linear1``."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the file-only backend

    cfg = getattr(model.spd.target, "config", None)
    if not isinstance(cfg, (TMSConfig, ResidMLPConfig)):
        return None
    spd = model.spd
    with torch.no_grad():
        device = next(spd.parameters()).device
        _, inputs = spd.target_forward(torch.eye(cfg.n_features, device=device) * 0.75)
        ci = spd.causal_importances(inputs).lower
    tms = isinstance(cfg, TMSConfig) and "linear1" in spd.layers and cfg.n_hidden == 2
    # more than 2 hidden dims cannot be drawn as arrows: show cosines of features vs subcomponents instead
    tms_cos = isinstance(cfg, TMSConfig) and "linear1" in spd.layers and not tms
    n_panels = len(ci) + (2 if tms else 0) + (1 if tms_cos else 0)
    fig, axes = plt.subplots(1, n_panels, figsize=(3.2 * n_panels, 3.2), squeeze=False)
    axes = list(axes[0])
    if tms:
        layer = spd.layers["linear1"]
        W = layer.weight.detach().cpu()  # [n_features, 2]
        sub = (layer.V.detach().cpu().unsqueeze(-1) * layer.U.detach().cpu().unsqueeze(0))  # [n, C, 2]
        norms = sub.norm(dim=-1).sum(0)
        keep = [int(c) for c in norms.argsort(descending=True)[: cfg.n_features]]
        colors = plt.cm.tab10.colors
        for ax, title in zip(axes[:2], ("target W columns", f"top {len(keep)} subcomponents")):
            ax.set_title(title, fontsize=9)
            ax.set_aspect("equal")
            ax.set_xlim(-1.6, 1.6)
            ax.set_ylim(-1.6, 1.6)
        for j in range(cfg.n_features):
            axes[0].arrow(0, 0, float(W[j, 0]), float(W[j, 1]), color=colors[j % 10], width=0.02)
        for c in keep:
            for j in range(cfg.n_features):
                v = sub[j, c]
                if v.norm() > 0.05:
                    axes[1].arrow(0, 0, float(v[0]), float(v[1]), color=colors[j % 10], width=0.02)
        axes = axes[2:]
    if tms_cos:
        layer = spd.layers["linear1"]
        W = layer.weight.detach().float().cpu()  # [n_features, n_hidden]
        sub = layer.V.detach().float().cpu().unsqueeze(-1) * layer.U.detach().float().cpu().unsqueeze(0)
        cos = (sub * W.unsqueeze(1)).sum(-1) / (sub.norm(dim=-1) * W.norm(dim=-1, keepdim=True)).clamp_min(1e-12)
        im = axes[0].imshow(cos[:, S.greedy_identity_permutation(cos)][:, : cfg.n_features + 5], vmin=-1, vmax=1,
                            cmap="RdBu_r", aspect="auto")
        axes[0].set_title("cos(target W_j, linear1 subcomponent)", fontsize=9)
        axes[0].set_xlabel("subcomponent (matched order)")
        axes[0].set_ylabel("feature j")
        fig.colorbar(im, ax=axes[0], fraction=0.046)
        axes = axes[1:]
    for ax, (name, g) in zip(axes, ci.items()):
        g = g.detach().float().cpu()
        g = g[:, S.greedy_identity_permutation(g)][:, : max(cfg.n_features, 1) + 5]
        im = ax.imshow(g, vmin=0, vmax=1, cmap="Blues", aspect="auto")
        ax.set_title(f"CI {name}", fontsize=9)
        ax.set_xlabel("subcomponent (matched order)")
        ax.set_ylabel("input feature")
    fig.colorbar(im, ax=axes[-1], fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class SPDRecipeCLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--plot_path", type=str | None, default=None,
                            help="also write the components plot (toy targets) to this file")


def main(args: list[str] | None = None) -> dict:
    cli, summary = build_recipe_cli(SPDModule, None, args, cli_class=SPDRecipeCLI)
    model, data = cli.model, cli.datamodule  # a `data:` section (token shards for a language model), or none
    block = getattr(getattr(model.spd.target, "config", None), "block_size", None)
    seq_len = getattr(data, "seq_len", None)
    if block is not None and seq_len is not None and seq_len > block:
        raise ValueError(f"data seq_len={seq_len} exceeds the target's context block_size={block}; lower the "
                         "data's seq_len")
    with warnings.catch_warnings():
        # the frozen target model stays in eval mode by design (no dropout or norm statistics to update)
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
        if data is None:  # toy targets bring their training batches and have no validation set by design
            warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
        metrics = run_recipe(cli, summary, recipe="spd", seed=model.train_cfg.seed,
                             target_seed=getattr(model.target_cfg, "seed", None))
    trainer = cli.trainer
    metrics.update(model.final_metrics)
    path = run_dir(trainer) / cli.config.get("metrics_file", "metrics.json")
    write_metrics(path, metrics)
    if trainer.is_global_zero:
        plot = plot_decomposition(model, run_dir(trainer) / "components.png")
        plot_copy = cli.config.get("plot_path")
        if plot is not None and plot_copy:
            # a second copy at a chosen path (the run dir can be too deep for a GPU machine's file return)
            Path(plot_copy).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plot, plot_copy)
        keys = [k for k in ("mmcs", "ml2r", "ci_l0", "recon/stochastic", "ce/ci", "kl/ci") if k in metrics]
        print("final " + "  ".join(f"{k} {metrics[k]:.4f}" for k in keys))
    return metrics


def cli() -> None:
    """The ``lightning-opt-spd`` console script: ``main`` on the command line. A user's mistake (a wrong flag or value, a
    missing file) prints one ``error: ...`` line and exits with status 2 (``LIGHTNING_OPT_TRACEBACK=1`` shows its
    traceback); a bug raises with its traceback."""
    run_console(main)


if __name__ == "__main__":
    cli()
