"""Every use lightning-opt makes of a Lightning or torch attribute with no public equivalent, in one place.

Each function here wraps one private attribute. torch's are checked when this module is imported,
Lightning's classes by :func:`check_lightning` (the callbacks and strategies call it when imported) and
instance attributes when first read; a missing one raises an error naming the Lightning and torch versions
and the attribute, so an unsupported release fails at start-up instead of changing behaviour silently.
``pyproject.toml`` pins the tested range.

Why each stays private:

* ``_CheckpointConnector.dump_checkpoint``: the checkpoint dictionary without writing it; Lightning's
  public ``Trainer.save_checkpoint`` always writes through the strategy's ``CheckpointIO``.
* ``_TrainingEpochLoop._broadcast_sigterm_tensor``: the per-batch SIGTERM agreement has no hook.
* ``Trainer._signal_connector`` (``received_sigterm``, ``_original_handlers``): stopping at an optimizer-step
  boundary needs to set the flag Lightning's loops read, and a SIGTERM handler of our own keeps calling the
  handler that was installed before the fit, as Lightning's does.
* ``Trainer._val_check_time_interval``: a time-based ``val_check_interval`` leaves the public
  ``val_check_interval`` unset; the parsed interval lives only here.
* ``ModelParallelStrategy._save_distributed_checkpoint`` and ``FSDPStrategy._state_dict_type``: the
  strategies' checkpoint layout, read-only.
* ``torch._scaled_mm``: ``torch.nn.functional.scaled_mm`` exists in torch 2.13, but its scaling-recipe
  argument changed form between releases (a Python ``Enum`` with ``Tensorwise`` before, a C++ enum with
  ``TensorWise`` now), so the FP8 ops keep the stable private op.
* ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``: torch's documented memory-snapshot
  tools, public in all but name.
* ``trainer.fit_loop.epoch_loop.max_steps``: ``Trainer.max_steps`` has no setter, and a run's length from a token
  budget needs the world size Lightning resolves when it builds the Trainer (``devices: auto``).
* A per-instance subclass for an LR scheduler's ``step``: no public hook sees a scheduler stepped by
  hand (manual optimization), and an instance attribute would end up in the scheduler's ``state_dict``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def _versions() -> str:
    lightning = sys.modules.get("lightning")
    found = getattr(lightning, "__version__", None)
    if found is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("lightning")
        except PackageNotFoundError:
            found = "not installed"
    return f"lightning {found}, torch {torch.__version__}"


def _missing(owner: str, attribute: str) -> RuntimeError:
    return RuntimeError(
        f"lightning-opt needs {owner}.{attribute}, which this installation ({_versions()}) does not have; "
        "install the versions pinned in lightning-opt's pyproject.toml."
    )


def _require(objects: list[tuple[Any, str, str]]) -> None:
    for obj, name, attribute in objects:
        if not hasattr(obj, attribute):
            raise ImportError(str(_missing(name, attribute)))


# torch's at import; Lightning's (importing Lightning takes seconds, which the ops do not need) on first use.
_require([
    (torch, "torch", "_scaled_mm"),
    (torch.cuda.memory, "torch.cuda.memory", "_record_memory_history"),
    (torch.cuda.memory, "torch.cuda.memory", "_dump_snapshot"),
])


@functools.cache
def check_lightning() -> None:
    """Raise ImportError if the installed Lightning lacks a private attribute used here (runs once)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    _require([
        (_CheckpointConnector, "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector",
         "dump_checkpoint"),
        (_TrainingEpochLoop, "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop",
         "_broadcast_sigterm_tensor"),
    ])


def _instance_attribute(obj: Any, attribute: str) -> Any:
    check_lightning()
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _missing(type(obj).__name__, attribute) from None


# -- Lightning ---------------------------------------------------------------------------------------------
def dump_checkpoint(trainer: Any, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dictionary ``Trainer.save_checkpoint`` would write, without writing it."""
    return _instance_attribute(trainer, "_checkpoint_connector").dump_checkpoint(weights_only=weights_only)


def val_check_time_interval(trainer: Any) -> float | None:
    """Seconds of a time-based ``Trainer(val_check_interval=...)``, None for a step- or epoch-based one."""
    return _instance_attribute(trainer, "_val_check_time_interval")


def save_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` saves a sharded (distributed) checkpoint."""
    return bool(_instance_attribute(strategy, "_save_distributed_checkpoint"))


def fsdp_state_dict_type(strategy: Any) -> str:
    """``FSDPStrategy(state_dict_type=...)``: ``"sharded"`` or ``"full"``."""
    return str(_instance_attribute(strategy, "_state_dict_type"))


def replace_sigterm_broadcast(trainer: Any, broadcast: Callable[[], None]) -> None:
    """Make the fit loop call ``broadcast`` where it broadcasts the per-batch SIGTERM flag."""
    loop = trainer.fit_loop.epoch_loop
    _instance_attribute(loop, "_broadcast_sigterm_tensor")
    loop._broadcast_sigterm_tensor = broadcast


def set_received_sigterm(trainer: Any) -> None:
    """Set the flag ``Trainer.received_sigterm`` reads: the loops raise ``SIGTERMException`` at their next check."""
    _instance_attribute(trainer, "_signal_connector").received_sigterm = True


def sigterm_handler_before_fit(trainer: Any) -> Any:
    """The SIGTERM handler that was installed before Lightning installed its own for this fit (or None)."""
    connector = _instance_attribute(trainer, "_signal_connector")
    import signal

    return _instance_attribute(connector, "_original_handlers").get(signal.SIGTERM)


def set_max_steps(trainer: Any, steps: int) -> None:
    """Set ``trainer.max_steps`` on a Trainer that has not started fitting (Lightning reads it when fit starts)."""
    loop = _instance_attribute(trainer.fit_loop, "epoch_loop")
    _instance_attribute(loop, "max_steps")
    loop.max_steps = steps
    if trainer.max_steps != steps:
        raise RuntimeError(f"{_versions()}: setting fit_loop.epoch_loop.max_steps={steps} left Trainer.max_steps at "
                           f"{trainer.max_steps}; this Lightning release keeps max_steps elsewhere")


# -- torch -------------------------------------------------------------------------------------------------
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` of FP8 ``a`` (row-major) and ``b`` (column-major), per-tensor scales."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def record_memory_history(max_entries: int | None) -> None:
    """Start (``max_entries``) or stop (None) torch's CUDA allocator history for memory snapshots."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write torch's CUDA memory snapshot (open it at pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


# -- Python objects ----------------------------------------------------------------------------------------
def override_step(scheduler: Any, step: Callable[..., Any]) -> type:
    """Route ``scheduler.step(...)`` to ``step(original_step, *args, **kwargs)``; returns the class to restore.

    The override lives on a per-instance subclass, not as an instance attribute: schedulers put their whole
    ``__dict__`` into ``state_dict()``, and a closure there cannot be saved.
    """
    cls = type(scheduler)

    def wrapped(this: Any, *args: Any, **kwargs: Any) -> Any:
        return step(lambda *a, **k: cls.step(this, *a, **k), *args, **kwargs)

    scheduler.__class__ = type(cls.__name__, (cls,), {"step": wrapped, "__module__": cls.__module__})
    return cls


def restore_class(obj: Any, cls: type) -> None:
    """Undo :func:`override_step`."""
    obj.__class__ = cls
