"""Python GC and CUDA caching-allocator hygiene: predictable collections, memory stats, OOM snapshots."""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_opt._internals import dump_memory_snapshot, record_memory_history
from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics, log_step, optimizer_stepped

_GIB = float(1 << 30)


@dataclass
class CudaMemoryHygieneConfig:
    """Validated settings of :class:`CudaMemoryHygiene` (see its docstring)."""

    gc_every_n_steps: int | None = 100
    gc_generation: int = 2
    freeze_after_setup: bool = True
    disable_automatic_gc: bool = True
    collect_around_eval: bool = True
    empty_cache: Literal["never", "after_validation", "threshold"] = "never"
    empty_cache_threshold_gib: float = 4.0
    log_every_n_steps: int | None = None
    snapshot_on_oom: bool = True
    record_history: bool = False
    snapshot_dir: str | None = None

    def __post_init__(self) -> None:
        if self.gc_every_n_steps is not None and self.gc_every_n_steps < 1:
            raise ValueError(
                f"CudaMemoryHygiene: gc_every_n_steps={self.gc_every_n_steps}; use >= 1 or None."
            )
        if self.gc_generation not in (0, 1, 2):
            raise ValueError(f"CudaMemoryHygiene: gc_generation={self.gc_generation}; use 0, 1 or 2.")
        if self.empty_cache not in ("never", "after_validation", "threshold"):
            raise ValueError(
                f"CudaMemoryHygiene: empty_cache={self.empty_cache!r}; use 'never', 'after_validation' or 'threshold'."
            )
        if self.empty_cache_threshold_gib <= 0:
            raise ValueError("CudaMemoryHygiene: empty_cache_threshold_gib must be > 0.")
        if self.log_every_n_steps is not None and self.log_every_n_steps < 1:
            raise ValueError(
                f"CudaMemoryHygiene: log_every_n_steps={self.log_every_n_steps}; use >= 1 or None."
            )


class CudaMemoryHygiene(KeyedStateCallback):
    """Keeps Python's GC and the CUDA caching allocator out of the step time.

    * After setup: ``gc.collect()``, ``gc.freeze()`` (long-lived objects leave the GC's view) and
      automatic GC off, so no rank pauses for a collection at a random step.
    * ``gc.collect()`` every ``gc_every_n_steps`` global steps (the same step on every rank, so
      no stragglers), and around validation and checkpoint saves.
    * ``torch.cuda.empty_cache()`` only by policy: never (default), after validation, or when
      reserved minus allocated memory exceeds a threshold.
    * Logs allocator counters (host-side numbers: no device sync).
    * On CUDA out-of-memory, writes a memory snapshot (``torch.cuda.memory._dump_snapshot``) and
      says where. With ``record_history=True`` the snapshot carries allocation stack traces.

    On CPU the CUDA parts are a no-op; the GC parts still apply.

    Args:
        gc_every_n_steps: collect every N global steps (``None``: only around eval/checkpoints).
        gc_generation: generation passed to ``gc.collect``.
        freeze_after_setup: ``gc.freeze()`` at fit start.
        disable_automatic_gc: ``gc.disable()`` during fit (restored at teardown).
        collect_around_eval: collect before and after validation and at checkpoint saves.
        empty_cache: ``"never"``, ``"after_validation"`` or ``"threshold"``.
        empty_cache_threshold_gib: for ``"threshold"``: reserved - allocated above this empties the cache.
        log_every_n_steps: how often to log memory stats (default: the Trainer's ``log_every_n_steps``).
        snapshot_on_oom: write a memory snapshot when a CUDA OOM ends the fit.
        record_history: record allocation history (stack traces in the snapshot; costs CPU time).
        snapshot_dir: where snapshots go (default: ``trainer.default_root_dir``).

    Example::

        trainer = Trainer(callbacks=[CudaMemoryHygiene(gc_every_n_steps=200, empty_cache="after_validation")])
    """

    def __init__(
        self,
        gc_every_n_steps: int | None = 100,
        gc_generation: int = 2,
        freeze_after_setup: bool = True,
        disable_automatic_gc: bool = True,
        collect_around_eval: bool = True,
        empty_cache: Literal["never", "after_validation", "threshold"] = "never",
        empty_cache_threshold_gib: float = 4.0,
        log_every_n_steps: int | None = None,
        snapshot_on_oom: bool = True,
        record_history: bool = False,
        snapshot_dir: str | None = None,
    ) -> None:
        self.config = CudaMemoryHygieneConfig(
            gc_every_n_steps,
            gc_generation,
            freeze_after_setup,
            disable_automatic_gc,
            collect_around_eval,
            empty_cache,
            empty_cache_threshold_gib,
            log_every_n_steps,
            snapshot_on_oom,
            record_history,
            snapshot_dir,
        )
        self.collections = 0
        self.cache_empties = 0
        self.metrics: dict[str, float] = {}
        self.snapshot_path: str | None = None
        self._gc_was_enabled: bool | None = None
        self._froze = False
        self._recording = False

    def _cuda(self, trainer: Trainer) -> torch.device | None:
        root = trainer.strategy.root_device
        return root if root.type == "cuda" and torch.cuda.is_available() else None

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        cfg = self.config
        if self._gc_was_enabled is None:
            self._gc_was_enabled = gc.isenabled()
        gc.collect()
        if cfg.freeze_after_setup:
            gc.freeze()
            self._froze = True
        if cfg.disable_automatic_gc:
            gc.disable()
        if self._cuda(trainer) is not None and cfg.record_history and not self._recording:
            record_memory_history(max_entries=100_000)
            self._recording = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        cfg = self.config
        step = trainer.global_step
        stepped = optimizer_stepped(trainer, pl_module, batch_idx)
        if cfg.gc_every_n_steps is not None and stepped and step > 0 and step % cfg.gc_every_n_steps == 0:
            self._collect()
        device = self._cuda(trainer)
        if device is None:
            return
        if not log_step(trainer, pl_module, batch_idx, cfg.log_every_n_steps):
            return
        # Host-side allocator counters: no device sync. The nested form skips memory_stats'
        # flattening and sorting of a few hundred keys.
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        alloc = stats.get("allocated_bytes", {}).get("all", {})
        allocated = alloc.get("current", 0)
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
        metrics = {
            "memory/allocated_gib": allocated / _GIB,
            "memory/reserved_gib": reserved / _GIB,
            "memory/peak_allocated_gib": alloc.get("peak", 0) / _GIB,
            "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "memory/ooms": float(stats.get("num_ooms", 0)),
        }
        if cfg.empty_cache == "threshold" and (reserved - allocated) / _GIB > cfg.empty_cache_threshold_gib:
            torch.cuda.empty_cache()
            self.cache_empties += 1
        metrics["memory/cache_empties"] = float(self.cache_empties)
        self.metrics = metrics
        log_metrics(pl_module, metrics)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.collect_around_eval and not trainer.sanity_checking:
            self._collect()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.collect_around_eval and not trainer.sanity_checking:
            self._collect()
        if self.config.empty_cache == "after_validation" and self._cuda(trainer) is not None:
            torch.cuda.empty_cache()
            self.cache_empties += 1

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.config.collect_around_eval:
            self._collect()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        try:
            self._snapshot(trainer, exception)
        finally:
            self._restore()  # Lightning does not call teardown hooks after an exception

    def _snapshot(self, trainer: Trainer, exception: BaseException) -> None:
        if not (self.config.snapshot_on_oom and isinstance(exception, torch.cuda.OutOfMemoryError)):
            return
        if not torch.cuda.is_available():
            return
        folder = self.config.snapshot_dir or trainer.default_root_dir
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(
            folder, f"oom_snapshot_rank{trainer.global_rank}_step{trainer.global_step}.pickle"
        )
        try:
            dump_memory_snapshot(path)
        except Exception as err:  # never hide the OOM itself behind a snapshot failure
            rank_zero_warn(f"CudaMemoryHygiene: could not write the OOM memory snapshot: {err}")
            return
        self.snapshot_path = path
        # Per-rank message: every rank that ran out of memory writes its own snapshot.
        print(
            f"CudaMemoryHygiene: CUDA out of memory at global step {trainer.global_step}; memory snapshot "
            f"written to {path} (open it at https://pytorch.org/memory_viz).",
            flush=True,
        )

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = None
        if self._recording:
            record_memory_history(None)
            self._recording = False

    @override
    def state_key_settings(self) -> dict[str, Any]:
        return asdict(self.config)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"collections": self.collections, "cache_empties": self.cache_empties}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.collections = int(state_dict["collections"])
        self.cache_empties = int(state_dict["cache_empties"])

    def _collect(self) -> None:
        gc.collect(self.config.gc_generation)
        self.collections += 1
