"""Copy tensors only when a flag on the device is set, without the host reading the flag.

:class:`~lightning_opt.callbacks.NaNSkip` applies its decision this way to optimizers without a ``found_inf``
input (Muon, Lion, foreach AdamW, ...): before the step, parameters and optimizer state are copied aside *only
when the step is bad*, and after the step copied back only then. On CUDA that is one Triton kernel per
direction whose programs read the flag and return when it is clear, so a good step costs two kernel launches
and no memory traffic; a bad step (rare) pays for the copies. The copy is bytewise: restored values are
bit-identical.

Elsewhere (CPU, or CUDA without Triton) the same result comes from ``torch.where`` per tensor, which reads and
writes every tensor whatever the flag says. Triton is imported on the first CUDA call, not when this module is.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any

import torch

from lightning_opt._optional import is_available, triton_runs_on

_BLOCK = 4096  # bytes per program and loop iteration
_SPLIT = 16  # programs per tensor (grid axis 1): a bad step copies each tensor with this many programs
_kernel: Any = None
_has_triton: bool | None = None


def _triton_installed() -> bool:
    global _has_triton
    if _has_triton is None:
        _has_triton = is_available("triton")
    return _has_triton


def _triton_kernel() -> Any:
    """The Triton kernel, compiled lazily (importing triton takes a while and is optional)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def flagged_copy_kernel(flag_ptr, table_ptr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
            # Row t of the table: destination address, source address, bytes. Program (t, j) copies the
            # blocks j, j + SPLIT, ... of tensor t, and nothing when the flag is 0.
            t = tl.program_id(0)
            flag = tl.load(flag_ptr)
            if flag != 0:
                row = table_ptr + 3 * t
                dst = tl.load(row).to(tl.pointer_type(tl.uint8))
                src = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
                n = tl.load(row + 2)
                start = tl.program_id(1).to(tl.int64) * BLOCK
                while start < n:
                    offs = start + tl.arange(0, BLOCK)
                    inb = offs < n
                    tl.store(dst + offs, tl.load(src + offs, mask=inb), mask=inb)
                    start += SPLIT * BLOCK

        _kernel = flagged_copy_kernel
    return _kernel


def warn_kernel_failed(kernel: str, err: Exception, fallback: str) -> None:
    """Warns, from NaNSkip's point of view, that one of its Triton kernels failed and what runs instead."""
    warnings.warn(
        f"NaNSkip: the {kernel} Triton kernel failed ({type(err).__name__}: {err}); using {fallback} instead.",
        stacklevel=4,
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FlaggedCopy:
    """``dst[i].copy_(src[i])`` for every ``i`` when ``flag`` (a one-element tensor) is nonzero, decided on the
    device: no host-device sync.

    Keeps the address tables of the lists it saw last (params and optimizer state keep their storage from step to
    step, so the table is built once). ``uses_kernel`` says which path the last call took.
    """

    def __init__(self, max_tables: int = 4) -> None:
        self._tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._max_tables = max_tables
        self._kernel_failed = False
        self.uses_kernel = False

    def __call__(
        self, flag: torch.Tensor, dst: list[torch.Tensor], src: list[torch.Tensor], clear_may_copy: bool = False
    ) -> None:
        """``clear_may_copy``: the caller does not mind ``dst`` being overwritten when the flag is clear (a
        snapshot that is read only when the flag is set); the torch path then copies unconditionally, which is
        cheaper than a select."""
        if len(dst) != len(src):
            raise ValueError(f"FlaggedCopy: {len(dst)} destinations for {len(src)} sources")
        for d, s in zip(dst, src):
            if d.shape != s.shape or d.dtype != s.dtype or d.device != s.device:
                raise ValueError(
                    f"FlaggedCopy: cannot copy a {s.dtype} {tuple(s.shape)} tensor on {s.device} into a "
                    f"{d.dtype} {tuple(d.shape)} one on {d.device}"
                )
        by_device: dict[torch.device, list[int]] = {}
        for i, d in enumerate(dst):
            by_device.setdefault(d.device, []).append(i)
        self.uses_kernel = False
        for device, idx in by_device.items():
            f = flag if flag.device == device else flag.to(device, non_blocking=True)
            pairs = [(dst[i], src[i]) for i in idx]
            if self._kernel_ok(f, pairs):
                try:
                    self._launch(f, pairs)
                    self.uses_kernel = True
                    continue
                except Exception as err:  # noqa: BLE001 - a kernel that does not build must not stop training
                    self._kernel_failed = True
                    warn_kernel_failed("flagged-copy", err, "torch.where (one extra read and write of params and "
                                       "optimizer state per step)")
            self._torch(f, pairs, clear_may_copy)

    def _kernel_ok(self, flag: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        if self._kernel_failed or not triton_runs_on(flag) or not _triton_installed():
            return False
        if flag.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
            return False  # the interpreter runs on the host: it cannot follow device addresses from the table
        return all(d.is_contiguous() and s.is_contiguous() for d, s in pairs)

    def _launch(self, flag: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        rows = tuple((d.data_ptr(), s.data_ptr(), _nbytes(d)) for d, s in pairs if _nbytes(d))
        if not rows:
            return
        table = self._tables.get(rows)
        if table is None:
            host = torch.tensor(rows, dtype=torch.int64)
            if flag.is_cuda:  # pinned: the upload does not block the host
                table = host.pin_memory().to(flag.device, non_blocking=True)
            else:
                table = host
            self._tables[rows] = table
            while len(self._tables) > self._max_tables:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(rows)
        if flag.dtype != torch.float32 or flag.numel() != 1:
            flag = flag.reshape(1).to(torch.float32)
        _triton_kernel()[(len(rows), _SPLIT)](flag, table, SPLIT=_SPLIT, BLOCK=_BLOCK, num_warps=4)

    @staticmethod
    @torch.no_grad()
    def _torch(flag: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], clear_may_copy: bool) -> None:
        if clear_may_copy:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
            return
        cond = flag.reshape(()) != 0
        for d, s in pairs:
            torch.where(cond, s, d, out=d)
