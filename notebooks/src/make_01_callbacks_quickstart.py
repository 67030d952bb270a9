"""Generates notebooks/01_callbacks_quickstart.ipynb: `python notebooks/src/make_01_callbacks_quickstart.py`."""

from __future__ import annotations

from _nb import write_notebook

CELLS = [
    ("md", """
    # 01 · Callbacks quickstart

    lightning-opt's callbacks work with *any* LightningModule and a plain `lightning.Trainer`. This
    notebook defines its own tiny regression model and data, then shows three of them at work:

    1. **`NaNSkip`**: a step whose loss is NaN is skipped; the parameters are left exactly as they were.
    2. **`AsyncCheckpoint`**: checkpoints are written in the background; a run that stopped half way
       resumes from the file and ends bit-identical to a run that never stopped.
    3. **`SpeedMonitor`**: throughput and where the time goes (data wait, validation, checkpoints).

    Runs on CPU in seconds; `NB_STEPS` sets the length of the runs. Docs: `docs/callbacks/`.
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
    from torch import nn

    from lightning_opt.callbacks import AsyncCheckpoint, NaNSkip, SpeedMonitor

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # keep the outputs short
    warnings.filterwarnings("ignore", message=".*(LeafSpec|weights_only|num_workers|litlogger|litmodels).*")

    STEPS = max(int(os.environ.get("NB_STEPS", "40")), 12)
    WORK = Path(tempfile.mkdtemp(prefix="nb01_"))  # logs and checkpoints of this notebook
    print("steps per run:", STEPS, "| files under", WORK)
    """),
    ("md", """
    ## Our own model and data

    A two-layer MLP learning a fixed random linear map. The data is an iterable that remembers its
    position (`state_dict` / `load_state_dict`): Lightning stores that in checkpoints, which is what
    makes a mid-epoch resume exact. `nan_at` makes the loss NaN at chosen global steps, standing in for a
    bad batch or an overflow.
    """),
    ("code", """
    class Batches:
        \"\"\"`n` fixed (x, y) batches per epoch, in an order that depends only on the epoch.\"\"\"

        def __init__(self, n: int = 8, batch_size: int = 32, dim: int = 16) -> None:
            g = torch.Generator().manual_seed(0)
            w = torch.randn(dim, 4, generator=g)
            xs = [torch.randn(batch_size, dim, generator=g) for _ in range(n)]
            self.batches = [(x, x @ w) for x in xs]
            self.pos, self.epoch = 0, 0

        def __len__(self) -> int:
            return len(self.batches)

        def __iter__(self):
            if self.pos >= len(self.batches):  # the previous epoch is over
                self.pos, self.epoch = 0, self.epoch + 1
            order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.epoch))
            while self.pos < len(self.batches):
                self.pos += 1
                yield self.batches[int(order[self.pos - 1])]

        def state_dict(self) -> dict:
            return {"pos": self.pos, "epoch": self.epoch}

        def load_state_dict(self, state: dict) -> None:
            self.pos, self.epoch = state["pos"], state["epoch"]


    class Regressor(L.LightningModule):
        def __init__(self, nan_at: tuple[int, ...] = ()) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
            self.nan_at = set(nan_at)
            self.data = Batches()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.global_step in self.nan_at:
                loss = loss * float("nan")  # a bad batch
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            # fused=True: NaNSkip then skips inside the optimizer kernel, with no host sync and no copy
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            return self.data

        def val_dataloader(self):
            return Batches(n=2)


    def trainer(name: str, callbacks: list, max_steps: int = STEPS, **kwargs) -> L.Trainer:
        kwargs.setdefault("limit_val_batches", 0)
        return L.Trainer(
            max_steps=max_steps, accelerator="cpu", devices=1, callbacks=callbacks,
            logger=L.pytorch.loggers.CSVLogger(WORK, name=name), log_every_n_steps=1,
            enable_progress_bar=False, enable_model_summary=False, **kwargs,
        )


    def logged(t: L.Trainer) -> list[dict]:
        \"\"\"The rows of the CSVLogger's metrics.csv (one per step and key group).\"\"\"
        t.logger.save()
        with open(Path(t.logger.log_dir) / "metrics.csv") as f:
            return list(csv.DictReader(f))
    """),
    ("md", """
    ## 1 · NaNSkip: a NaN loss at step 3 is skipped

    A small watcher callback of our own records, for every step, the loss and whether any parameter
    changed. Without `NaNSkip` the NaN flows into the gradients and AdamW writes NaN into every weight.
    """),
    ("code", """
    class ParamWatch(L.Callback):
        \"\"\"Per step: the loss and whether the parameters changed.\"\"\"

        def __init__(self) -> None:
            self.rows: list[tuple[int, float, bool]] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.before = [p.detach().clone() for p in module.parameters()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            moved = any(not torch.equal(a, p) for a, p in zip(self.before, module.parameters()))
            self.rows.append((trainer.global_step - 1, float(outputs["loss"]), moved))


    BAD = 3
    # Without NaNSkip: the parameters are NaN after the bad step.
    plain = Regressor(nan_at=(BAD,))
    trainer("no_nanskip", [], max_steps=BAD + 2).fit(plain)
    print("without NaNSkip, parameters finite after the run:",
          all(bool(torch.isfinite(p).all()) for p in plain.parameters()))

    # With NaNSkip.
    watch, nan_skip = ParamWatch(), NaNSkip(max_consecutive_skips=3)
    model = Regressor(nan_at=(BAD,))
    t = trainer("nanskip", [nan_skip, watch])
    t.fit(model)
    print("\\nstep   loss      parameters changed")
    for step, loss, moved in watch.rows[: BAD + 3]:
        print(f"{step:4d}   {loss:8.4f}  {moved}")
    assert [moved for step, _, moved in watch.rows if step == BAD] == [False], "the bad step must not move the weights"
    assert all(moved for step, _, moved in watch.rows if step != BAD)
    print("\\nskipped steps (callback):", nan_skip.skipped_total)
    print("parameters finite after the run:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    """),
    ("md", """
    The count is also logged (`nan_skip/skipped_steps`, `nan_skip/skipped_steps_recent`). In the default
    `mode="device"` the host reads a step's decision at the start of the next step (so it never waits for
    the device): the logged counter lags by one step.
    """),
    ("code", """
    # `step` is the global step after the optimizer step, i.e. row `s` closes the table's step s - 1
    rows = [r for r in logged(t) if r.get("nan_skip/skipped_steps")]
    for r in rows[: BAD + 4]:
        print(f"step {int(r['step']):3d}  nan_skip/skipped_steps = {float(r['nan_skip/skipped_steps']):.0f}")
    assert float(rows[-1]["nan_skip/skipped_steps"]) == 1.0
    """),
    ("md", """
    ## 2 · AsyncCheckpoint: save in the background, resume exactly

    Run A trains `STEPS` steps without stopping. Run B saves every `STEPS // 2` steps and "crashes" two
    steps later. Run C is a fresh process-like start (new model, new Trainer, scrambled RNG) that
    resumes from B's checkpoint file. With dropout in the model and the data order depending on the
    epoch, C ends with exactly A's weights: model, optimizer, LR schedule, data position and RNG
    states all come back from the file.
    """),
    ("code", """
    HALF = STEPS // 2
    run_a = Regressor()
    trainer("full", [AsyncCheckpoint(dirpath=str(WORK / "ckpt_a"), every_n_steps=10**6)]).fit(run_a)

    ckpt = AsyncCheckpoint(dirpath=str(WORK / "ckpt_b"), every_n_steps=HALF, keep_last_k=2,
                           save_on_train_end=False)
    trainer("crashed", [ckpt], max_steps=HALF + 2).fit(Regressor())
    for f in sorted(p for p in (WORK / "ckpt_b").iterdir() if not p.name.startswith(".")):
        kind = f"-> {os.readlink(f)}" if f.is_symlink() else f"{f.stat().st_size / 1e3:.1f} kB"
        print(f"{f.name:24s} {kind}")
    print("saves:", ckpt.saves, "| loop time inside each save (ms):", [round(s * 1e3, 2) for s in ckpt.stall_seconds])

    torch.manual_seed(1234)  # the resumed run must not depend on the RNG state it starts with
    run_c = Regressor()
    resume = trainer("resumed", [AsyncCheckpoint(dirpath=str(WORK / "ckpt_c"), every_n_steps=10**6)])
    resume.fit(run_c, ckpt_path=str(WORK / "ckpt_b" / "last.ckpt"))
    same = all(torch.equal(a, c) for a, c in zip(run_a.parameters(), run_c.parameters()))
    print(f"resumed at step {HALF}, finished at step {resume.global_step}; weights identical to run A: {same}")
    assert same
    """),
    ("md", """
    ## 3 · SpeedMonitor: throughput and the time split

    `SpeedMonitor` counts samples and tokens from the batch shapes and reads time on the host, so it
    never synchronises with the device. On a GPU it also logs `time/fwd_bwd_ms` and
    `time/optimizer_ms` from CUDA events it reads only once they have completed; on CPU (here) the
    split has the data wait, validation and checkpoint shares. We validate and checkpoint every few
    steps to have something to split.
    """),
    ("code", """
    every = max(STEPS // 4, 2)
    speed = SpeedMonitor(log_every_n_steps=2)
    t = trainer("speed", [speed, AsyncCheckpoint(dirpath=str(WORK / "ckpt_s"), every_n_steps=every)],
                val_check_interval=every, check_val_every_n_epoch=None, limit_val_batches=2,
                num_sanity_val_steps=0)
    t.fit(Regressor())
    rows = [r for r in logged(t) if r.get("speed/step_time_ms")]
    keys = sorted(k for k in rows[-1] if k.startswith(("speed/", "time/")) and rows[-1][k])
    print("keys logged by SpeedMonitor:", keys)
    print(f"\\n{'key':32s} {'last interval':>14s} {'whole run':>10s}")
    for k in keys:
        whole = f"{sum(float(r[k]) for r in rows):10.4f}" if k.endswith("_s") else ""
        print(f"{k:32s} {float(rows[-1][k]):14.4f} {whole}")
    """),
    ("code", """
    steps = [int(r["step"]) for r in rows]
    step_ms = [float(r["speed/step_time_ms"]) for r in rows]
    data = [float(r["time/data_wait_ms"]) / s for r, s in zip(rows, step_ms)]
    val = [float(r["time/validation_frac"]) for r in rows]
    ck = [float(r["time/checkpoint_frac"]) for r in rows]
    rest = [max(0.0, 1 - a - b - c) for a, b, c in zip(data, val, ck)]

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
    ax[0].plot(steps, [float(r["speed/samples_per_sec"]) for r in rows], marker="o")
    ax[0].set(title="samples/s (host wall time between log points)", xlabel="step")
    bottom = [0.0] * len(steps)
    for name, part in [("data wait", data), ("validation", val), ("checkpoint", ck), ("the rest: fwd, bwd, optimizer", rest)]:
        ax[1].bar(steps, part, bottom=bottom, label=name, width=1.6)
        bottom = [b + p for b, p in zip(bottom, part)]
    ax[1].set(title="where the time went, per log interval", xlabel="step", ylabel="fraction", ylim=(0, 1.05))
    ax[1].legend(fontsize=8, loc="lower left")
    plt.tight_layout()
    plt.show()
    """),
    ("md", """
    ## All six together

    The other three callbacks (`LossClamp`, `EvalThrottle`, `CudaMemoryHygiene`) attach the same way;
    the conformance suite (`tests/callbacks/test_conformance.py`) runs every callback alone and all six
    together, on one process and on two DDP ranks.

    ```python
    from lightning_opt.callbacks import (AsyncCheckpoint, CudaMemoryHygiene, EvalThrottle, LossClamp,
                                         NaNSkip, SpeedMonitor)
    trainer = L.Trainer(callbacks=[NaNSkip(), LossClamp(max=20.0), AsyncCheckpoint(every_n_steps=1000),
                                   EvalThrottle(max_fraction=0.05, max_val_batches=50),
                                   CudaMemoryHygiene(), SpeedMonitor()])
    ```
    """),
]

if __name__ == "__main__":
    write_notebook("01_callbacks_quickstart", CELLS)
