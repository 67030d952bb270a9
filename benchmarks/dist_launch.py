"""Process groups for the multi-GPU benchmarks (``clt_scaling.py``, ``gpt2_ddp_scaling.py``).

One process group per world size, launched with a watchdog so a hung collective cannot eat a device call:
the group is terminated at ``end_unix + grace_s`` and the runs finished by then keep their results.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gpus(available: int) -> list[int]:
    """1 and every power of two up to ``available`` (1 and 2 on a 2-GPU machine: the 1-vs-2 comparison)."""
    sizes, n = [1], 2
    while n <= available:
        sizes.append(n)
        n *= 2
    return sizes


def init_group(rank: int, world: int, port: int, smoke: bool, timeout_s: float) -> bool:
    """Join the group as ``rank`` (NCCL on CUDA, gloo for CPU smoke runs); returns whether CUDA is used."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(world), NODE_RANK="0",
    )  # fmt: skip
    if smoke:  # one thread per process: several processes share a few CPU cores without spin-waiting
        torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available() and not smoke
    if use_cuda:
        torch.cuda.set_device(rank)
    kw = {"device_id": torch.device("cuda", rank)} if use_cuda else {}
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw
    )
    return use_cuda


def seconds_left(end_unix: float | None) -> float:
    """Rank 0's time left before ``end_unix``, the same on every rank (a rank that starts a run alone would
    wait forever in its first collective)."""
    import torch.distributed as dist

    left = [end_unix - time.time() if end_unix else float("inf")]
    dist.broadcast_object_list(left, src=0)
    return left[0]


def launch(worker: Callable[..., None], worker_args: tuple[Any, ...], world: int, smoke: bool,
           end_unix: float | None, grace_s: float) -> str:
    """Run ``worker(rank, world, port, *worker_args)`` in ``world`` processes and wait for them.

    Returns the error message for runs that wrote no result: a crash, or termination past the time budget.
    CPU smoke runs fork (no CUDA in the parent; torch and Lightning are not imported again per process).
    """
    ctx = mp.start_processes(
        worker,
        args=(world, free_port(), *worker_args),
        nprocs=world,
        join=False,
        start_method="fork" if smoke else "spawn",
    )
    try:
        while not ctx.join(timeout=2):
            if end_unix and time.time() > end_unix + grace_s:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                for proc in ctx.processes:
                    proc.join(10)
                return f"terminated: past the time budget (--end-unix + {grace_s:.0f}s)"
    except Exception as err:  # a crashed process (e.g. killed for memory)
        return f"{type(err).__name__}: {str(err)[-2000:]}"
    return "no result written"
