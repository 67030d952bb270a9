"""NaNSkip's Triton kernels compile for an H100 (sm_90) without a GPU, and the non-finite check reads full chunks
with 16-byte vector loads when its tensors start on 16 bytes (the interpreter, which the CPU tests run, checks
neither). Skipped where triton is absent."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are then interpreter objects, not compilable
    pytest.skip("TRITON_INTERPRET=1: nothing to compile", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_opt.callbacks import _flagged_copy, _nonfinite  # noqa: E402


def _compile(fn, sig: dict[str, str], consts: dict[str, object], aligned: tuple[int, ...] = (), warps: int = 4):
    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    names = list(full)
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def _loads(ptx: str) -> Counter:
    return Counter(m.group(1) for m in re.finditer(r"\b(ld\.global(?:\.v\d)?\.b\d+)", ptx))


@pytest.mark.parametrize("dtype,size", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp64", 8)])
@pytest.mark.parametrize("vector", [True, False])
def test_nonfinite_check_compiles_and_vectorizes_aligned_chunks(dtype, size, vector):
    vec = 16 // size if vector else 1
    sig = {"table_ptr": "*i64", "base_ptr": f"*{dtype}", "flags_ptr": "*fp32"}
    consts = {"ANY": 4, "WIDEN": size == 2, "VEC": vec, "CHUNK": _nonfinite._CHUNK, "BLOCK": _nonfinite._BLOCK}
    ptx = _compile(_nonfinite._triton_kernel(), sig, consts, aligned=(1,) if vector else ()).asm["ptx"]
    vector_loads = sum(n for op, n in _loads(ptx).items() if ".v" in op)
    assert (vector_loads > 0) == vector, _loads(ptx)


def test_flagged_copy_compiles():
    ptx = _compile(_flagged_copy._triton_kernel(), {"flag_ptr": "*fp32", "table_ptr": "*i64"},
                   {"SPLIT": _flagged_copy._SPLIT, "BLOCK": _flagged_copy._BLOCK}).asm["ptx"]
    assert _loads(ptx)
