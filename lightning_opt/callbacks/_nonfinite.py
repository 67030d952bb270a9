"""Flag non-finite values in many tensors with one read of each and one kernel per dtype.

:class:`~lightning_opt.callbacks.NaNSkip` checks every gradient and loss of a step. On CUDA (with Triton) this is
one kernel per dtype over a table of chunks (offset in elements from the first tensor, length, flag slot): each
program reads one chunk of one tensor (16-byte vector loads where the tensors start on 16 bytes) and, when an
element is NaN or infinite, writes 1 into that tensor's flag slot and into the "any" slot. Nothing is written on a
good step, so there is no per-tensor result to reduce afterwards and the "any" slot is the skip decision as it is.
``x - x != 0`` is the test: 0 for every finite value of any float dtype (no overflow; 16-bit floats widened to
float32), NaN for NaN and for both infinities.

Elsewhere (CPU, CUDA without Triton, other dtypes, non-contiguous tensors) :class:`NonFiniteCheck` returns False
and the caller uses the ``torch._foreach_norm`` path. Triton is imported on the first call that can use it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from lightning_opt._optional import triton_runs_on
from lightning_opt.callbacks._flagged_copy import _triton_installed, warn_kernel_failed

_CHUNK = 32768  # elements per program (one table row)
_BLOCK = 2048  # elements per loop iteration of a program
_kernel: Any = None


def _triton_kernel() -> Any:
    """The Triton kernel, compiled lazily."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def nonfinite_kernel(table_ptr, base_ptr, flags_ptr, ANY: tl.constexpr, WIDEN: tl.constexpr,
                             VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
            # Row r of the table: a chunk's offset from base_ptr in elements, its length (<= CHUNK elements), the
            # flag slot of its tensor. VEC > 1: every offset is a multiple of VEC (16 bytes), so the full chunks
            # are read with 16-byte vector loads.
            row = table_ptr + 3 * tl.program_id(0)
            off = tl.load(row)
            if VEC > 1:
                off = tl.multiple_of(off, VEC)
            src = base_ptr + off
            n = tl.load(row + 1)
            slot = tl.load(row + 2)
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            if n == CHUNK:
                for start in range(0, CHUNK, BLOCK):
                    offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
                    x = tl.load(src + offs)
                    if WIDEN:  # 16-bit floats: float32 holds every value, NaN and Inf exactly
                        x = x.to(tl.float32)
                    bad = bad | ((x - x) != 0).to(tl.int32)
            else:  # the last chunk of a tensor
                for start in range(0, CHUNK, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    x = tl.load(src + offs, mask=offs < n, other=0.0)
                    if WIDEN:
                        x = x.to(tl.float32)
                    bad = bad | ((x - x) != 0).to(tl.int32)
            if tl.max(bad, 0) > 0:
                tl.store(flags_ptr + slot, 1.0)
                tl.store(flags_ptr + ANY, 1.0)

        _kernel = nonfinite_kernel
    return _kernel


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class NonFiniteCheck:
    """``check(parts, flags, any_slot)`` sets ``flags[slot] = 1`` for each ``(tensors, slot)`` of ``parts`` whose
    tensors hold a NaN or Inf, and ``flags[any_slot] = 1`` when any does; ``flags`` is a float32 vector (zeros on
    entry). Returns False, having done nothing, where the kernel does not apply (see the module docstring). No
    host-device sync.

    Keeps the chunk tables of the tensor lists it saw last (gradients usually come back at the same addresses
    step after step, so the table is built and uploaded once).
    """

    def __init__(self, max_tables: int = 4) -> None:
        self._tables: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
        self._max_tables = max_tables
        self._failed = False
        self.uses_kernel = False
        self.tables_built = 0  # tables built and uploaded so far (one per dtype while the addresses stay put)

    def __call__(self, parts: list[tuple[list[torch.Tensor], int]], flags: torch.Tensor, any_slot: int) -> bool:
        self.uses_kernel = False
        if self._failed or not triton_runs_on(flags) or not _triton_installed():
            return False
        if flags.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
            return False  # the interpreter runs on the host: it cannot follow device addresses from the table
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        slots: dict[torch.dtype, list[int]] = {}
        for tensors, slot in parts:
            for t in tensors:
                if t.device != flags.device or t.dtype not in _DTYPES or not t.is_contiguous():
                    return False
                if t.numel():
                    groups.setdefault(t.dtype, []).append(t)
                    slots.setdefault(t.dtype, []).append(slot)
        found = []
        for dtype, members in groups.items():
            rows = tuple((t.data_ptr(), t.numel(), slot) for t, slot in zip(members, slots[dtype]))
            entry = self._table(dtype, rows, flags.device)
            if entry is None:
                return False
            found.append((dtype, members[0], *entry))
        try:
            for dtype, base, table, vec in found:
                _triton_kernel()[(table.shape[0],)](
                    table, base, flags, ANY=any_slot, WIDEN=dtype.itemsize == 2, VEC=vec, CHUNK=_CHUNK,
                    BLOCK=_BLOCK, num_warps=4,
                )
        except Exception as err:  # noqa: BLE001 - a kernel that does not build must not stop training
            self._failed = True
            warn_kernel_failed("non-finite check", err, "torch._foreach_norm")
            return False
        self.uses_kernel = True
        return True

    def _table(self, dtype: torch.dtype, rows: tuple[tuple[int, int, int], ...], device: torch.device
               ) -> tuple[torch.Tensor, int] | None:
        """The chunk table on ``device`` (offsets in elements from the first tensor) and the vector width its
        offsets allow (1, or 16 bytes' worth of elements); None when an address is not a whole number of elements
        away from the first one."""
        key = (dtype, rows)
        found = self._tables.get(key)
        if found is not None:
            self._tables.move_to_end(key)
            return found
        size = dtype.itemsize
        base = rows[0][0]
        if any((ptr - base) % size for ptr, _, _ in rows):
            return None
        chunks = [
            ((ptr - base) // size + start, min(_CHUNK, n - start), slot)
            for ptr, n, slot in rows
            for start in range(0, n, _CHUNK)
        ]
        host = torch.tensor(chunks, dtype=torch.int64)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        self.tables_built += 1
        vec = 16 // size if all(ptr % 16 == 0 for ptr, _, _ in rows) else 1
        found = self._tables[key] = (table, vec)
        while len(self._tables) > self._max_tables:
            self._tables.popitem(last=False)
        return found
