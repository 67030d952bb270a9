"""Gloo ranks forked from the test process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp


def fork_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``worker(rank, *args)`` in ``nprocs`` processes forked from this one, joined; a rank's exception fails here
    with its traceback.

    Forked ranks start with what this process imported (a spawned rank spends seconds importing torch and
    Lightning). Each runs on one intra-op thread: a forked child that enters the OpenMP thread pool its parent
    used hangs.
    """
    mp.start_processes(_one_thread, args=(worker, *args), nprocs=nprocs, join=True, start_method="fork")


@contextmanager
def one_thread_for_forks() -> Iterator[None]:
    """One intra-op thread in this process while it forks (Lightning's ``ddp_fork``): the forked ranks inherit it
    (a forked child that enters its parent's OpenMP thread pool hangs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _one_thread(rank: int, worker: Callable[..., None], *args: Any) -> None:
    torch.set_num_threads(1)
    worker(rank, *args)
