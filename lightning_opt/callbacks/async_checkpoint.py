"""Checkpoints whose only cost to the training loop is a copy into reused pinned host memory."""

from __future__ import annotations

import copy
import os
import random
import re
import shutil
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opt.callbacks._logging import log_metrics

_STEP_RE = re.compile(r"step=(\d+)")


@dataclass
class AsyncCheckpointConfig:
    """Validated settings of :class:`AsyncCheckpoint` (see its docstring)."""

    dirpath: str | None = None
    every_n_steps: int | None = None
    every_minutes: float | None = None
    keep_last_k: int | None = 3
    save_last: bool = True
    save_on_exception: bool = True
    save_on_train_end: bool = True
    decide_every_n_steps: int = 10
    save_rng: bool = True
    prewarm: bool = True
    overlap_copy: bool = False

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError(f"AsyncCheckpoint: every_n_steps={self.every_n_steps}; use >= 1 or None.")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ValueError(f"AsyncCheckpoint: every_minutes={self.every_minutes}; use > 0 or None.")
        if self.keep_last_k is not None and self.keep_last_k < 1:
            raise ValueError(f"AsyncCheckpoint: keep_last_k={self.keep_last_k}; use >= 1 or None (keep all).")
        if self.decide_every_n_steps < 1:
            raise ValueError("AsyncCheckpoint: decide_every_n_steps must be >= 1.")


class _Staging:
    """Reused host buffers, one per distinct tensor storage of the checkpoint.

    Storages are copied whole and views are rebuilt on the copies, so tensors that shared a
    storage (tied embeddings) still share it and ``torch.save`` writes it once, as a sync save
    would. On CUDA the buffers are pinned and the copies are non-blocking on the current stream:
    the host does not wait; the writer thread waits on an event instead.
    """

    def __init__(self) -> None:
        # Free buffers by (nbytes, pinned); a save takes exact-size matches, so after the first
        # save (or ``prewarm``) no allocation happens. Pinned allocation is slow (~0.3 s/GB).
        self.pool: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self.in_use: list[torch.UntypedStorage] = []
        self.events: list[torch.cuda.Event] = []
        self.bytes = 0

    def prewarm(self, objects: list[Any]) -> None:
        """Allocates buffers for the storages in ``objects`` (e.g. model and optimizer state dicts)."""
        seen: set[tuple[str, int]] = set()
        stack = list(objects)
        while stack:
            obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                if obj.layout != torch.strided or type(obj) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                st = obj.untyped_storage()
                key = (str(obj.device), st.data_ptr())
                if key not in seen and st.nbytes():
                    seen.add(key)
                    pin = obj.device.type == "cuda"
                    buf = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
                    self.pool.setdefault((st.nbytes(), pin), []).append(buf)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)

    def stage(
        self, checkpoint: Any, side: torch.cuda.Stream | None = None, side_keys: set | None = None
    ) -> Any:
        """Copies ``checkpoint``'s tensors into host buffers; returns the same structure on them.

        With ``side``, storages in ``side_keys`` (params and optimizer state) are copied on that
        stream, after the current stream's work, so the copy overlaps later compute; the caller
        must make the current stream wait for ``side`` before anything modifies them.
        """
        for buf in self.in_use:  # the previous save is written (the caller waited): reuse
            self.pool.setdefault((buf.nbytes(), buf.is_pinned()), []).append(buf)
        self.in_use = []
        self._by_storage: dict[tuple[str, int], torch.UntypedStorage] = {}
        self.bytes = 0
        self._cuda = False
        self._side, self._side_keys = side, side_keys or set()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        staged = self._walk(checkpoint)
        self.events: list[torch.cuda.Event] = []
        if self._cuda:
            self.events.append(torch.cuda.Event())
            self.events[-1].record()
            if side is not None:
                self.events.append(torch.cuda.Event())
                self.events[-1].record(side)
        del self._by_storage
        self._side = None
        return staged

    def wait(self) -> None:
        for event in getattr(self, "events", []):
            event.synchronize()  # runs in the writer thread; releases the GIL

    def _buffer(self, nbytes: int, pin: bool) -> torch.UntypedStorage:
        free = self.pool.get((nbytes, pin))
        buf = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        self.in_use.append(buf)
        return buf

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided or type(t) not in (torch.Tensor, torch.nn.Parameter):
            # Sparse / tensor subclasses: a plain copy. (Sharded strategies save through DCP instead.)
            return t.detach().to("cpu", copy=True)
        src = t.untyped_storage()
        key = (str(t.device), src.data_ptr())
        dst = self._by_storage.get(key) if src.nbytes() else None
        if dst is None:
            pin = t.device.type == "cuda"
            dst = self._buffer(src.nbytes(), pin)
            if src.nbytes():
                d = torch.empty(0, dtype=torch.uint8).set_(dst)
                s = torch.empty(0, dtype=torch.uint8, device=t.device).set_(src)
                if pin and self._side is not None and key in self._side_keys:
                    with torch.cuda.stream(self._side):
                        d.copy_(s, non_blocking=True)
                else:
                    d.copy_(s, non_blocking=pin)
                self._by_storage[key] = dst
            self.bytes += src.nbytes()
            self._cuda |= pin
        return torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())

    def _walk(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, self._walk(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: self._walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self._walk(v) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # namedtuples too
        # Training goes on while the writer runs: freeze everything else by value now.
        return copy.deepcopy(obj)


class _Capture(CheckpointIO):
    """Stands in for the strategy's CheckpointIO during our saves: hands the dict to the callback."""

    def __init__(self, owner: AsyncCheckpoint) -> None:
        self.owner = owner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.owner._submit(checkpoint, str(path))

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        raise RuntimeError("AsyncCheckpoint's capture IO does not load")

    def remove_checkpoint(self, path: Any) -> None:
        raise RuntimeError("AsyncCheckpoint's capture IO does not remove")


def _fsync(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary name, fsync, rename over ``path``, fsync the directory.

    Saving to a *path* (not a file object) lets torch write tensor bytes with the GIL released.
    """
    dirpath = os.path.dirname(os.path.abspath(path))
    # torch names the records inside the zip after the file's stem; "archive" is what an in-memory
    # save uses, so the file is byte-for-byte the size of a synchronous Lightning save.
    tmpdir = os.path.join(dirpath, ".writing")
    os.makedirs(tmpdir, exist_ok=True)
    tmp = os.path.join(tmpdir, "archive.tmp")
    try:
        torch.save(obj, tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync(dirpath)


class AsyncCheckpoint(Checkpoint):
    """Periodic, atomic, background checkpoints for exact resume.

    At a save point the training loop only queues a copy of the full Lightning checkpoint
    (model, optimizers, schedulers, loops and data position, callbacks' state, and RNG states)
    into pinned host buffers that are reused from save to save; a writer thread waits for the
    copy, writes a temporary file, fsyncs it and renames it into place. At most one save is in
    flight: the next save, the end of training or teardown waits for it and re-raises any write
    error. Old checkpoints are pruned by the writer after the new one is durable, so pruning
    never races a pending save. Files load with ``trainer.fit(ckpt_path=...)``.

    Saves go through ``trainer.save_checkpoint`` (so every hook and strategy sees a normal
    save; on DDP rank 0 writes). Sharded strategies (FSDP2 / ModelParallel, FSDP with sharded
    state dicts) save every rank's shards with ``torch.distributed.checkpoint.async_save`` on a
    gloo group of their own, in Lightning's sharded directory layout. Saves after an exception
    (including Lightning's SIGTERM handling) skip the barrier and block until written, because
    the process is about to end (not with sharded strategies: that would need every rank).

    Args:
        dirpath: folder for checkpoints (default: ``<trainer.default_root_dir>/checkpoints``).
        every_n_steps: save every N global steps.
        every_minutes: save when this many minutes passed since the last save (rank 0 decides
            every ``decide_every_n_steps`` steps and broadcasts).
        keep_last_k: keep the K newest periodic checkpoints (``None``: keep all).
        save_last: maintain a ``last.ckpt`` symlink to the newest checkpoint.
        save_on_exception: save when fit ends with an exception (SIGTERM included).
        save_on_train_end: save when training ends normally.
        decide_every_n_steps: decision interval for ``every_minutes``.
        save_rng: store Python, NumPy, torch and CUDA RNG states and restore them on resume.
        prewarm: after the first step, allocate the host buffers in a background thread so the
            first save does not pay for the (slow) pinned allocation.
        overlap_copy: CUDA only. Copy parameters and optimizer state on a side stream that the
            training stream waits for only at the next optimizer step, so the device-to-host
            copy overlaps the next forward/backward. Only correct if nothing modifies parameters
            or optimizer state in place between a save and the next optimizer step (e.g. a
            callback that edits weights at batch start); buffers are always copied in order.

    Example::

        ckpt = AsyncCheckpoint(every_n_steps=500, keep_last_k=3)
        trainer = Trainer(callbacks=[ckpt])
        trainer.fit(model)                                    # later:
        trainer.fit(model, ckpt_path=f"{ckpt.dirpath}/last.ckpt")
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = None,
        every_minutes: float | None = None,
        keep_last_k: int | None = 3,
        save_last: bool = True,
        save_on_exception: bool = True,
        save_on_train_end: bool = True,
        decide_every_n_steps: int = 10,
        save_rng: bool = True,
        prewarm: bool = True,
        overlap_copy: bool = False,
    ) -> None:
        self.config = AsyncCheckpointConfig(
            dirpath,
            every_n_steps,
            every_minutes,
            keep_last_k,
            save_last,
            save_on_exception,
            save_on_train_end,
            decide_every_n_steps,
            save_rng,
            prewarm,
            overlap_copy,
        )
        self.dirpath = dirpath
        self.last_saved_step = -1
        self.last_path: str | None = None
        self.saves = 0
        self.stall_seconds: list[float] = []  # loop time spent inside each save call
        self.metrics: dict[str, float] = {}
        self._staging = _Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_save_time = time.monotonic()
        self._rng_to_restore: dict[str, Any] | None = None
        self._prewarm_thread: threading.Thread | None = None
        self._trainer: Trainer | None = None
        self._model_key: str | None = None  # set for sharded strategies (DCP directory checkpoints)
        self._gloo: Any = None
        self._dcp_writer: Any = None
        self._dcp_future: Any = None
        self._side_stream: torch.cuda.Stream | None = None
        self._side_pending = False

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._model_key = _sharded_model_key(trainer.strategy)
        if self._model_key is not None and self._gloo is None:
            # async_save's background collectives run on CPU tensors: a gloo group of our own.
            import torch.distributed as dist

            self._gloo = dist.new_group(backend="gloo")
        self._trainer = trainer
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        self.dirpath = os.path.abspath(self.dirpath)
        if trainer.is_global_zero:
            os.makedirs(self.dirpath, exist_ok=True)
        self._last_save_time = time.monotonic()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_to_restore is not None:
            _set_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def _prewarm(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the first optimizer step the state exists; allocate the pinned buffers in the
        # background so that the first save does not pay for them inside the loop.
        if not trainer.is_global_zero or self._prewarm_thread is not None:
            return
        objects = [pl_module.state_dict(), *[opt.state_dict() for opt in trainer.optimizers]]
        device = trainer.strategy.root_device

        def run() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self._staging.prewarm(objects)

        self._prewarm_thread = threading.Thread(target=run, name="AsyncCheckpoint-prewarm", daemon=True)
        self._prewarm_thread.start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step >= 1 and self._prewarm_thread is None and self.config.prewarm:
            self._prewarm(trainer, pl_module)
        if step == self.last_saved_step or step == 0:
            return
        cfg = self.config
        due = cfg.every_n_steps is not None and step % cfg.every_n_steps == 0
        if not due and cfg.every_minutes is not None and step % cfg.decide_every_n_steps == 0:
            elapsed = time.monotonic() - self._last_save_time
            # Clocks differ between ranks: rank 0 decides so that every rank enters the save.
            due = bool(trainer.strategy.broadcast(elapsed >= cfg.every_minutes * 60, src=0))
        if due:
            self.save(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.save_on_train_end and trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.wait()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        try:
            self.wait()
        except Exception as err:  # keep the original exception as the one that propagates
            rank_zero_info(f"AsyncCheckpoint: the pending save failed too: {err}")
        if not self.config.save_on_exception or self.dirpath is None:
            return
        if self._model_key is not None:
            return  # a sharded save needs every rank, and the others may not have failed
        if trainer.global_step in (0, self.last_saved_step) or not trainer.is_global_zero:
            return
        path = self._path(trainer.global_step, "-exception")
        # No barrier and nothing on other ranks (they may not have failed): rank 0 dumps its
        # local, full (DDP-replicated) state and waits for the write, as the process is ending.
        try:
            self._submit(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), path)
            self.wait()
            rank_zero_info(f"AsyncCheckpoint: saved {path} after {type(exception).__name__}")
        except Exception as err:
            rank_zero_info(f"AsyncCheckpoint: could not save after the exception: {err}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        try:
            self.wait()
        finally:
            # The process group may be torn down and re-created before the next fit.
            self._gloo = None
            self._dcp_writer = None

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_saved_step": self.last_saved_step, "saves": self.saves}
        if self.config.save_rng:
            state["rng"] = _get_rng()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = int(state_dict["last_saved_step"])
        self.saves = int(state_dict["saves"])
        if self.config.save_rng and "rng" in state_dict:
            # Applied at train start, after Lightning's own setup has drawn whatever it draws.
            self._rng_to_restore = state_dict["rng"]

    # -- saving ---------------------------------------------------------------------------------
    def _path(self, step: int, suffix: str = "") -> str:
        assert self.dirpath is not None
        return os.path.join(self.dirpath, f"step={step:09d}{suffix}.ckpt")

    def save(self, trainer: Trainer, path: str | None = None) -> str:
        """Starts a background save of the current state (all ranks must call it). Returns the path."""
        t0 = time.perf_counter()
        path = path or self._path(trainer.global_step)
        # The previous save's buffers are reused: wait for it (and surface its error) first.
        self.wait()
        self.last_saved_step = trainer.global_step
        self.saves += 1
        if self._model_key is not None:
            self._save_sharded(trainer, path)
        else:
            strategy = trainer.strategy
            original = strategy.checkpoint_io
            strategy.checkpoint_io = _Capture(self)
            try:
                trainer.save_checkpoint(path)
            finally:
                strategy.checkpoint_io = original
        self._last_save_time = time.monotonic()
        self.stall_seconds.append(time.perf_counter() - t0)
        self.metrics = {
            "checkpoint/loop_stall_ms": self.stall_seconds[-1] * 1e3,
            "checkpoint/saves": float(self.saves),
            "checkpoint/staged_gib": self._staging.bytes / 2**30,
        }
        log_metrics(trainer, self.metrics)
        return path

    def _save_sharded(self, trainer: Trainer, path: str) -> None:
        """FSDP / ModelParallel: every rank stages its shards with ``dcp.async_save`` and writes
        them in the background; rank 0 then adds Lightning's ``meta.pt`` and renames the
        directory into place. Same layout as Lightning's own sharded save, so
        ``trainer.fit(ckpt_path=...)`` loads it."""
        import torch.distributed.checkpoint as dcp

        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = {self._model_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        tmp = os.path.join(os.path.dirname(path), ".writing", os.path.basename(path))
        if trainer.is_global_zero:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        trainer.strategy.barrier("AsyncCheckpoint.sharded")
        if self._dcp_writer is None:
            # One writer for all saves: with cache_staged_state_dict its pinned staging buffers are
            # reused from save to save (pinning needs CUDA; on CPU it stages into fresh memory).
            self._dcp_writer = dcp.FileSystemWriter(tmp, cache_staged_state_dict=torch.cuda.is_available())
        self._dcp_future = dcp.async_save(
            state, checkpoint_id=tmp, storage_writer=self._dcp_writer, process_group=self._gloo
        )
        meta = self._staging.stage(checkpoint) if trainer.is_global_zero else None
        self.last_path = path
        self._thread = threading.Thread(
            target=self._finish_sharded,
            args=(self._dcp_future, meta, tmp, path),
            name="AsyncCheckpoint",
            daemon=True,
        )
        self._thread.start()

    def _finish_sharded(self, future: Any, meta: Any, tmp: str, path: str) -> None:
        try:
            future.result()  # on rank 0 this returns after every rank's shards and .metadata are written
            if meta is None:
                return
            # The directory is renamed into place as a whole, so a plain save + fsync is enough here.
            meta_path = os.path.join(tmp, "meta.pt")
            torch.save(meta, meta_path)
            _fsync(meta_path)
            _fsync(tmp)
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
            _fsync(os.path.dirname(path))
            if self.config.save_last:
                _point_last(path)
            self._prune(path)
        except BaseException as err:
            self._error = err

    def _submit(self, checkpoint: dict[str, Any], path: str) -> None:
        self.wait()
        if self._prewarm_thread is not None:
            self._prewarm_thread.join()
        side, keys = None, None
        if self.config.overlap_copy and self._trainer is not None and torch.cuda.is_available():
            trainer = self._trainer
            if trainer.strategy.root_device.type == "cuda":
                if self._side_stream is None:
                    self._side_stream = torch.cuda.Stream(trainer.strategy.root_device)
                side = self._side_stream
                keys = _storage_keys(
                    [*trainer.lightning_module.parameters(), *[o.state for o in trainer.optimizers]]
                )
        staged = self._staging.stage(checkpoint, side, keys)
        self._side_pending = side is not None
        self.last_path = path
        self._thread = threading.Thread(
            target=self._write, args=(staged, path), name="AsyncCheckpoint", daemon=True
        )
        self._thread.start()

    def _write(self, staged: Any, path: str) -> None:
        try:
            self._staging.wait()
            atomic_torch_save(staged, path)
            if self.config.save_last:
                _point_last(path)
            self._prune(path)
        except BaseException as err:  # surfaced by wait() in the training thread
            self._error = err

    def _join_side(self) -> None:
        # Device-side wait (no host block): later work on the training stream runs after the copy.
        if self._side_pending and self._side_stream is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)
        self._side_pending = False

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._join_side()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is on disk; re-raises its error."""
        self._join_side()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(
                f"AsyncCheckpoint: writing {self.last_path} failed: {err}{_disk_hint(err, self.last_path)}"
            ) from err

    def _prune(self, just_written: str | None = None) -> None:
        """Keep the newest ``keep_last_k`` checkpoints of this run's lineage.

        Only checkpoints at or before the step just written are candidates: newer files in the folder
        belong to another run (or to the future of a resumed one) and are never deleted, and neither is
        the file just written or the one ``last.ckpt`` points to.
        """
        k = self.config.keep_last_k
        if k is None or self.dirpath is None:
            return
        found = []
        for name in os.listdir(self.dirpath):
            m = _STEP_RE.fullmatch(name.removesuffix(".ckpt"))
            if m and name.endswith(".ckpt"):
                found.append((int(m.group(1)), name))
        protected = set()
        limit = None
        if just_written is not None:
            protected.add(os.path.basename(just_written))
            m = _STEP_RE.fullmatch(os.path.basename(just_written).removesuffix(".ckpt"))
            limit = int(m.group(1)) if m else None
        last = os.path.join(self.dirpath, "last.ckpt")
        if os.path.islink(last):
            protected.add(os.path.basename(os.readlink(last)))
        newer = [name for step, name in found if limit is not None and step > limit]
        if newer and not getattr(self, "_warned_newer", False):
            self._warned_newer = True
            warnings.warn(
                f"AsyncCheckpoint: {self.dirpath} holds checkpoints newer than this run's step {limit} "
                f"({sorted(newer)[-1]}, ...), probably from another run; they are left alone. Pass "
                "ckpt_path=.../last.ckpt to resume, or use a new dirpath.",
                stacklevel=2,
            )
        candidates = sorted((step, name) for step, name in found if limit is None or step <= limit)
        for _, name in candidates[:-k]:
            if name in protected:
                continue
            target = os.path.join(self.dirpath, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)


def _sharded_model_key(strategy: Any) -> str | None:
    """The key Lightning's sharded save uses for the model, or None for a full-state strategy."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        raise NotImplementedError(
            "AsyncCheckpoint: DeepSpeed saves through its own engine; use ModelCheckpoint."
        )
    if "ModelParallelStrategy" in names:
        return "state_dict" if getattr(strategy, "_save_distributed_checkpoint", True) else None
    if "FSDPStrategy" in names:
        return "model" if getattr(strategy, "_state_dict_type", "sharded") == "sharded" else None
    return None


def _storage_keys(objects: list[Any]) -> set[tuple[str, int]]:
    keys: set[tuple[str, int]] = set()
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            keys.add((str(obj.device), obj.untyped_storage().data_ptr()))
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return keys


def _disk_hint(err: BaseException, path: str | None) -> str:
    """Say so when a failed write looks like a full disk (torch's zip writer hides ENOSPC)."""
    import errno

    if path is None:
        return ""
    folder = os.path.dirname(path) or "."
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
             if n.endswith(".ckpt") and os.path.isfile(os.path.join(folder, n))]
    full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or free < max([64 << 20, *sizes])
    if not full:
        return ""
    return (f" - No space left on device (the disk is full, {free / 2**20:.1f} MiB free in {folder}): free space or point dirpath at "
            "another disk. The previous checkpoint is intact and last.ckpt still points at it.")


def _point_last(path: str) -> None:
    """Atomically repoint ``last.ckpt`` (a relative symlink) at ``path``."""
    dirpath = os.path.dirname(path)
    tmp = os.path.join(dirpath, ".last.ckpt.tmp")
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.symlink(os.path.basename(path), tmp)
    except OSError as err:  # a filesystem without symlinks: keep the checkpoints, skip the link
        warnings.warn(
            f"AsyncCheckpoint: cannot create the last.ckpt symlink in {dirpath}: {err}", stacklevel=2
        )
        return
    os.replace(tmp, os.path.join(dirpath, "last.ckpt"))
    _fsync(dirpath)


def _get_rng() -> dict[str, Any]:
    # Only tensors, ints, floats, strings and tuples: loadable with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
