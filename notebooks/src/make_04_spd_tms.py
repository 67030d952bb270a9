"""Generates notebooks/04_spd_tms.ipynb: `python notebooks/src/make_04_spd_tms.py`."""

from __future__ import annotations

from _nb import write_notebook

CELLS = [
    ("md", """
    # 04 · Stochastic parameter decomposition of TMS 5-2

    A toy model of superposition (TMS, Elhage et al. 2022) squeezes 5 sparse features through 2
    hidden dimensions: `x_hat = ReLU(W^T W x + b)`. Stochastic parameter decomposition (SPD, Bushnaq et
    al. 2025) splits each weight matrix into rank-one *subcomponents* and learns which of them each
    input needs. On TMS 5-2 the right answer is known: one subcomponent per feature, pointing along that
    feature's direction. This notebook trains the target, decomposes it with `SPDModule`, draws the
    subcomponents next to the target's feature directions (as in the SPD paper's figure) and prints
    the paper's two numbers:

    * **MMCS**, mean max cosine similarity: for each feature direction, the best-aligned subcomponent's
      cosine (1 = perfectly aligned);
    * **ML2R**, mean L2 ratio: that subcomponent's norm over the feature direction's norm (1 = same size).

    Settings are `lightning_opt/recipes/configs/spd_tms_5-2.yaml`'s (goodfire's TMS 5-2 config). With `NB_STEPS`
    unset SPD runs its full 10,000 steps (several minutes on one CPU core); the CI run uses a handful
    of steps, so its numbers are those of a decomposition that has barely started. Docs: `docs/spd.md`.
    """),
    ("code", """
    import csv
    import logging
    import os
    import tempfile
    import warnings
    from pathlib import Path

    import lightning as L
    import matplotlib.pyplot as plt
    import torch

    from lightning_opt.models import spd as S
    from lightning_opt.models.spd import SPDConfig
    from lightning_opt.modules.spd import SPDLossConfig, SPDModule, SPDTargetConfig, SPDTrainConfig

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger|litmodels).*")

    FULL = 10_000  # the paper's / recipe's SPD steps and target training steps
    STEPS = int(os.environ.get("NB_STEPS", str(FULL)))
    TARGET_STEPS = min(FULL, 200 * STEPS)
    WORK = tempfile.mkdtemp(prefix="nb04_")
    print(f"SPD steps: {STEPS} | target training steps: {TARGET_STEPS}")
    """),
    ("md", """
    ## 1 · The target and the decomposition's settings

    `SPDTargetConfig(kind="tms")` trains the target (seeded AdamW, feature probability 0.05, tied
    weights, then frozen). Both `linear1` (`W`, 5 → 2) and `linear2` (`W^T`, 2 → 5) get `C = 20`
    subcomponents; a small MLP per subcomponent predicts its causal importance from its activation.
    """),
    ("code", """
    target = SPDTargetConfig(kind="tms", model={"n_features": 5, "n_hidden": 2}, train_steps=TARGET_STEPS,
                             train_batch_size=1024, train_lr=5e-3, feature_probability=0.05, seed=0)
    spd = SPDConfig(components=[{"pattern": "linear1", "C": 20}, {"pattern": "linear2", "C": 20}],
                    ci_fn="mlp", ci_hidden=[16], sigmoid="leaky_hard", use_delta=True)
    loss = SPDLossConfig(importance_minimality=3e-3, p=1.0, stochastic_recon=1.0,
                         stochastic_recon_layerwise=1.0, output="mse")
    train = SPDTrainConfig(batch_size=4096,  # AdamW at lr 1e-3, cosine to 0: the module's default optim and schedule
                           faithfulness_warmup_steps=200, faithfulness_warmup_lr=0.01,
                           faithfulness_warmup_weight_decay=0.1, identity_patterns=["linear1", "linear2"],
                           eval_batches=4, seed=0)
    L.seed_everything(0, verbose=False)
    module = SPDModule(target, spd, loss, train)  # trains the TMS target here
    # linear1's frozen target weight, stored [d_in, d_out] = [5 features, 2 hidden]: row j is where
    # feature j is written (the columns of W)
    W = module.spd.layers["linear1"].weight

    colors = plt.cm.tab10.colors
    fig, ax = plt.subplots(figsize=(3.2, 3.2))
    for j, (a, b) in enumerate(W.tolist()):
        ax.arrow(0, 0, a, b, width=0.02, color=colors[j], length_includes_head=True)
        ax.annotate(f"f{j}", (a * 1.12, b * 1.12), ha="center", va="center", color=colors[j])
    ax.set(title="target: feature directions (W columns)", xlim=(-1.6, 1.6), ylim=(-1.6, 1.6), aspect="equal")
    plt.show()
    print("feature direction norms:", [round(v, 3) for v in W.norm(dim=1).tolist()])
    """),
    ("md", """
    ## 2 · Decompose

    `SPDModule` brings its own data for toy targets (sparse feature batches), first runs a short
    faithfulness warm-up so that the subcomponents sum to the target weights, then trains with the
    stochastic reconstruction losses and the importance-minimality penalty.
    """),
    ("code", """
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, log_every_n_steps=max(STEPS // 100, 1),
        logger=L.pytorch.loggers.CSVLogger(WORK, name="spd"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    m = module.final_metrics
    print(f"MMCS = {m['mmcs']:.4f}   ML2R = {m['ml2r']:.4f}   (after {trainer.global_step} SPD steps)")
    for k in sorted(m):
        if k.startswith(("ci_l0", "identity_ci_error", "recon/")):
            print(f"  {k:30s} {m[k]:.4f}")
    converged = m["mmcs"] > 0.99 and abs(m["ml2r"] - 1) < 0.1
    print("converged (MMCS > 0.99, |ML2R - 1| < 0.1):", converged,
          "" if converged or STEPS >= FULL else f"- expected after {STEPS} steps; run with NB_STEPS unset for {FULL}")
    if STEPS >= FULL:
        assert converged, "the full run should reproduce the paper's TMS 5-2 result"
    """),
    ("md", """
    ## 3 · Subcomponents against the feature directions

    Each panel below is one subcomponent `c` of `linear1` (the five with the largest total norm). A
    subcomponent is a rank-one matrix `V[:, c] U[c, :]`; its row `j` is what it writes to the hidden
    space when feature `j` is on, drawn as an arrow in the colour of feature `j`. The target's feature
    directions are the grey arrows. A converged decomposition has one arrow per panel, on top of one
    grey arrow: each subcomponent implements exactly one feature.
    """),
    ("code", """
    layer = module.spd.layers["linear1"]
    with torch.no_grad():
        sub = layer.V.unsqueeze(-1) * layer.U.unsqueeze(0)  # [5 features, C, 2]
    norms = sub.norm(dim=-1)  # [5, C]
    top = norms.sum(0).argsort(descending=True)[:5]
    top = sorted(top.tolist(), key=lambda c: int(norms[:, c].argmax()))  # order by the feature they carry

    fig, axes = plt.subplots(1, 6, figsize=(16, 2.9))
    for j, (a, b) in enumerate(W.tolist()):
        axes[0].arrow(0, 0, a, b, width=0.03, color=colors[j], length_includes_head=True)
    axes[0].set_title("target W", fontsize=10)
    for ax, c in zip(axes[1:], top):
        for (a, b) in W.tolist():
            ax.arrow(0, 0, a, b, width=0.03, color="0.85", length_includes_head=True)
        for j in range(W.shape[0]):
            a, b = sub[j, c].tolist()
            if (a * a + b * b) ** 0.5 > 0.02:
                ax.arrow(0, 0, a, b, width=0.03, color=colors[j], length_includes_head=True)
        ax.set_title(f"subcomponent {c}", fontsize=10)
    for ax in axes:
        ax.set(xlim=(-1.5, 1.5), ylim=(-1.5, 1.5), aspect="equal", xticks=[], yticks=[])
    plt.tight_layout()
    plt.show()
    """),
    ("md", """
    ## 4 · Causal importances of single features

    Inputs with exactly one feature on (value 0.75): which subcomponents does each need? Columns are put
    in the best-matching order; a converged decomposition shows an identity in both layers
    (`identity_ci_error` counts the entries that are off it).
    """),
    ("code", """
    with torch.no_grad():
        _, inputs = module.spd.target_forward(torch.eye(5) * 0.75)
        ci = module.spd.causal_importances(inputs).lower
    fig, axes = plt.subplots(1, len(ci), figsize=(5 * len(ci), 2.6))
    for ax, (name, g) in zip(axes, ci.items()):
        g = g[:, S.greedy_identity_permutation(g)][:, :10]
        im = ax.imshow(g, vmin=0, vmax=1, cmap="Blues")
        ax.set(title=f"causal importance, {name}", xlabel="subcomponent (matched order, first 10)",
               ylabel="active feature")
    fig.colorbar(im, ax=axes[-1], fraction=0.046)
    plt.show()
    """),
    ("md", "## 5 · Training curves (from the CSV logs)"),
    ("code", """
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    keys = [k for k in ("train/loss", "train/stochastic_recon", "train/importance_minimality", "train/ci_l0")
            if any(r.get(k) for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, k in zip(axes, keys):
        pts = [(int(r["step"]), float(r[k])) for r in rows if r.get(k)]
        ax.plot(*zip(*pts))
        ax.set(title=k, xlabel="step", yscale="log" if k != "train/ci_l0" else "linear")
    plt.tight_layout()
    plt.show()
    """),
]

if __name__ == "__main__":
    write_notebook("04_spd_tms", CELLS)
