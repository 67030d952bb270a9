"""Shared pieces of the reliability suite: a tiny deterministic LM, shards, runs in child processes.

Children come from a ``forkserver`` whose server has already imported torch and Lightning, so a
child that is killed costs a fork, not an interpreter start (which dominates on a small CPU box).
Children talk to the test through files only: a loss log appended and flushed every step, marker
files, and ``torch.save``d results.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

VOCAB = 64
SEQ_LEN = 8
BATCH = 4

_CTX: Any = None


def context() -> Any:
    """The forkserver context; its server preloads torch, Lightning and this module once."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "lightning.pytorch", "lightning_opt.callbacks", "lightning_opt.data.datamodule", __name__]
        )
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_shard(path: Path, n_tokens: int, seed: int = 0) -> Path:
    """A shard of random token ids below ``VOCAB`` with some structure (so the loss falls)."""
    from lightning_opt.data import write_shard

    rng = np.random.default_rng(seed)
    base = rng.integers(0, VOCAB, size=n_tokens)
    # every other token is a function of the previous one: something for the model to learn
    base[1::2] = (base[0::2][: len(base[1::2])] * 7 + 3) % VOCAB
    return write_shard(path, base.astype(np.uint16))


# -- the model ------------------------------------------------------------------------------------


class _GradFault(torch.autograd.Function):
    """Adds 0 to the loss; its backward puts ``value`` into one element of ``w``'s gradient."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, value: float) -> torch.Tensor:
        ctx.shape, ctx.value = w.shape, value
        return w.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = torch.zeros(ctx.shape)
        g.view(-1)[0] = ctx.value
        return g, None


FAULTS = ("nan_loss", "inf_loss", "nan_grad", "inf_grad")


def inject(loss: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """Make ``loss`` (or only its gradient, for the ``*_grad`` kinds) non-finite."""
    if kind == "nan_loss":
        return loss * float("nan")
    if kind == "inf_loss":
        return loss * float("inf")
    if kind == "nan_grad":
        return loss + _GradFault.apply(weight, float("nan"))
    if kind == "inf_grad":
        return loss + _GradFault.apply(weight, float("inf"))
    raise ValueError(f"unknown fault {kind!r}; choose one of {FAULTS}")


class TinyLM(pl.LightningModule):
    """Embedding -> dropout -> linear head; AdamW + a per-step LambdaLR. Deterministic on CPU.

    Args:
        faults: ``{batch_idx: kind}`` (kinds in :data:`FAULTS`) injected on rank ``fault_rank``
            (every rank when ``None``); a dict ``{rank: {batch_idx: kind}}`` for per-rank faults.
        loss_log: file that gets one ``"<global_step> <loss.hex()>"`` line per training step.
        step_sleep: seconds to sleep in each step (to give a signal time to land mid-run).
        ballast: floats of an unused buffer that make each checkpoint that much bigger, so that a
            random kill often lands inside a real write (left out of :func:`state`).
    """

    def __init__(
        self,
        dim: int = 16,
        lr: float = 0.02,
        dropout: float = 0.1,
        fused: bool = False,
        faults: dict[Any, Any] | None = None,
        loss_log: str | None = None,
        step_sleep: float = 0.0,
        seed: int = 0,
        ballast: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        if ballast:
            self.register_buffer("ballast", torch.zeros(ballast))
        self.emb = nn.Embedding(VOCAB, dim)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, VOCAB)
        self.lr, self.fused = lr, fused
        self.faults = faults or {}
        self.loss_log = loss_log
        self.step_sleep = step_sleep
        self.losses: list[float] = []

    def _faults_here(self) -> dict[int, str]:
        if self.faults and all(isinstance(v, dict) for v in self.faults.values()):
            return self.faults.get(self.global_rank, {})
        return self.faults

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.drop(self.emb(x)))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        kind = self._faults_here().get(batch_idx)
        if kind is not None:
            loss = inject(loss, self.head.weight, kind)
        value = float(loss.detach())
        self.losses.append(value)
        if self.loss_log is not None:
            with open(self.loss_log, "a") as f:
                f.write(f"{self.global_step} {value.hex()}\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, fused=self.fused or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Batches:
    """A fixed list of batches (one epoch); each rank of a DDP run passes its own list."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.batches)


def random_batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=g)
        out.append((x, (x * 7 + 3) % VOCAB))
    return out


def trainer(root: Path | str, callbacks: list[Any], **kw: Any) -> pl.Trainer:
    """The callbacks suite's CPU Trainer (same defaults), rooted at ``root``."""
    from tests.callbacks.conftest import make_trainer

    return make_trainer(root, callbacks, **kw)


def state(module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, Any]:
    """Parameters, optimizer state and scheduler position, as CPU clones."""
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items() if k != "ballast"},
        "opt": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in opt.state_dict()["state"].items()},
        "sched_epoch": sched.last_epoch,
        "lr": opt.param_groups[0]["lr"],
    }


def state_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of everything that is not bit-identical between two :func:`state` results."""
    diffs = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"].get(k, torch.empty(0)))]
    if a["opt"].keys() != b["opt"].keys():
        diffs.append("optimizer state keys")
    else:
        for i in a["opt"]:
            for k, v in a["opt"][i].items():
                w = b["opt"][i].get(k)
                same = torch.equal(v, w) if torch.is_tensor(v) and torch.is_tensor(w) else v == w
                if not same:
                    diffs.append(f"opt[{i}].{k}")
    for key in ("sched_epoch", "lr"):
        if a[key] != b[key]:
            diffs.append(f"{key}: {a[key]} vs {b[key]}")
    return diffs


# -- a training run in a child process -----------------------------------------------------------


def read_losses(path: Path) -> dict[int, str]:
    """``{global_step: loss hex}`` from a loss log (a torn last line from a kill is ignored)."""
    out: dict[int, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                float.fromhex(parts[1])
            except ValueError:
                continue
            out[int(parts[0])] = parts[1]
    return out


def ckpt_run(spec: dict[str, Any]) -> None:
    """Child entry: train TinyLM on a shard with AsyncCheckpoint; optionally resume; save the final state.

    ``spec`` keys: shard, root, ckdir, loss_log, max_steps, every_n_steps, ckpt_path, out (final state
    file), step_sleep, midwrite (``{"save": n, "fraction": f}``: the n-th torch.save writes only that
    fraction of the file, drops a marker and stalls), fill_after_first_save (bytes to leave free),
    keep_last_k.
    """
    torch.set_num_threads(1)
    import lightning_opt.callbacks.async_checkpoint as ac
    from lightning_opt.data import TokenShardDataModule

    pl.seed_everything(spec.get("seed", 0), verbose=False)
    midwrite = spec.get("midwrite")
    if midwrite:
        real_save = torch.save
        calls = [0]

        def stalling_save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            calls[0] += 1
            if calls[0] != midwrite["save"]:
                return real_save(obj, f, *a, **k)
            import io

            buf = io.BytesIO()
            real_save(obj, buf, *a, **k)
            data = buf.getvalue()
            with open(f, "wb") as fh:
                fh.write(data[: int(len(data) * midwrite["fraction"])])
                fh.flush()
                os.fsync(fh.fileno())
            Path(spec["root"], "MIDWRITE").touch()
            time.sleep(600)

        ac.torch.save = stalling_save
    if spec.get("pause_before_link"):
        real_link = ac._point_last

        def slow_link(path: str) -> None:
            Path(spec["root"], "BEFORELINK").touch()
            time.sleep(600)
            real_link(path)

        ac._point_last = slow_link

    dm = TokenShardDataModule(spec["shard"], None, seq_len=SEQ_LEN, batch_size=BATCH, shuffle=True, seed=3)
    model = TinyLM(
        loss_log=spec["loss_log"], step_sleep=spec.get("step_sleep", 0.0), ballast=spec.get("ballast", 0),
        faults=spec.get("faults"),
    )
    ckpt = ac.AsyncCheckpoint(
        dirpath=spec["ckdir"], every_n_steps=spec.get("every_n_steps", 3), keep_last_k=spec.get("keep_last_k", 2),
        save_on_train_end=spec.get("save_on_train_end", True),
    )
    callbacks = all_callbacks(ckpt, spec["all_callbacks"]) if spec.get("all_callbacks") else [ckpt]
    if spec.get("faults") and not spec.get("all_callbacks"):
        from lightning_opt.callbacks import NaNSkip

        callbacks.append(NaNSkip(max_consecutive_skips=None))
    ddp = {"strategy": "ddp", "devices": 2} if spec.get("ddp") else {}
    t = trainer(spec["root"], callbacks, max_steps=spec["max_steps"], max_epochs=-1, **ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.fit(model, datamodule=dm, ckpt_path=spec.get("ckpt_path"))
        except Exception as err:
            Path(spec["root"], "error.txt").write_text(f"{type(err).__name__}: {err}")
            raise
        finally:
            Path(spec["root"], "warnings.txt").write_text("\n".join(str(w.message) for w in caught))
    if spec.get("out"):
        result = state(model, t)
        skip = next((c for c in callbacks if type(c).__name__ == "NaNSkip"), None)
        if skip is not None:
            skip.resolve()
            result["skipped"] = skip.skipped_total
        torch.save(result, spec["out"])


ORDERS = ("nan_first", "nan_last")


def all_callbacks(ckpt: Any, order: str) -> list[Any]:
    """The six lightning_opt callbacks around ``ckpt``, with NaNSkip first or last (see :data:`ORDERS`)."""
    from lightning_opt.callbacks import CudaMemoryHygiene, EvalThrottle, LossClamp, NaNSkip, SpeedMonitor

    others = [LossClamp(max=50.0), ckpt, EvalThrottle(every_n_steps=5, max_val_batches=1),
              CudaMemoryHygiene(gc_every_n_steps=4), SpeedMonitor(log_every_n_steps=2)]
    skip = NaNSkip(max_consecutive_skips=None)
    if order == "nan_first":
        return [skip, *others]
    if order == "nan_last":
        return [*others[::-1], skip]
    raise ValueError(f"unknown order {order!r}; choose one of {ORDERS}")


def start(target: Callable[..., None], *args: Any) -> Any:
    proc = context().Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def wait_for(predicate: Callable[[], bool], timeout: float, proc: Any | None = None, poll: float = 0.005) -> bool:
    """Poll until ``predicate()``; False on timeout or when ``proc`` has exited without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and not proc.is_alive():
            return predicate()
        time.sleep(poll)
    return False


def kill9(proc: Any) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def join_or_kill(proc: Any, timeout: float) -> bool:
    """Wait for ``proc``; kill it and return False (a hang) when it outlives ``timeout``."""
    proc.join(timeout)
    if proc.is_alive():
        kill9(proc)
        return False
    return True


def step_files(ckdir: Path) -> list[tuple[int, Path]]:
    """Checkpoints under their final names, oldest first."""
    import re

    out = []
    for p in ckdir.glob("step=*.ckpt"):
        m = re.fullmatch(r"step=(\d+)(-exception)?\.ckpt", p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def loads(path: Path) -> dict[str, Any] | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:
        return None


# -- DDP ------------------------------------------------------------------------------------------


def ddp_nan_worker(rank: int, port: int, trials: list[dict[str, Any]], out_dir: str) -> None:
    """Each trial: a NaNSkip run with faults, then a run without the faulty steps; rank 0 saves both."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE="2", NODE_RANK="0",
    )
    import torch.distributed as dist

    from lightning_opt.callbacks import NaNSkip

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    for i, trial in enumerate(trials):
        batches = random_batches(trial["steps"], seed=1000 * i + rank)
        faults = {r: dict(trial["faults"].get(r, {})) for r in (0, 1)}
        bad = set(faults[0]) | set(faults[1])
        results = {}
        for name, data, module_faults, cbs in (
            ("faulty", batches, faults, [NaNSkip(mode=trial.get("mode", "device"), max_consecutive_skips=None)]),
            ("reference", [b for j, b in enumerate(batches) if j not in bad], None, []),
        ):
            m = TinyLM(dropout=0.0, fused=trial.get("fused", False), faults=module_faults)
            t = trainer(Path(out_dir) / f"{name}{i}", cbs, strategy="ddp", devices=2, use_distributed_sampler=False)
            t.fit(m, train_dataloaders=Batches(data))
            results[name] = state(m, t)
            if cbs:
                cbs[0].resolve()
                results["skipped"] = cbs[0].skipped_total
        torch.save(results, Path(out_dir) / f"trial{i}.rank{rank}.pt")
        dist.barrier()
    dist.destroy_process_group()


def run_ddp(trials: list[dict[str, Any]], out_dir: Path, timeout: float) -> tuple[bool, list[list[dict[str, Any]]]]:
    """Runs :func:`ddp_nan_worker` on 2 gloo ranks; returns (finished in time, per-trial per-rank results)."""
    import torch.multiprocessing as tmp

    context()  # the forkserver (with its preload) is shared with torch.multiprocessing
    pc = tmp.start_processes(
        ddp_nan_worker, args=(free_port(), trials, str(out_dir)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    finished = False
    while time.monotonic() < deadline:
        if pc.join(timeout=1.0):
            finished = True
            break
    if not finished:
        for p in pc.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    results = []
    for i in range(len(trials)):
        per_rank = []
        for r in (0, 1):
            f = out_dir / f"trial{i}.rank{r}.pt"
            per_rank.append(torch.load(f, weights_only=False) if f.exists() else None)
        results.append(per_rank)
    return finished, results


def is_finite_hex(h: str) -> bool:
    return math.isfinite(float.fromhex(h))


def ddp_ckpt_worker(rank: int, port: int, spec: dict[str, Any]) -> None:
    """One rank of a 2-rank DDP run of :func:`ckpt_run`'s training (each rank logs its own losses)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE="2", NODE_RANK="0",
    )
    import torch.distributed as dist

    # a short collective timeout: a dead peer must turn into an error, not a wait of 30 minutes
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=spec.get("pg_timeout", 30)))
    ckpt_run({**spec, "loss_log": f"{spec['loss_log']}.rank{rank}", "ddp": True})


def start_ddp(target: Callable[..., None], spec: dict[str, Any]) -> list[Any]:
    """Start 2 ranks from the forkserver without a supervisor (so one rank's death is not cleaned up for us)."""
    port = free_port()
    procs = [context().Process(target=target, args=(r, port, spec), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    return procs
