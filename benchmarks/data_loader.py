"""Token data loading: host throughput of TokenShardDataModule and the effect of its GPU prefetch.

Part A (any device): tokens/s of the train loader vs a minimal in-RAM slicing loader (the speedrun's
approach: the whole shard in memory, one contiguous slice per batch), at the speedrun micro-batch.
Part B (CUDA only): ms/step of a real Lightning ``Trainer.fit`` whose step is a fixed GPU workload, fed
by the DataModule with ``gpu_prefetch`` on and off, and by a batch already on the GPU (the floor).

    python -m benchmarks.data_loader            # full run (about a minute on an H100)
    python -m benchmarks.data_loader --smoke    # seconds, CPU is fine

Writes JSON to ``--out`` (default ``benchmarks/results/data_loader.json``). Needs no downloads: the
shard is random tokens written to a temporary folder.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from benchmarks._results import command_line, environment, write_result
from lightning_opt.data.datamodule import TokenShardDataModule
from lightning_opt.data.shards import write_shard

ROOT = Path(__file__).resolve().parents[1]


def _in_ram_batches(path: Path, batch: int, seq_len: int, steps: int):
    """Baseline: load the shard into one tensor, cut contiguous B*T+1 slices."""
    tokens = torch.from_numpy(np.fromfile(path, dtype="<u2", offset=1024).astype(np.int32))
    pos = 0
    for _ in range(steps):
        if pos + batch * seq_len + 1 > len(tokens):
            pos = 0
        buf = tokens[pos : pos + batch * seq_len + 1]
        yield buf[:-1].view(batch, seq_len).long(), buf[1:].view(batch, seq_len).long()
        pos += batch * seq_len


def _rate(batches, steps: int, tokens_per_batch: int) -> dict:
    it = iter(batches)
    next(it)  # start-up (workers, first page faults) is not throughput
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    dt = time.perf_counter() - t0
    return {
        "batches": n,
        "seconds": dt,
        "tokens_per_s": n * tokens_per_batch / dt,
        "ms_per_batch": 1e3 * dt / max(n, 1),
    }


def host_throughput(path: Path, batch: int, seq_len: int, steps: int) -> list[dict]:
    rows = []
    variants = [
        ("in-RAM slicing (baseline)", None),
        ("DataModule, in order", dict(shuffle=False, num_workers=0)),
        ("DataModule, shuffled windows", dict(shuffle=True, num_workers=0)),
        ("DataModule, shuffled, 2 workers", dict(shuffle=True, num_workers=2)),
    ]
    for name, kw in variants:
        try:
            if kw is None:
                res = _rate(_in_ram_batches(path, batch, seq_len, steps + 1), steps, batch * seq_len)
            else:
                dm = TokenShardDataModule(
                    path, None, seq_len=seq_len, batch_size=batch, pin_memory=False, **kw
                )
                res = _rate(dm.train_dataloader(), steps, batch * seq_len)
            rows.append({"variant": name, **res})
        except Exception as err:  # one failing variant must not kill the others
            rows.append(
                {"variant": name, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
            )
    return rows


def gpu_prefetch(
    path: Path, batch: int, seq_len: int, steps: int, width: int, depth: int, smoke: bool
) -> list[dict]:
    import lightning.pytorch as pl

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"

    class Work(pl.LightningModule):
        """Embedding then ``depth`` square matmuls: a fixed GPU workload per step."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(65536, width)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
            self.marks: list[float] = []

        def training_step(self, b, i):
            x, y = b
            h = self.emb(x)
            for layer in self.layers:
                h = torch.tanh(layer(h))
            return h.float().mean() + 0.0 * y.float().mean()

        def on_train_batch_start(self, b, i):
            if accelerator == "cuda":
                torch.cuda.synchronize()  # timing only: mark step boundaries on the host
            self.marks.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class FixedBatch(pl.LightningDataModule):
        def train_dataloader(self):
            x = torch.randint(0, 50257, (batch, seq_len), device=accelerator)
            return torch.utils.data.DataLoader([(x, x)] * (steps + 5), batch_size=None)

    rows = []
    variants = [
        ("batch already on device (floor)", None),
        ("DataModule, gpu_prefetch=False", False),
        ("DataModule, gpu_prefetch=True", True),
    ]
    for name, prefetch in variants:
        try:
            model = Work()
            trainer = pl.Trainer(
                accelerator=accelerator,
                devices=1,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                precision="bf16-mixed" if accelerator == "cuda" else "32-true",
            )
            if prefetch is None:
                dm = FixedBatch()
            else:
                dm = TokenShardDataModule(
                    path, None, seq_len=seq_len, batch_size=batch, gpu_prefetch=prefetch
                )
            trainer.fit(model, datamodule=dm)
            gaps = np.diff(model.marks)[min(5, len(model.marks) // 3) :]  # skip warm-up steps
            rows.append(
                {
                    "variant": name,
                    "steps": len(model.marks),
                    "ms_per_step": 1e3 * float(statistics.median(gaps)),
                }
            )
        except Exception as err:
            rows.append(
                {"variant": name, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds on CPU")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_loader.json"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    batch, seq_len = (4, 64) if args.smoke else (args.batch, args.seq_len)
    n_tokens = 200_000 if args.smoke else 50_000_000
    host_steps, gpu_steps = (20, 8) if args.smoke else (300, 60)
    width, depth = (32, 1) if args.smoke else (1024, 8)

    result: dict = {
        "smoke": args.smoke,
        "batch": batch,
        "seq_len": seq_len,
        "shard_tokens": n_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shard(
            Path(tmp) / "bench_train_000000.bin", np.random.default_rng(0).integers(0, 50257, n_tokens)
        )
        result["host"] = host_throughput(path, batch, seq_len, host_steps)
        base = next((r for r in result["host"] if "baseline" in r["variant"] and "tokens_per_s" in r), None)
        for r in result["host"]:
            if base and "tokens_per_s" in r:
                r["ratio_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
        if torch.cuda.is_available() or args.smoke:
            result["gpu"] = gpu_prefetch(path, batch, seq_len, gpu_steps, width, depth, args.smoke)
            floor = next((r for r in result["gpu"] if "floor" in r["variant"] and "ms_per_step" in r), None)
            for r in result["gpu"]:
                if floor and "ms_per_step" in r:
                    r["ratio_vs_floor"] = r["ms_per_step"] / floor["ms_per_step"]
        else:
            result["gpu"] = "skipped: no CUDA"

    env = environment()
    write_result(args.out, benchmark="data_loader", env=env, command=command_line(), baseline=None, results=result)
    print(f"\n{env['device']}  B={batch} T={seq_len}")
    print(f"{'host loader':40s} {'Mtok/s':>8s} {'ms/batch':>9s} {'vs base':>8s}")
    for r in result["host"]:
        if "error" in r:
            print(f"{r['variant']:40s} ERROR {r['error']}")
        else:
            print(
                f"{r['variant']:40s} {r['tokens_per_s'] / 1e6:8.1f} {r['ms_per_batch']:9.3f} {r.get('ratio_vs_baseline', 1):8.2f}"
            )
    if isinstance(result["gpu"], list):
        print(f"{'Trainer.fit step':40s} {'ms/step':>8s} {'vs floor':>9s}")
        for r in result["gpu"]:
            if "error" in r:
                print(f"{r['variant']:40s} ERROR {r['error']}")
            else:
                print(f"{r['variant']:40s} {r['ms_per_step']:8.2f} {r.get('ratio_vs_floor', 1):9.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
