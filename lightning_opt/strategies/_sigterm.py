"""Lightning's per-step SIGTERM agreement over a CPU (gloo) group instead of the accelerator.

Lightning 2.6 broadcasts a "received SIGTERM" flag from rank 0 at the start of every training batch, as a
tensor on the strategy's device, and reads it with ``.item()``. On CUDA that read waits for the whole
previous step (backward, optimizer) to finish, so the next step's Python work (batch fetch, hooks, closure,
``zero_grad``, the start of ``training_step``) can no longer overlap the GPU's tail of the previous step: a
drain per step that a single-GPU run does not have. Sending the same flag through a gloo group keeps the
semantics (every rank agrees every step, rank 0 decides) and costs a CPU round trip, with no GPU wait.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist


def new_cpu_group() -> Any:
    """A gloo group over all ranks (a collective call: every rank must call it, in the same order)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.new_group(backend="gloo")
    except Exception as err:  # e.g. a build without gloo: keep Lightning's own (device) check
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"no gloo group for the SIGTERM check ({err}); Lightning's device broadcast stays.")
        return None


def install_cpu_sigterm_check(trainer: Any, group: Any) -> bool:
    """Replace the fit loop's per-batch SIGTERM broadcast with one over ``group``; return whether it did.

    Leaves Lightning alone when ``group`` is None.
    """
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_opt._internals import replace_sigterm_broadcast

    if group is None:
        return False

    def broadcast_sigterm_on_cpu() -> None:
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
        try:
            dist.broadcast(flag, src=dist.get_global_rank(group, 0), group=group)
        except Exception:  # as Lightning: a failed exchange does not stop training
            flag.zero_()
        if int(flag) == 1:
            with suppress(Exception):
                dist.barrier(group=group)  # every rank leaves here together
            raise SIGTERMException()

    replace_sigterm_broadcast(trainer, broadcast_sigterm_on_cpu)
    return True
