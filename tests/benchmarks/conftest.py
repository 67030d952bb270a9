from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread_per_process():
    """The benchmarks' smoke runs are checks, not measurements: one CPU thread per process (this one and the child
    processes it starts) instead of every core each, which on a busy machine costs more in contention than the
    parallelism gains."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
