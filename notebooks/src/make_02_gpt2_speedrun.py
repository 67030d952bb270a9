"""Generates notebooks/02_gpt2_speedrun.ipynb: `python notebooks/src/make_02_gpt2_speedrun.py`."""

from __future__ import annotations

from _nb import write_notebook

CELLS = [
    ("md", """
    # 02 · GPT-2 speedrun in Lightning

    Train the demo GPT-2 (speedrun architecture, toy size) on the built-in offline corpus, change the loss by
    subclassing `GPT2SpeedrunModule`, and plot both runs' loss curves from their TensorBoard logs.
    Runs on CPU in a few minutes; nothing is downloaded. `NB_STEPS` sets the training steps of each run.
    Docs: `docs/gpt2.md`; the same model as a recipe: `lightning-opt-gpt2 --config gpt2/demo`.
    """),
    ("code", """
    import os

    import lightning as L
    import matplotlib.pyplot as plt
    import torch

    from lightning_opt.data.corpus import default_corpus_shards
    from lightning_opt.data.datamodule import TokenShardDataModule
    from lightning_opt.models.gpt2 import GPTConfig
    from lightning_opt.modules.gpt2 import GPT2SpeedrunModule
    from lightning_opt.optim.factory import OptimConfig
    from lightning_opt.optim.schedules import ScheduleConfig

    STEPS = int(os.environ.get("NB_STEPS", "60"))
    train, val = default_corpus_shards()  # Python's own docs, byte-level tokens, cached after the first call
    print(train, val)
    """),
    ("md", """
    ## The model and the data

    Every speedrun idea is a `GPTConfig` field; the optimizer is the speedrun's Muon + Adam split.
    """),
    ("code", """
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=128, pos_emb="rope",
                       norm="rmsnorm", bias=False, qk_norm=True, mlp="relu2", tie_embeddings=False,
                       zero_init_proj=True, logit_softcap=30.0)
    optim = OptimConfig(name="muon", lr=8e-3, muon_lr=0.03, embed_lr=0.05, weight_decay=0.0)
    schedule = ScheduleConfig(name="wsd", decay_fraction=0.4, min_ratio=0.0)


    def run(module, name):
        torch.manual_seed(0)
        data = TokenShardDataModule(str(train), str(val), seq_len=128, batch_size=8, val_tokens=8192)
        logger = L.pytorch.loggers.TensorBoardLogger("nb_runs", name=name)
        trainer = L.Trainer(max_steps=STEPS, val_check_interval=STEPS // 3, check_val_every_n_epoch=None,
                            logger=logger, log_every_n_steps=5, enable_checkpointing=False,
                            enable_model_summary=False, accelerator="auto", devices=1)
        trainer.fit(module, datamodule=data)
        return logger.log_dir


    base_dir = run(GPT2SpeedrunModule(config, optim, schedule), "baseline")
    """),
    ("md", """
    ## Subclass to change something

    Override `compute_loss`: here, label smoothing. Everything else (optimizers, logging, metrics) is inherited.
    """),
    ("code", """
    class LabelSmoothedGPT(GPT2SpeedrunModule):
        def compute_loss(self, x, y):
            logits = self.model(x)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), label_smoothing=0.1)


    smooth_dir = run(LabelSmoothedGPT(config, optim, schedule), "label_smoothing")
    """),
    ("md", """
    ## Loss curves from TensorBoard
    """),
    ("code", """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


    def scalars(log_dir, tag):
        acc = EventAccumulator(log_dir)
        acc.Reload()
        events = acc.Scalars(tag)
        return [e.step for e in events], [e.value for e in events]


    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, d in [("baseline", base_dir), ("label smoothing", smooth_dir)]:
        ax[0].plot(*scalars(d, "train/loss"), label=name)
        ax[1].plot(*scalars(d, "val/loss"), marker="o", label=name)
    ax[0].set(title="train loss", xlabel="step")
    ax[1].set(title="val loss", xlabel="step")
    ax[0].legend()
    plt.tight_layout()
    plt.show()
    steps, vals = scalars(base_dir, "val/loss")
    assert vals[-1] < vals[0], "validation loss should fall"
    print("baseline val/loss:", [round(v, 3) for v in vals])
    """),
]

if __name__ == "__main__":
    write_notebook("02_gpt2_speedrun", CELLS)
