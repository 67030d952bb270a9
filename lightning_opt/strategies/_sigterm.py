"""Pre-emption (SIGTERM) that stops every rank at the same optimizer-step boundary.

Lightning 2.6 stops a run on SIGTERM at the end of the batch the signal arrived in, which with
``accumulate_grad_batches > 1`` is usually the middle of an accumulation window: the partial gradient
of the window is in no checkpoint. Its handler also runs a device collective (a broadcast from rank 0)
inside the signal handler, on the signalled rank only, and its per-batch agreement reads rank 0's flag
alone: a SIGTERM to another rank is not seen by rank 0, and the handler's collective meets whatever
collective the other ranks are in.

:class:`StepBoundaryStop` replaces both for one fit:

* the SIGTERM handler only records the request (and forwards the signal to the processes Lightning's
  launcher started, as Lightning does); no collective runs in it;
* the ranks agree by an OR over all ranks (``all_reduce(MAX)`` over a gloo group: a CPU round trip, no
  GPU wait) at decision points only: once per optimizer step (where a window closes), and at every
  micro-batch before the first optimizer step, when there is nothing to save;
* when any rank asked, every rank sets Lightning's ``received_sigterm``, so Lightning raises
  ``SIGTERMException`` (exit status 0) right after that batch, on every rank.

``AsyncCheckpoint`` asks :meth:`StepBoundaryStop.should_stop` at the end of each batch and saves when the
answer is yes at a window's end: a checkpoint at an optimizer-step boundary, the same state a periodic save
there holds.
"""

from __future__ import annotations

import signal
import threading
import weakref
from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_opt._internals import (
    replace_sigterm_broadcast,
    set_received_sigterm,
    sigterm_handler_before_fit,
)

_GUARDS: weakref.WeakKeyDictionary[Any, StepBoundaryStop] = weakref.WeakKeyDictionary()


def new_cpu_group() -> Any:
    """A gloo group over all ranks (a collective call: every rank must call it, in the same order)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    try:
        return dist.new_group(backend="gloo")
    except Exception as err:  # e.g. a build without gloo: agree over the default group instead
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"no gloo group for the SIGTERM agreement ({err}); it runs over the default group.")
        return None


def window_closed(trainer: Any) -> bool:
    """Whether the last batch that ran ended an accumulation window (the optimizer stepped on it), from the
    fit loop's public progress counters. True before the first batch of an epoch."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    ready = progress.current.ready
    return (ready % trainer.accumulate_grad_batches == 0 or bool(progress.is_last_batch)
            or ready == trainer.num_training_batches)


class StepBoundaryStop:
    """Stops a fit on SIGTERM at the next optimizer-step boundary, on every rank (see the module docstring).

    Args:
        trainer: the Trainer of the fit.
        group: a gloo group over all ranks for the agreement (``None``: the default group, with a tensor on
            the strategy's device, when there is more than one rank).
    """

    def __init__(self, trainer: Any, group: Any = None) -> None:
        self._trainer = weakref.ref(trainer)
        self.group = group
        self.requested = False  # this process received SIGTERM
        self.agreed = False  # the ranks decided to stop
        self._decided_at_end: tuple[int, int] | None = None  # the decision point a batch's end decided last
        self._handler: Any = None

    # -- the signal -----------------------------------------------------------------------------------
    def arm(self) -> None:
        """Install the SIGTERM handler (after Lightning installed its own; Lightning restores the handler
        from before the fit at its teardown). Idempotent; only possible in the main thread."""
        trainer = self._trainer()
        if trainer is None or threading.current_thread() is not threading.main_thread():
            return
        if self._handler is not None and signal.getsignal(signal.SIGTERM) is self._handler:
            return
        self.requested, self.agreed, self._decided_at_end = False, False, None  # a new fit
        previous = sigterm_handler_before_fit(trainer)

        def on_sigterm(signum: int, frame: Any) -> None:
            first = not self.requested
            self.requested = True
            fit = self._trainer()  # not captured: the handler must not keep the Trainer alive
            if first and fit is not None and fit.strategy.launcher is not None:
                fit.strategy.launcher.kill(signum)  # processes Lightning started get the signal too, as in Lightning
            if callable(previous):
                previous(signum, frame)
            if fit is not None and fit.world_size == 1 and fit.global_step == 0:
                # Nothing to save yet and no peer to agree with: stop now, even inside a compilation.
                self._stop(fit)

        self._handler = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)

    # -- the agreement --------------------------------------------------------------------------------
    def should_stop(self, trainer: Any, at_batch_end: bool = True) -> bool:
        """Whether the fit stops after the batch that just ran (a collective at decision points: call it
        on every rank at the same batches). Sets Lightning's ``received_sigterm`` when it does.

        A callback asks at a batch's end (``at_batch_end``); the fit loop asks again before the next batch,
        which does not exchange again when a batch's end decided the same point."""
        if self.agreed:
            return True
        if not (window_closed(trainer) or trainer.global_step == 0):
            return False  # mid-window: the stop waits for the optimizer step
        point = (trainer.fit_loop.epoch_loop.batch_progress.total.ready, trainer.global_step)
        if at_batch_end:
            self._decided_at_end = point
        elif point == self._decided_at_end:
            return False
        self.agreed = self._exchange(trainer)
        if self.agreed:
            set_received_sigterm(trainer)  # Lightning raises SIGTERMException at this batch's end
        return self.agreed

    def _exchange(self, trainer: Any) -> bool:
        # Lightning's own flag counts too: its handler may have run before this one was installed.
        mine = self.requested or bool(trainer.received_sigterm)
        if trainer.world_size < 2 or not dist.is_available() or not dist.is_initialized():
            return mine
        device = torch.device("cpu") if self.group is not None else trainer.strategy.root_device
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)  # NCCL cannot reduce bool
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        except Exception:  # as Lightning: a failed exchange (a peer gone) does not stop training here
            return mine
        return int(flag.item()) == 1

    def _stop(self, trainer: Any) -> None:
        self.agreed = True
        set_received_sigterm(trainer)
        raise SIGTERMException()

    def at_batch_start(self) -> None:
        """Lightning's per-batch SIGTERM check (multi-rank only): stop before the next batch when the ranks
        agree at a decision point that no callback decided at the previous batch's end."""
        trainer = self._trainer()
        if trainer is None:
            return
        if trainer.training:
            self.arm()
        if self.should_stop(trainer, at_batch_end=False):
            with suppress(Exception):
                if self.group is not None:
                    dist.barrier(group=self.group)  # every rank leaves here together
            self._stop(trainer)


def step_boundary_stop(trainer: Any, group: Any = None, make_group: bool = False) -> StepBoundaryStop:
    """The trainer's :class:`StepBoundaryStop`, created and hooked into the fit loop's per-batch SIGTERM
    check on first use (``group`` is kept from the first call that gives one). ``make_group``: a new one
    gets a gloo group of its own (a collective: call it on every rank)."""
    guard = _GUARDS.get(trainer)
    if guard is None:
        guard = _GUARDS[trainer] = StepBoundaryStop(trainer, group if group is not None or not make_group
                                                    else new_cpu_group())
    elif guard.group is None and group is not None:
        guard.group = group
    def broadcast_sigterm_on_cpu() -> None:  # what the fit loop calls before each batch (multi-rank runs)
        guard.at_batch_start()

    replace_sigterm_broadcast(trainer, broadcast_sigterm_on_cpu)
    return guard


def install_cpu_sigterm_check(trainer: Any, group: Any) -> bool:
    """Stop on SIGTERM at optimizer-step boundaries, agreed over ``group`` (see :class:`StepBoundaryStop`);
    return whether it did. Leaves Lightning alone when ``group`` is None."""
    if group is None:
        return False
    step_boundary_stop(trainer, group)
    return True
