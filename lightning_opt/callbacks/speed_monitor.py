"""Throughput, MFU and a per-step time split, measured without per-step host-device syncs."""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opt.callbacks._logging import KeyedStateCallback, log_every, log_metrics, optimizer_stepped

# Dense peak tensor-core FLOP/s of one Hopper GPU (without 2:4 sparsity): half the "with sparsity" figures of
# NVIDIA's datasheets. H100 SXM / PCIe / NVL: the H100 Tensor Core GPU datasheet,
# https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (SXM and PCIe as in Lightning's
# table). H200 SXM / NVL: the H200 datasheet, https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446
# (its columns equal H100 SXM's and H100 NVL's). Lightning 2.6's table matches H200 only with "SXM1"/"NVL1" in the
# name, lists sparse figures for it, and lists H100 NVL per pair of cards: 2x one device's dense peak.
_H100_SXM = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12}
_H100_NVL = {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12}
_HOPPER_DENSE_FLOPS: dict[str, dict[str, float]] = {
    "h100 sxm": _H100_SXM,
    "h100 pcie": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12, "fp8": 1513e12},
    "h100 nvl": _H100_NVL,
    "h200 sxm": _H100_SXM,
    "h200 nvl": _H100_NVL,
}
_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PEAK_PRECISIONS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
_LIGHTNING_DTYPES: dict[str, torch.dtype | str] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": "tfloat32",
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def hopper_chip(device_name: str) -> str | None:
    """The key of ``device_name`` (as ``torch.cuda.get_device_name`` reports it) in the Hopper peak table:
    ``"NVIDIA H100 80GB HBM3"`` is ``"h100 sxm"``, ``"NVIDIA H200 NVL"`` is ``"h200 nvl"``; None for other GPUs
    (a GH200 too)."""
    name = device_name.lower()
    if re.search(r"\bh200\b", name):
        return "h200 nvl" if "nvl" in name else "h200 sxm"
    if re.search(r"\bh100\b", name):
        if "nvl" in name:
            return "h100 nvl"
        if "pcie" in name or "hbm2e" in name:
            return "h100 pcie"
        return "h100 sxm"  # "NVIDIA H100 80GB HBM3", "NVIDIA H100"
    return None


def peak_precision(precision: str) -> str:
    """The peak column (one of :data:`PEAK_PRECISIONS`) for a Lightning precision string: ``transformer-engine*``
    is fp8, ``bf16*`` bf16, ``16*`` fp16, ``64*`` fp64; 32-bit is tf32 unless
    ``torch.get_float32_matmul_precision()`` is ``"highest"`` (as Lightning counts it)."""
    if "transformer-engine" in precision:
        return "fp8"
    if "bf16" in precision:
        return "bf16"
    if "16" in precision:
        return "fp16"
    if "64" in precision:
        return "fp64"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(
    device: torch.device | str | None = None, dtype: torch.dtype | str = torch.bfloat16
) -> float | None:
    """Dense peak FLOP/s of one ``device`` (default: the current GPU) for ``dtype`` (a torch dtype or one of
    :data:`PEAK_PRECISIONS`). H100 and H200 from NVIDIA's datasheets (the table above), other GPUs from Lightning's
    table (:func:`lightning.fabric.utilities.throughput.get_available_flops`, which has no fp8 column); None on CPU
    or for a device or dtype neither lists."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    name = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in PEAK_PRECISIONS:
        raise ValueError(
            f"peak_flops: dtype {dtype!r} has no peak column; use a torch dtype or one of {PEAK_PRECISIONS}"
        )
    if device.type != "cuda":
        return None
    chip = hopper_chip(torch.cuda.get_device_name(device))
    if chip is not None and name in _HOPPER_DENSE_FLOPS[chip]:
        return _HOPPER_DENSE_FLOPS[chip][name]
    if name not in _LIGHTNING_DTYPES:
        return None
    lightning_dtype = _LIGHTNING_DTYPES[name]
    if name == "tf32" and torch.cuda.get_device_capability(device) < (8, 0):
        lightning_dtype = torch.float32  # no TF32 before Ampere: float32 matmuls run in float32
    flops = get_available_flops(device, lightning_dtype)
    return float(flops) if flops else None


def peak_flops_for(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for a Lightning precision string (see :func:`peak_precision` and
    :func:`peak_flops`); None on CPU or for a device neither table lists."""
    return peak_flops(device, peak_precision(precision))


def _batch_counts(batch: Any) -> tuple[int, int]:
    """(samples, tokens) from the first tensor in ``batch``: integer [B, T] counts B*T tokens."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.dim() == 0:
                continue
            samples = int(item.shape[0])
            tokens = (
                int(item.shape[0] * item.shape[1])
                if item.dim() >= 2 and not item.is_floating_point()
                else samples
            )
            return samples, tokens
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 0, 0


@dataclass
class _StepEvents:
    start: torch.cuda.Event
    before_opt: torch.cuda.Event
    end: torch.cuda.Event
    data_wait: float = 0.0  # host seconds spent fetching this batch
    extras: dict[str, float] = field(default_factory=dict)


@dataclass
class SpeedMonitorConfig:
    """Validated settings of :class:`SpeedMonitor` (see its docstring)."""

    log_every_n_steps: int | None = None
    peak_flops: float | None = None
    window: int = 50
    peak_precision: str | None = None

    def __post_init__(self) -> None:
        if self.log_every_n_steps is not None and self.log_every_n_steps < 1:
            raise ValueError(f"SpeedMonitor: log_every_n_steps={self.log_every_n_steps}; use >= 1 or None.")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"SpeedMonitor: peak_flops={self.peak_flops}; it must be > 0 (FLOP/s).")
        if self.window < 1:
            raise ValueError(f"SpeedMonitor: window={self.window}; it must be >= 1.")
        if self.peak_precision is not None and self.peak_precision not in PEAK_PRECISIONS:
            raise ValueError(
                f"SpeedMonitor: peak_precision={self.peak_precision!r}; use one of {PEAK_PRECISIONS} or None "
                "(from the Trainer's precision)."
            )


class SpeedMonitor(KeyedStateCallback):
    """Logs tokens/s, samples/s, MFU and where the step time goes, with no per-step sync.

    Throughput comes from host wall time between log points. The time split (data wait,
    forward+backward, optimizer) comes from CUDA events recorded at the hooks; they are read only
    when they have completed (``event.query()``), at log points, so the host never waits for the
    device. Validation and checkpoint time are host wall time of those phases.

    Tokens per batch: the module's ``tokens_per_batch`` attribute when it has one, else
    ``B * T`` of the first integer tensor of the batch (or ``B`` when it is a float tensor).
    FLOPs per batch: Lightning's ``flops_per_batch`` attribute convention (per device); without
    it MFU is not logged.

    Metrics are logged through ``pl_module.log`` once per optimizer step (not per micro-batch under
    gradient accumulation), so ``ModelCheckpoint(monitor="speed/tokens_per_sec")`` and ``EarlyStopping`` can
    use them; they reach the loggers on the steps the Trainer writes (``Trainer(log_every_n_steps=...)``).
    Two instances with different settings keep separate checkpoint state.

    Args:
        log_every_n_steps: how often to log, in optimizer steps (default: the Trainer's
            ``log_every_n_steps``; other values reach the loggers only on steps the Trainer writes too).
        peak_flops: peak FLOP/s of one device for MFU (default: :func:`peak_flops` for the device and
            ``peak_precision``: NVIDIA's dense datasheet figures for H100 and H200, Lightning's table for other
            GPUs; when neither knows the device, MFU is not logged and an info message says so).
        window: number of recent steps the time split averages over.
        peak_precision: which peak MFU is measured against, one of ``"fp8"``, ``"bf16"``, ``"fp16"``,
            ``"tf32"``, ``"fp32"``, ``"fp64"`` (default: from the Trainer's precision, see :func:`peak_precision`;
            ``"fp8"`` for a model whose matmuls run in FP8 under ``bf16-mixed``). Ignored with ``peak_flops``.

    Example::

        trainer = Trainer(callbacks=[SpeedMonitor()], log_every_n_steps=20)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        window: int = 50,
        peak_precision: str | None = None,
    ) -> None:
        self.config = SpeedMonitorConfig(log_every_n_steps, peak_flops, window, peak_precision)
        #: the peak speed/mfu is measured against (FLOP/s of one device) and what it is, set when training starts
        self.peak: float | None = None
        self.peak_source = ""
        self.total_samples = 0
        self.total_tokens = 0
        self.metrics: dict[str, float] = {}
        self._peak_told = False
        self._cuda = False
        self._t_last_log: float | None = None
        self._samples = 0
        self._tokens = 0
        self._batches = 0
        self._steps = 0
        self._t_batch_end: float | None = None
        self._current: _StepEvents | None = None
        self._pending: deque[_StepEvents] = deque()
        self._split: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._val_s = 0.0
        self._ckpt_s = 0.0
        self._val_t0: float | None = None
        self._ckpt_t0: float | None = None

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        precision = str(trainer.precision)
        column = self.config.peak_precision or peak_precision(precision)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        if self.config.peak_flops is not None:
            self.peak, self.peak_source = self.config.peak_flops, "the peak_flops given to SpeedMonitor"
        else:
            self.peak = peak_flops(device, column) if device.type == "cuda" else None
            self.peak_source = f"the dense {column} peak of one {name}"
        if not self._peak_told and (self.peak is not None or device.type != "cpu"):
            self._peak_told = True
            if self.peak is None:
                rank_zero_info(
                    f"SpeedMonitor: no peak FLOP/s known for {name} ({column}, precision {precision}); speed/mfu is "
                    "not logged. Pass SpeedMonitor(peak_flops=...) (FLOP/s of one device) to log it."
                )
            else:
                rank_zero_info(
                    f"SpeedMonitor: speed/mfu is against {self.peak / 1e12:g} TFLOP/s, {self.peak_source}."
                )
        self._t_last_log = time.perf_counter()
        self._pending.clear()

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._close_checkpoint(now)
        wait = 0.0 if self._t_batch_end is None else now - self._t_batch_end
        if self._cuda:
            e = self._event()
            self._current = _StepEvents(e, e, e, data_wait=wait)
        else:
            self._current = None
            self._split.append((wait, 0.0, 0.0, 0.0))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._current is not None:
            self._current.before_opt = self._event()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = getattr(pl_module, "tokens_per_batch", None)
        samples, counted = _batch_counts(batch)
        self._samples += samples
        self._tokens += int(tokens) if tokens is not None else counted
        self._batches += 1
        stepped = optimizer_stepped(trainer, pl_module, batch_idx)
        self._steps += stepped
        if self._current is not None:
            self._current.end = self._event()
            if self._current.before_opt is self._current.start:
                # No optimizer step in this batch (gradient accumulation): all of it is fwd+bwd.
                self._current.before_opt = self._current.end
            self._pending.append(self._current)
            self._current = None
        every = log_every(trainer, self.config.log_every_n_steps)
        if stepped and trainer.global_step % every == 0 and self._steps:
            self._log(trainer, pl_module)
        self._t_batch_end = time.perf_counter()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_t0 = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val_t0 is not None:
            self._val_s += time.perf_counter() - self._val_t0
            self._val_t0 = None
        self._t_batch_end = time.perf_counter()  # validation time is not data wait

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._ckpt_t0 = time.perf_counter()

    def _close_checkpoint(self, now: float) -> None:
        # Checkpoint time: from the save hook until training resumes (Lightning has no "saved" hook).
        if self._ckpt_t0 is not None:
            self._ckpt_s += now - self._ckpt_t0
            self._ckpt_t0 = None
            self._t_batch_end = now

    @override
    def state_key_settings(self) -> dict[str, Any]:
        settings = asdict(self.config)
        if settings["peak_precision"] is None:  # unset: the key of the other three settings alone
            del settings["peak_precision"]
        return settings

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"total_samples": self.total_samples, "total_tokens": self.total_tokens}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_samples = int(state_dict["total_samples"])
        self.total_tokens = int(state_dict["total_tokens"])

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._pending.clear()
        self._current = None

    # -- reading -------------------------------------------------------------------------------
    def _drain(self) -> None:
        # Only completed events are read: elapsed_time on them does not block.
        while self._pending and self._pending[0].end.query():
            s = self._pending.popleft()
            fwd_bwd = s.start.elapsed_time(s.before_opt) / 1e3
            opt = s.before_opt.elapsed_time(s.end) / 1e3
            self._split.append((s.data_wait, fwd_bwd, opt, fwd_bwd + opt))
        while len(self._pending) > 4 * self.config.window:  # never grow without bound
            self._pending.popleft()

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now = time.perf_counter()
        elapsed = now - (self._t_last_log or now)
        self.total_samples += self._samples
        self.total_tokens += self._tokens
        m: dict[str, float] = {}
        if elapsed > 0:
            world = trainer.world_size
            m["speed/samples_per_sec"] = self._samples / elapsed * world
            m["speed/tokens_per_sec"] = self._tokens / elapsed * world
            m["speed/tokens_per_sec_per_device"] = self._tokens / elapsed
            m["speed/step_time_ms"] = elapsed / self._steps * 1e3
            flops = getattr(pl_module, "flops_per_batch", None)
            if flops and self.peak:
                m["speed/mfu"] = flops * self._batches / elapsed / self.peak
        m["speed/total_tokens"] = float(self.total_tokens)
        self._drain()
        if self._split:
            n = len(self._split)
            m["time/data_wait_ms"] = sum(x[0] for x in self._split) / n * 1e3
            if self._cuda:
                m["time/fwd_bwd_ms"] = sum(x[1] for x in self._split) / n * 1e3
                m["time/optimizer_ms"] = sum(x[2] for x in self._split) / n * 1e3
        if elapsed > 0:
            m["time/validation_frac"] = self._val_s / elapsed
            m["time/checkpoint_frac"] = self._ckpt_s / elapsed
        m["time/validation_s"] = self._val_s
        m["time/checkpoint_s"] = self._ckpt_s
        self.metrics = m
        log_metrics(pl_module, m)
        self._samples = self._tokens = self._batches = self._steps = 0
        self._val_s = self._ckpt_s = 0.0
        self._t_last_log = now
