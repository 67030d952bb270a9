"""Generates notebooks/03_clt.ipynb: `python notebooks/src/make_03_clt.py`."""

from __future__ import annotations

from _nb import write_notebook

CELLS = [
    ("md", """
    # 03 · A cross-layer transcoder on a tiny GPT

    A cross-layer transcoder (CLT) reads the MLP input of every layer of a language model and
    reconstructs every layer's MLP output from sparse features; a feature of layer `l` writes to
    layers `l, l+1, ...` (Anthropic, *Circuit Tracing*, 2025). This notebook

    1. trains a tiny byte-level GPT on the built-in offline corpus (Python's own docs),
    2. trains a CLT on its MLP activations with `CLTModule` and `CLTDataModule`,
    3. plots the fraction of variance unexplained (FVU) and L0 per layer, the dead features, and the
       contexts that activate a few features most.

    Runs on CPU; `NB_STEPS` sets the CLT's training steps (the target GPT trains for `5 * NB_STEPS`
    steps, at most 300). Docs: `docs/clt.md`; the same run as a recipe:
    `lightning-opt-clt --config clt_demo`.
    """),
    ("code", """
    import logging
    import os
    import tempfile
    import warnings

    import lightning as L
    import matplotlib.pyplot as plt
    import torch

    from lightning_opt.data import ByteTokenizer, default_corpus_shards, read_shard
    from lightning_opt.data.activations import CLTDataModule, MLPActivationCapture, token_windows, train_demo_target
    from lightning_opt.models.clt import CLTConfig
    from lightning_opt.modules.clt import CLTModule
    from lightning_opt.optim.factory import OptimConfig
    from lightning_opt.optim.schedules import ScheduleConfig

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|litlogger|litmodels|requires_grad=True).*")

    STEPS = max(int(os.environ.get("NB_STEPS", "300")), 12)
    TARGET_STEPS = min(5 * STEPS, 300)
    WORK = tempfile.mkdtemp(prefix="nb03_")
    train_path, val_path = default_corpus_shards()  # byte-level tokens, cached after the first call
    print(f"CLT steps: {STEPS} | target GPT steps: {TARGET_STEPS} | logs under {WORK}")
    """),
    ("md", """
    ## 1 · The target: a 4-layer byte-level GPT

    `train_demo_target` trains our `GPT` (4 layers, width 64, vocabulary 256 = bytes) with AdamW and
    caches it on disk by its settings, so a second run of this notebook (or the CLT recipe) reuses it.
    """),
    ("code", """
    target = train_demo_target(steps=TARGET_STEPS, n_layer=4, n_embd=64, seq_len=64, batch_size=16)
    windows = next(token_windows(val_path, 65, 16, None))
    with torch.no_grad():
        val_loss = float(target(windows[:, :-1], windows[:, 1:]))
    print(f"target: {sum(p.numel() for p in target.parameters()) / 1e3:.0f}k parameters, "
          f"val loss {val_loss:.3f} nats/byte (uniform: {torch.log(torch.tensor(256.0)):.3f})")
    """),
    ("md", """
    ## 2 · Train the CLT

    `CLTDataModule` hooks the target's MLPs once and streams `(x, y)` batches of MLP inputs and outputs,
    `[tokens, layers, d_model]`, computing normalisation statistics first. The CLT has 512 features per
    layer with a global BatchTopK activation (16 active features per token on average over all
    layers). Validation reports FVU and L0 per layer, dead features, and how well the *replacement
    model* (every MLP replaced by the CLT's output) predicts the next byte compared to the original.
    """),
    ("code", """
    data = CLTDataModule(target=target, train_files=str(train_path), val_files=str(val_path), seq_len=64,
                         tokens_per_batch=1024, val_tokens=4096, stats_tokens=16384, dtype="float32")
    clt_config = CLTConfig(n_layers=4, d_model=64, n_features=512, activation="batchtopk_global", k=16,
                           normalization="mean_std")
    module = CLTModule(
        clt_config,
        optim=OptimConfig(lr=2e-3, betas=(0.9, 0.999), weight_decay=0.0),
        schedule=ScheduleConfig(name="wsd", warmup_steps=min(10, STEPS // 4), decay_fraction=0.3, min_ratio=0.0),
        aux_coef=0.03, aux_k=16, preact_coef=1e-6, sparsity_coef=1e-4, dead_tokens=min(50_000, 256 * STEPS),
    )
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, val_check_interval=max(STEPS // 4, 1),
        check_val_every_n_epoch=None, limit_val_batches=4, num_sanity_val_steps=0, log_every_n_steps=max(STEPS // 60, 1),
        logger=L.pytorch.loggers.CSVLogger(WORK, name="clt"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and not k.endswith("_pb")}
    for k in ("val/fvu", "val/explained_variance", "val/l0", "val/dead_fraction", "val/kl", "val/next_token_agreement"):
        if k in final:
            print(f"{k:26s} {final[k]:.4f}")
    assert final["val/fvu"] < 1.0, "the CLT should explain part of the MLP outputs' variance"
    """),
    ("md", """
    ## 3 · FVU and L0 per layer, and the training curve

    FVU is the reconstruction error over the variance of each layer's MLP output (0 = perfect); L0 is
    the mean number of active features per token in that layer's encoder. The last layer reads from
    all four layers' features, so its FVU is usually the lowest.
    """),
    ("code", """
    import csv
    from pathlib import Path

    L_ = clt_config.n_layers
    fvu = [final[f"val/fvu_layer{i}"] for i in range(L_)]
    l0 = [final[f"val/l0_layer{i}"] for i in range(L_)]
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    curve = [(int(r["step"]), float(r["train/fvu"])) for r in rows if r.get("train/fvu")]

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.3))
    ax[0].bar(range(L_), fvu, color="tab:blue")
    ax[0].set(title="FVU per layer (validation)", xlabel="layer", ylim=(0, max(1.0, max(fvu) * 1.1)))
    ax[1].bar(range(L_), l0, color="tab:orange")
    ax[1].set(title="L0 per layer (active features / token)", xlabel="layer")
    ax[2].plot(*zip(*curve))
    ax[2].set(title="train FVU", xlabel="step", yscale="log")
    plt.tight_layout()
    plt.show()
    print("FVU per layer:", [round(v, 3) for v in fvu], "| L0 per layer:", [round(v, 2) for v in l0])
    """),
    ("md", """
    ## 4 · Dead and rarely firing features

    `CLTModule` counts, per feature, the training tokens since it last fired (`tokens_since_fired`); a
    feature is dead after `dead_tokens` tokens without firing, and AuxK gives dead features a gradient
    to come back. Below: the firing frequency of every feature on held-out text.
    """),
    ("code", """
    clt = module.model.eval()
    capture = MLPActivationCapture(target, dtype=torch.float32)  # its own hooks, registered once
    # 64-byte windows at random places of the held-out shard
    val_tokens = torch.from_numpy(read_shard(val_path).astype("int64"))
    n_windows = 256 if STEPS >= 100 else 64
    starts = torch.randint(0, len(val_tokens) - 64, (n_windows,), generator=torch.Generator().manual_seed(0))
    tokens, acts = [], []
    with torch.no_grad():
        for chunk in starts.split(16):
            w = torch.stack([val_tokens[s: s + 64] for s in chunk.tolist()])
            x, _ = capture.run(w)
            acts.append(clt(x).acts)  # [L, 16 * 64, F]
            tokens.append(w.reshape(-1))
    capture.remove()
    tokens, acts = torch.cat(tokens), torch.cat(acts, dim=1)  # [N], [L, N, F]
    freq = (acts > 0).float().mean(dim=1)  # [L, F]

    dead_train = module.tokens_since_fired >= module.dead_tokens
    print(f"held-out tokens: {len(tokens)}")
    for layer in range(L_):
        print(f"layer {layer}: never fired on held-out text {int((freq[layer] == 0).sum()):4d} / {freq.shape[1]}"
              f" | dead by the training counter {int(dead_train[layer].sum()):4d}")
    fig, ax = plt.subplots(figsize=(7, 3))
    bins = torch.linspace(-5, 0, 26)
    for layer in range(L_):
        f = freq[layer][freq[layer] > 0]
        ax.hist(torch.log10(f).numpy(), bins=bins.numpy(), histtype="step", label=f"layer {layer}")
    ax.set(title="feature firing frequency (held-out text; never-firing features not shown)",
           xlabel="log10 fraction of tokens", ylabel="features")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    """),
    ("md", """
    ## 5 · What do features respond to?

    For a few features of the first and the last layer, the held-out bytes where they are most active,
    with the preceding bytes of their window; the token itself is in `[brackets]`. Byte tokens decode
    straight back to text. The first 16 positions of each window are left out: with no context before
    them, their activations are outliers (an attention-sink effect), not meaning.
    """),
    ("code", """
    tok = ByteTokenizer()

    SEQ = 64
    position = torch.arange(len(tokens)) % SEQ

    def context(i: int, before: int = 30, after: int = 6) -> str:
        start, end = i - i % SEQ, i - i % SEQ + SEQ  # stay inside the window that produced token i
        left = tok.decode(tokens[max(start, i - before): i].tolist())
        here = tok.decode(tokens[i: i + 1].tolist())
        right = tok.decode(tokens[i + 1: min(end, i + 1 + after)].tolist())
        return (left + "[" + here + "]" + right).replace("\\n", "⏎")

    in_context = acts.masked_fill((position < 16)[None, :, None], 0)  # [L, N, F]
    freq_ctx = (in_context > 0).float().mean(dim=1)
    for layer in (0, L_ - 1):
        # features that fire on 0.2-5% of tokens: the densest ones tend to be generic
        order = torch.argsort(freq_ctx[layer], descending=True)
        chosen = [f for f in order.tolist() if 0.002 < freq_ctx[layer, f] < 0.05][:3]
        chosen = chosen or [f for f in order[:3].tolist() if freq_ctx[layer, f] > 0]
        if not chosen:
            print(f"layer {layer}: no feature fires after position 16 yet (train longer)")
        for feature in chosen:
            values, where = in_context[layer, :, feature].topk(4)
            print(f"layer {layer} feature {feature} (fires on {freq_ctx[layer, feature]:.1%} of tokens)")
            for v, i in zip(values.tolist(), where.tolist()):
                if v > 0:
                    print(f"   {v:6.2f}  {context(i)!r}")
    """),
]

if __name__ == "__main__":
    write_notebook("03_clt", CELLS)
