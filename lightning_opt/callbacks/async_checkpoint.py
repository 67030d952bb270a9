"""Checkpoints whose only cost to the training loop is a copy into reused pinned host memory."""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # Windows: the lock file still names its holder, without the kernel lock
    fcntl = None  # type: ignore[assignment]
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_opt._internals import dump_checkpoint, fsdp_state_dict_type, save_distributed_checkpoint
from lightning_opt.callbacks._logging import KeyedStateCallback, log_metrics
from lightning_opt.strategies._sigterm import StepBoundaryStop, step_boundary_stop, window_closed

_STEP_RE = re.compile(r"step=(\d+)")
_CKPT_RE = re.compile(r"step=(\d+)(-exception)?\.ckpt")
_FAILED_RE = re.compile(r"failed-step=(\d+)\.ckpt")
_LOCK = ".lock"
_HEARTBEAT_S = 20.0  # the lock holder refreshes the lock file's mtime this often
_STALE_S = 120.0  # a lock from another host without a heartbeat for this long belongs to a dead run


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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):  # hashlib releases the GIL on large updates
            digest.update(chunk)
    return digest.hexdigest()


def _unique_tmpdir(dirpath: str) -> str:
    """A fresh folder under ``dirpath/.writing`` named after this process and a random token."""
    tmpdir = os.path.join(dirpath, ".writing", f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmpdir)
    return tmpdir


def atomic_torch_save(obj: Any, path: str, checksum: bool = False) -> None:
    """``torch.save`` to a temporary name unique to this call, fsync, rename over ``path``, fsync the directory.

    With ``checksum``, the file's SHA-256 goes into ``<path>.sha256`` (written and renamed into place
    before the checkpoint itself, so every checkpoint under its final name has its checksum next to
    it). Saving to a *path* (not a file object) lets torch write tensor bytes with the GIL released.
    """
    dirpath = os.path.dirname(os.path.abspath(path))
    # torch names the records inside the zip after the file's stem; "archive" is what an in-memory
    # save uses, so the file is byte-for-byte the size of a synchronous Lightning save.
    tmpdir = _unique_tmpdir(dirpath)
    tmp = os.path.join(tmpdir, "archive.tmp")
    try:
        torch.save(obj, tmp)
        _fsync(tmp)
        if checksum:
            side = os.path.join(tmpdir, "archive.sha256")
            with open(side, "w") as f:
                f.write(f"{_sha256(tmp)}  {os.path.basename(path)}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(side, f"{path}.sha256")
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    _fsync(dirpath)


_VERIFIED: OrderedDict[tuple[Any, ...], bool] = OrderedDict()  # (file identity) -> checksum matched


def verify_checkpoint(path: str) -> bool | None:
    """True when ``path`` matches its ``.sha256`` sidecar, False when it does not, None without one.

    A result is remembered for the file's identity (inode, size, modification times of the file and its
    sidecar), so a resume that checks a file once more before loading it does not hash it twice."""
    real = os.path.realpath(path)
    try:
        with open(f"{real}.sha256") as f:
            want = f.read().split()[0]
        st, side = os.stat(real), os.stat(f"{real}.sha256")
    except (OSError, IndexError):
        return None
    key = (real, st.st_ino, st.st_size, st.st_mtime_ns, side.st_mtime_ns, want)
    if key in _VERIFIED:
        return _VERIFIED[key]
    try:
        ok = _sha256(real) == want
    except OSError:
        return False
    _VERIFIED[key] = ok
    while len(_VERIFIED) > 256:
        _VERIFIED.popitem(last=False)
    return ok


def folder_checkpoints(dirpath: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints of ``dirpath`` under final names (``step=N.ckpt``,
    ``step=N-exception.ckpt``), oldest first; an exception checkpoint sorts after the periodic one of its step."""
    if not os.path.isdir(dirpath):
        return []
    out = []
    for name in os.listdir(dirpath):
        m = _CKPT_RE.fullmatch(name)
        if m:
            out.append((int(m.group(1)), bool(m.group(2)), name))
    return [(step, os.path.join(dirpath, name)) for step, _, name in sorted(out)]


def checkpoint_step(path: str) -> int | None:
    """The global step in a checkpoint's final name (``step=N.ckpt``, ``step=N-exception.ckpt``, through a
    ``last.ckpt`` link too), or None for another name."""
    m = _CKPT_RE.fullmatch(os.path.basename(os.path.realpath(path)))
    return int(m.group(1)) if m else None


def _damage_note(path: str) -> str:
    return f"{path} is damaged (its SHA-256 does not match {path}.sha256)"


def intact_checkpoint(path: str, damaged: set[str] | None = None) -> str:
    """``path`` when it passes its ``.sha256`` check (or has none); else the newest checkpoint of the same
    folder, not newer than ``path``, that passes, with a warning naming both files. Raises ``ValueError``
    when none does. Basenames of damaged files found on the way are added to ``damaged``."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or verify_checkpoint(real) is not False:
        return path
    damaged = set() if damaged is None else damaged
    damaged.add(os.path.basename(real))
    folder = os.path.dirname(real)
    bound = checkpoint_step(real)
    for step, cand in reversed(folder_checkpoints(folder)):
        if cand == real or (bound is not None and step > bound):
            continue
        if verify_checkpoint(cand):
            rank_zero_warn(
                f"AsyncCheckpoint: {_damage_note(real)}; resuming from {cand}, the newest intact checkpoint in "
                f"{folder}. The damaged file is left in place for inspection and never counts as one of the "
                "kept checkpoints."
            )
            return cand
        damaged.add(os.path.basename(cand))
    raise ValueError(
        f"AsyncCheckpoint: {_damage_note(real)} and no older checkpoint in {folder} passes its checksum. "
        "Resume from a copy of the run kept elsewhere, or start without ckpt_path."
    )


def refuse_damaged_checkpoint(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming the file when ``path`` does not match its ``.sha256`` sidecar."""
    if verify_checkpoint(str(path)) is False:
        real = os.path.realpath(path)
        raise ValueError(
            f"checkpoint {str(path)!r}: {_damage_note(real)}, so its contents are not what was saved. Load "
            "another checkpoint of the run (the step=*.ckpt files beside it), or a copy kept elsewhere."
        )


def newest_intact_checkpoint(dirpath: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint of ``dirpath`` that passes its checksum (a file without a sidecar passes) and
    is a readable archive, and the paths of the newer ones skipped as damaged."""
    import zipfile

    skipped = []
    for _, path in reversed(folder_checkpoints(dirpath)):
        ok = verify_checkpoint(path) is not False
        if ok and os.path.isfile(path):
            try:
                with zipfile.ZipFile(path):
                    pass
            except (zipfile.BadZipFile, OSError):
                ok = False
        if ok:
            return path, skipped
        skipped.append(path)
    return None, skipped


def checkpoints_after(dirpath: str, step: int, skip: set[str] | None = None) -> list[str]:
    """Paths of ``dirpath``'s checkpoints of a global step above ``step`` (less those named in ``skip``):
    what a run starting at ``step`` in that folder would overwrite."""
    skip = {os.path.realpath(p) for p in skip or ()}
    return [p for s, p in folder_checkpoints(dirpath) if s > step and os.path.realpath(p) not in skip]


def checkpoint_lineage(path: str) -> str | None:
    """The run lineage recorded by AsyncCheckpoint in the checkpoint at ``path`` (a file, or a sharded
    checkpoint's directory), or None when it has none or cannot be read. A lineage starts with a run's
    first fit and is carried through every resume of it, so files of an earlier process of the same run
    can be told from another run's. Read with ``weights_only=True`` and ``mmap=True``: no code runs and
    the tensors are not read."""
    target = os.path.join(path, "meta.pt") if os.path.isdir(path) else path
    try:
        ckpt = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # damaged, half-written, or not a checkpoint: not ours to claim
        return None
    states = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    for key, state in (states or {}).items():
        if str(key).startswith("AsyncCheckpoint") and isinstance(state, dict) and state.get("lineage"):
            return str(state["lineage"])
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from its owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class _FolderLock:
    """One live writer per checkpoint folder: ``<dirpath>/.lock`` holds an exclusive ``flock`` (released
    by the kernel when the process dies) and says who holds it (pid, host, start time); a heartbeat
    thread refreshes its mtime so that runs on other hosts can tell a dead holder from a live one."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.path = os.path.join(dirpath, _LOCK)
        self.token = uuid.uuid4().hex
        self.fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a message when a dead run's lock was taken over. Raises when busy."""
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a live process
                info = _read_lock(fd)
                os.close(fd)
                raise RuntimeError(self._busy(info)) from None
            try:  # a holder that was releasing may have unlinked the file we opened: retry on the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            info = _read_lock(fd)
            note = None
            if info:
                reason = self._stale(info)
                if reason is None:
                    os.close(fd)
                    raise RuntimeError(self._busy(info))
                note = (f"AsyncCheckpoint: taking over the lock on {self.dirpath} from {_who(info)}: {reason}. "
                        "Its unfinished temporary files are removed; its checkpoints are kept.")
            mine = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _pid_start(os.getpid()),
                    "started": datetime.datetime.now().isoformat(timespec="seconds"), "token": self.token}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            self._stop.clear()
            self._thread = threading.Thread(target=self._heartbeat, name="AsyncCheckpoint-lock", daemon=True)
            self._thread.start()
            return note
        raise RuntimeError(f"AsyncCheckpoint: could not take the lock {self.path}: it keeps being replaced")

    def _heartbeat(self) -> None:
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def _stale(self, info: dict[str, Any]) -> str | None:
        """Why the run named in ``info`` is not running any more, or None when it may still be."""
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and isinstance(pid, int):
            if pid == os.getpid() or not _pid_alive(pid):
                return f"pid {pid} is not running on this host"
            start = info.get("pid_start")
            if start is not None and _pid_start(pid) not in (None, start):
                return f"pid {pid} is not running on this host (the pid now belongs to another process)"
            return None
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except OSError:
            return "its lock file vanished"
        if age > _STALE_S:
            return f"no heartbeat for {age:.0f} s, so that run is not running any more"
        return None

    def _busy(self, info: dict[str, Any] | None) -> str:
        return (
            f"AsyncCheckpoint: the checkpoint folder {self.dirpath} is in use by another run "
            f"({_who(info)}; lock file {self.path}). Two runs writing one folder overwrite each other's "
            "checkpoints: give this run its own dirpath, or stop the other run first. If that run is not "
            f"running any more (e.g. on another host), delete {self.path} (or wait {_STALE_S:.0f} s after it "
            "stopped)."
        )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            info = _read_lock(fd)
            if info and info.get("token") == self.token:
                os.remove(self.path)  # before unlocking: a waiting run then sees a fresh file
        except OSError:
            pass
        finally:
            os.close(fd)


def _read_lock(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        info = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _who(info: dict[str, Any] | None) -> str:
    if not info:
        return "a process that left no details"
    return f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}"


class _VerifyingIO(CheckpointIO):
    """Stands in for the strategy's CheckpointIO while a fit restores: checks the file's checksum and
    loads the newest intact checkpoint of the folder instead of a damaged one."""

    def __init__(self, owner: AsyncCheckpoint, inner: CheckpointIO) -> None:
        self.owner, self.inner = owner, inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        return self.inner.load_checkpoint(self.owner._intact(path), **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def default_dirpath(trainer: Trainer) -> str:
    """``<log_dir>/checkpoints`` of the run: the first logger's ``<save_dir>/<name>/<version>/checkpoints`` (the
    folder Lightning's ``ModelCheckpoint`` picks), else ``<default_root_dir>/checkpoints``; rank 0's choice."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        path = os.path.join(save_dir, str(logger.name), version, "checkpoints")
    else:
        path = os.path.join(trainer.default_root_dir, "checkpoints")
    return trainer.strategy.broadcast(path, src=0)  # a logger's next version is found on each rank's disk view


class AsyncCheckpoint(KeyedStateCallback, Checkpoint):
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
    gloo group of their own, in Lightning's sharded directory layout.

    Saves happen at optimizer-step boundaries only (with ``accumulate_grad_batches > 1``, at the
    micro-batch that ends a window). On SIGTERM the run finishes the current optimizer step (the
    rest of its accumulation window), every rank agrees at that boundary (a SIGTERM to any one rank
    is enough), saves ``step=N-exception.ckpt`` (exact: resuming from it equals the run that was not
    interrupted, bit for bit), and exits with status 0; before the first optimizer step it exits
    without saving. After any other exception, the state is not at a step boundary: it is written
    to ``failed-step=N.ckpt`` for inspection only, ``last.ckpt`` keeps pointing at the newest exact
    checkpoint, and resuming from ``last.ckpt`` is exact (see ``docs/reliability.md``).

    Args:
        dirpath: folder for checkpoints (default: the run's own ``<log_dir>/checkpoints``, the first logger's
            ``<save_dir>/<name>/<version>/checkpoints`` as for Lightning's ``ModelCheckpoint``, e.g.
            ``runs/gpt2-demo/version_3/checkpoints``; without a logger ``<trainer.default_root_dir>/checkpoints``).
        every_n_steps: save every N global steps.
        every_minutes: save when this many minutes passed since the last save (rank 0 decides
            every ``decide_every_n_steps`` steps and broadcasts).
        keep_last_k: keep the K newest periodic checkpoints (``None``: keep all).
        save_last: maintain a ``last.ckpt`` symlink to the newest checkpoint.
        save_on_exception: on SIGTERM, save at the optimizer-step boundary where the run stops; after
            another exception, write ``failed-step=N.ckpt`` (not resumable exactly; ``last.ckpt`` stays).
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
        self._lock: _FolderLock | None = None
        self._verifying: _VerifyingIO | None = None
        self._damaged: set[str] = set()  # files of the folder whose checksum did not match
        self._run_token = ""  # names this run's temporary folder for sharded saves
        self._own_paths: set[str] = set()  # real paths of the checkpoints this callback saved
        self.lineage: str | None = None  # this run's id, carried through resumes (see checkpoint_lineage)
        self._refused = False  # a save would have overwritten another run's checkpoint
        self._stop: StepBoundaryStop | None = None

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._model_key = _sharded_model_key(trainer.strategy)
        if self._model_key is not None and self._gloo is None:
            # async_save's background collectives run on CPU tensors: a gloo group of our own.
            import torch.distributed as dist

            self._gloo = dist.new_group(backend="gloo")
        self._trainer = trainer
        if self.config.dirpath is None:  # the run's own folder, resolved for each fit (its logger's version)
            self.dirpath = default_dirpath(trainer)
        self.dirpath = os.path.abspath(self.dirpath)
        if trainer.is_global_zero:
            os.makedirs(self.dirpath, exist_ok=True)
        self._last_save_time = time.monotonic()
        if stage != "fit":
            return
        # Rank 0 writes (or, sharded, renames every rank's shards into place): it takes the folder's
        # lock and tells the other ranks, so that a refusal stops every rank.
        error, note = None, None
        if trainer.is_global_zero and (self._lock is None or self._lock.dirpath != self.dirpath):
            self._release_lock()
            lock = _FolderLock(self.dirpath)
            try:
                note = lock.acquire()
                self._lock = lock
                shutil.rmtree(os.path.join(self.dirpath, ".writing"), ignore_errors=True)  # dead writers' leftovers
            except RuntimeError as err:
                error = str(err)
        token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # A fit that restores a checkpoint takes over its lineage in load_state_dict, after setup.
        lineage = self.lineage or uuid.uuid4().hex
        error, self._run_token, self.lineage = trainer.strategy.broadcast((error, token, lineage), src=0)
        if error:
            raise RuntimeError(error)
        if note:
            rank_zero_warn(note)
        # Check the checksum of the file this fit restores from (Lightning loads it after setup).
        self._verifying = _VerifyingIO(self, trainer.strategy.checkpoint_io)
        trainer.strategy.checkpoint_io = self._verifying

    def _restore_io(self, trainer: Trainer) -> None:
        if self._verifying is not None and trainer.strategy.checkpoint_io is self._verifying:
            trainer.strategy.checkpoint_io = self._verifying.inner
        self._verifying = None

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_io(trainer)  # the checkpoint is restored by now

    def _arm_stop(self, trainer: Trainer) -> None:
        # Runs on every rank (creating the agreement's gloo group is a collective), after Lightning
        # installed its SIGTERM handler for this fit.
        self._stop = step_boundary_stop(trainer, make_group=True)
        self._stop.arm()

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm_stop(trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm_stop(trainer)
        self._refused = False
        if trainer.is_global_zero and self.dirpath is not None and self._model_key is None:
            newer = checkpoints_after(self.dirpath, trainer.global_step, skip=self._own_paths)
            newer = [p for p in newer if not self._same_run(p)]
            if newer:
                rank_zero_warn(
                    f"AsyncCheckpoint: {self.dirpath} holds checkpoints of another run past step "
                    f"{trainer.global_step} ({', '.join(os.path.basename(p) for p in newer[-3:])}); this run never "
                    "overwrites them and stops if it comes to save under one of their names. Give it a folder of "
                    "its own, or resume that run from its last.ckpt"
                )
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
        cfg = self.config
        # Only where the optimizer just stepped: mid-window the partial gradient is in no checkpoint.
        boundary = window_closed(trainer)
        if self._stop is not None and self._stop.should_stop(trainer):  # every rank asks at the same batches
            # Lightning raises SIGTERMException right after this batch, on every rank. Saving here, not in
            # on_exception, stores the loop counters of a save at a batch's end, as every periodic save
            # does; a save in on_exception would count this batch as completed twice on resume.
            if boundary and step > 0 and step != self.last_saved_step and cfg.save_on_exception:
                path = self.save(trainer, self._path(step, "-exception"))
                self.wait()
                rank_zero_info(f"AsyncCheckpoint: saved {path} after SIGTERM")
            return
        if not boundary or step == self.last_saved_step or step == 0:
            return
        due = cfg.every_n_steps is not None and step % cfg.every_n_steps == 0
        if not due and cfg.every_minutes is not None and step % cfg.decide_every_n_steps == 0:
            elapsed = time.monotonic() - self._last_save_time
            # Clocks differ between ranks: rank 0 decides so that every rank enters the save.
            due = bool(trainer.strategy.broadcast(elapsed >= cfg.every_minutes * 60, src=0))
        if due:
            self.save(trainer)
            log_metrics(pl_module, self.metrics)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.config.save_on_train_end and trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.wait()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        self._restore_io(trainer)
        try:
            if isinstance(exception, SIGTERMException):
                self._wait_quietly()  # the step-boundary save (if any) was made at the batch's end
            else:
                self._save_on_exception(trainer, type(exception).__name__)
        finally:
            self._release_lock()

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception as err:  # keep the original exception as the one that propagates
            rank_zero_info(f"AsyncCheckpoint: the pending save failed too: {err}")

    def _save_on_exception(self, trainer: Trainer, why: str) -> None:
        """After an exception (not SIGTERM) the state is not at a step boundary (a window's partial
        gradient, a batch drawn but not trained): it goes to ``failed-step=N.ckpt`` for inspection, outside
        the resumable checkpoints; ``last.ckpt`` and pruning ignore it."""
        self._wait_quietly()
        if not self.config.save_on_exception or self.dirpath is None:
            return
        if self._lock is None or self._refused:
            return  # the folder belongs to another run (or setup never got that far): write nothing
        if self._model_key is not None:
            return  # a sharded save needs every rank, and the others may not have failed
        if trainer.global_step in (0, self.last_saved_step) or not trainer.is_global_zero:
            return
        path = os.path.join(self.dirpath, f"failed-step={trainer.global_step:09d}.ckpt")
        # No barrier and nothing on other ranks (they may not have failed): rank 0 dumps its
        # local, full (DDP-replicated) state and waits for the write, as the process is ending.
        try:
            self._submit(dump_checkpoint(trainer, weights_only=False), path, resumable=False)
            self.wait()
            rank_zero_info(f"AsyncCheckpoint: wrote {path} after {why}, for inspection: it is not at an "
                           f"optimizer-step boundary; resume from {os.path.join(self.dirpath, 'last.ckpt')}")
        except Exception as err:
            rank_zero_info(f"AsyncCheckpoint: could not save after the exception: {err}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_io(trainer)
        try:
            self.wait()
        finally:
            # The process group may be torn down and re-created before the next fit.
            self._gloo = None
            self._dcp_writer = None
            if stage == "fit":
                self._release_lock()
                with contextlib.suppress(OSError, TypeError):  # the staging folder, once empty (no dirpath: None)
                    os.rmdir(os.path.join(self.dirpath, ".writing"))

    @override
    def state_key_settings(self) -> dict[str, Any]:
        cfg = self.config
        return {"dirpath": cfg.dirpath, "every_n_steps": cfg.every_n_steps, "every_minutes": cfg.every_minutes}

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"last_saved_step": self.last_saved_step, "saves": self.saves, "lineage": self.lineage}
        if self.config.save_rng:
            state["rng"] = _get_rng()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = int(state_dict["last_saved_step"])
        self.saves = int(state_dict["saves"])
        if state_dict.get("lineage"):
            self.lineage = str(state_dict["lineage"])
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
        clash = self._clash(trainer, path)
        if clash is not None:
            self._refused = True
            raise RuntimeError(clash)
        # The previous save's buffers are reused: wait for it (and surface its error) first.
        self.wait()
        self._own_paths.add(os.path.realpath(path))
        self.last_saved_step = trainer.global_step
        self.saves += 1
        if self._model_key is not None:
            self._save_sharded(trainer, path)
        else:
            strategy = trainer.strategy
            original = strategy.checkpoint_io
            strategy.checkpoint_io = _Capture(self)
            try:
                trainer.save_checkpoint(path, weights_only=False)  # the whole training state: resumable
            finally:
                strategy.checkpoint_io = original
        self._last_save_time = time.monotonic()
        self.stall_seconds.append(time.perf_counter() - t0)
        self.metrics = {
            "checkpoint/loop_stall_ms": self.stall_seconds[-1] * 1e3,
            "checkpoint/saves": float(self.saves),
            "checkpoint/staged_gib": self._staging.bytes / 2**30,
        }
        return path

    def _clash(self, trainer: Trainer, path: str) -> str | None:
        """Why ``path`` must not be written (it exists and another run wrote it), agreed by every rank."""
        error = None
        if (
            trainer.is_global_zero
            and os.path.lexists(path)
            and os.path.realpath(path) not in self._own_paths
            and not self._same_run(path)
        ):
            error = (
                f"AsyncCheckpoint: {path} exists and another run wrote it; this run stops rather than overwrite "
                "it (its own earlier checkpoints are kept). Resume that run with ckpt_path=<its last.ckpt>, or give "
                "this run a folder of its own (AsyncCheckpoint(dirpath=...) or another logger version)"
            )
        return trainer.strategy.broadcast(error, src=0)

    def _same_run(self, path: str) -> bool:
        """Whether ``path`` was written by an earlier process of this run (the one this fit resumed), e.g.
        killed after renaming that file into place and before repointing ``last.ckpt``: such a file is
        this run's to write again."""
        return self.lineage is not None and checkpoint_lineage(path) == self.lineage

    def _save_sharded(self, trainer: Trainer, path: str) -> None:
        """FSDP / ModelParallel: every rank stages its shards with ``dcp.async_save`` and writes
        them in the background; rank 0 then adds Lightning's ``meta.pt`` and renames the
        directory into place. Same layout as Lightning's own sharded save, so
        ``trainer.fit(ckpt_path=...)`` loads it."""
        import torch.distributed.checkpoint as dcp

        checkpoint = dump_checkpoint(trainer, weights_only=False)
        state = {self._model_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        tmp = os.path.join(os.path.dirname(path), ".writing", self._run_token, os.path.basename(path))
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
            args=(self._dcp_future, meta, tmp, path, _skip_streak_start(trainer)),
            name="AsyncCheckpoint",
            daemon=True,
        )
        self._thread.start()

    def _finish_sharded(self, future: Any, meta: Any, tmp: str, path: str, healthy_before: int | None) -> None:
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
            shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)
            if self.config.save_last:
                _point_last(path)
            self._prune(path, healthy_before)
        except BaseException as err:
            self._error = err

    def _submit(self, checkpoint: dict[str, Any], path: str, resumable: bool = True) -> None:
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
        # The checkpoint dump resolved NaNSkip's pending decisions: a skip streak known now protects
        # the newest checkpoint from before it.
        healthy_before = _skip_streak_start(self._trainer)
        self._thread = threading.Thread(
            target=self._write, args=(staged, path, healthy_before, resumable), name="AsyncCheckpoint", daemon=True
        )
        self._thread.start()

    def _write(self, staged: Any, path: str, healthy_before: int | None, resumable: bool = True) -> None:
        try:
            self._staging.wait()
            atomic_torch_save(staged, path, checksum=True)  # hashed here, off the training thread
            if not resumable:
                _drop_older_failed(path)
                return
            self._damaged.discard(os.path.basename(path))
            if self.config.save_last:
                _point_last(path)
            self._prune(path, healthy_before)
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

    def _prune(self, just_written: str | None = None, healthy_before: int | None = None) -> None:
        """Keep the newest ``keep_last_k`` verified checkpoints of this run's lineage.

        Only files this callback wrote are ever deleted: another run's checkpoints in the folder (an earlier
        process of a resumed run included) stay, though they count towards K. Only checkpoints at or before
        the step just written are candidates, and neither the file just written nor the one ``last.ckpt``
        points to is deleted. Only files with a checksum that were not
        found damaged count towards K (a damaged or unverified file never pushes an intact one out), and
        during a run of skipped steps (NaNSkip) the newest checkpoint from before the step preceding the
        first skip is kept: the last healthy one.
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
            m = _CKPT_RE.fullmatch(os.path.basename(just_written))
            limit = int(m.group(1)) if m else None
        last = os.path.join(self.dirpath, "last.ckpt")
        if os.path.islink(last):
            protected.add(os.path.basename(os.readlink(last)))
        warned = getattr(self, "_warned_newer", False)
        newer = [] if warned else [
            name for step, name in found
            if limit is not None and step > limit and not self._same_run(os.path.join(self.dirpath, name))
        ]
        if newer:
            self._warned_newer = True
            warnings.warn(
                f"AsyncCheckpoint: {self.dirpath} holds checkpoints newer than this run's step {limit} "
                f"({sorted(newer)[-1]}, ...), probably from another run; they are left alone. Pass "
                "ckpt_path=.../last.ckpt to resume, or use a new dirpath.",
                stacklevel=2,
            )
        candidates = sorted((step, name) for step, name in found if limit is None or step <= limit)
        if healthy_before is not None:
            healthy = self.newest_checkpoint_before(healthy_before)
            if healthy is not None:
                protected.add(os.path.basename(healthy))
        kept = 0
        for _, name in reversed(candidates):
            if kept < k:
                target = os.path.join(self.dirpath, name)  # sharded (directory) checkpoints carry no checksum
                trusted = name not in self._damaged and (os.path.isdir(target) or os.path.exists(f"{target}.sha256"))
                kept += trusted
                continue
            own = os.path.realpath(os.path.join(self.dirpath, name)) in self._own_paths
            if name in protected or not own:  # another run's (or an earlier process's) file
                continue
            target = os.path.join(self.dirpath, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
            if os.path.exists(f"{target}.sha256"):
                os.remove(f"{target}.sha256")

    def _checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of the checkpoints in the folder under final names, periodic and exception, oldest first."""
        return [] if self.dirpath is None else folder_checkpoints(self.dirpath)

    def newest_checkpoint_before(self, step: int) -> str | None:
        """The newest checkpoint of the folder from before global step ``step``, not found damaged.

        A checkpoint of step ``s`` holds the updates of steps ``0 .. s-1``; this returns the newest with
        ``s < step``. For a divergence whose first skipped step is ``step``, that is the last healthy
        checkpoint: it does not hold the update right before the first skip (often one huge, finite step).
        """
        for s, path in reversed(self._checkpoints()):
            if s < step and os.path.basename(path) not in self._damaged:
                return path
        return None

    def _intact(self, path: Any) -> Any:
        """``path`` when it is intact (or has no checksum); else the newest intact checkpoint of its folder,
        whichever folder that is (a resume from another run's folder is checked too)."""
        if str(path) == "last":
            found = self._checkpoints()
            if not found:
                return path
            path = found[-1][1]
        if not isinstance(path, (str, os.PathLike)):
            return path
        own = self.dirpath is not None and os.path.dirname(os.path.realpath(path)) == os.path.realpath(self.dirpath)
        damaged: set[str] = set()
        try:
            return intact_checkpoint(str(path), damaged)
        finally:
            if own:
                self._damaged |= damaged


def _skip_streak_start(trainer: Trainer | None) -> int | None:
    """The first skipped step of a run of skipped steps in progress, from any callback that reports one
    (``NaNSkip.skip_streak_start``); None when the last decided step was taken."""
    if trainer is None:
        return None
    starts = [getattr(cb, "skip_streak_start", None) for cb in trainer.callbacks]
    starts = [s for s in starts if isinstance(s, int)]
    return min(starts) if starts else None


def _drop_older_failed(path: str) -> None:
    """Keep one ``failed-step=N.ckpt`` per folder: the one just written."""
    folder, keep = os.path.dirname(path), os.path.basename(path)
    for name in os.listdir(folder):
        if name != keep and _FAILED_RE.fullmatch(name):
            for target in (os.path.join(folder, name), os.path.join(folder, f"{name}.sha256")):
                with contextlib.suppress(OSError):
                    os.remove(target)


def _sharded_model_key(strategy: Any) -> str | None:
    """The key Lightning's sharded save uses for the model, or None for a full-state strategy."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        raise NotImplementedError(
            "AsyncCheckpoint: DeepSpeed saves through its own engine; use ModelCheckpoint."
        )
    if "ModelParallelStrategy" in names:
        return "state_dict" if save_distributed_checkpoint(strategy) else None
    if "FSDPStrategy" in names:
        return "model" if fsdp_state_dict_type(strategy) == "sharded" else None
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


def _error_chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _disk_hint(err: BaseException, path: str | None) -> str:
    """Say so when a failed write looks like a full disk, a disk quota or a file-size limit (torch's zip
    writer hides the errno: ENOSPC, EDQUOT and EFBIG all surface as "unexpected pos"), and what survived."""
    import errno

    if path is None:
        return ""
    folder = os.path.dirname(path) or "."
    try:
        free = shutil.disk_usage(folder).free
        sizes = [os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                 if n.endswith(".ckpt") and os.path.isfile(os.path.join(folder, n))]
    except OSError:
        return ""
    chain = _error_chain(err)
    codes = {e.errno for e in chain if isinstance(e, OSError)}
    text = " ".join(str(e) for e in chain)
    full = errno.ENOSPC in codes or free < max([64 << 20, *sizes])
    limited = bool(codes & {errno.EDQUOT, errno.EFBIG}) or "unexpected pos" in text or "file write failed" in text
    if full:
        why = f"No space left on device (the disk is full, {free / 2**20:.1f} MiB free in {folder})"
        fix = "free space or point dirpath at another disk"
    elif limited:
        why = (f"{path} could not be written, most likely a disk quota, a file-size limit (ulimit -f) or a full "
               f"disk ({free / 2**20:.1f} MiB free in {folder})")
        fix = "raise the quota or limit, free space, or point dirpath at another disk"
    else:
        return ""
    last = os.path.join(folder, "last.ckpt")
    target = os.path.realpath(last) if os.path.lexists(last) else None
    if target is not None and os.path.isfile(target) and target != os.path.realpath(path):
        kept = f"The previous checkpoint {target} is intact and last.ckpt still points at it."
    else:
        kept = "No earlier checkpoint of this folder is affected."
    return f" - {why}: {fix}. {kept}"


def _point_last(path: str) -> None:
    """Atomically repoint ``last.ckpt`` (a relative symlink) at ``path``."""
    dirpath = os.path.dirname(path)
    tmp = os.path.join(dirpath, f".last.ckpt.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
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
