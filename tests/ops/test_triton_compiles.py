"""Every Triton kernel of the package compiles for an H100 (sm_90) without a GPU.

Triton's interpreter (what the CPU tests run) accepts code its compiler rejects, e.g. an early ``return`` in a
helper, so each kernel is compiled here for the argument types its wrapper passes (16-bit and fp32 scores,
fp32 and 16-bit weights, int32 and int64 indices and sizes). Skipped where triton is absent.
"""

from __future__ import annotations

import itertools
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are then interpreter objects, not compilable
    pytest.skip("TRITON_INTERPRET=1: nothing to compile", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from lightning_opt.ops import _sparse_decode_triton as D  # noqa: E402
from lightning_opt.ops import _topk_triton as T  # noqa: E402
from lightning_opt.ops import softcap_ce as S  # noqa: E402

_MODULES = (T, D, S)
# kernels launched by a wrapper (the others are @triton.jit helpers they call)
_KERNELS = {
    "_count_ge_kernel", "_compact_ordered_kernel",
    "_stash_kernel", "_compact_stash_kernel", "_fb_hist_kernel", "_fb_count_kernel", "_fb_scan_kernel",
    "_fb_write_kernel", "_grad_kept_kernel",
    "_forward_kernel", "_grad_values_kernel", "_grad_weight_kernel",
    "_softcap_ce_kernel", "_transpose_bytes_kernel",
}
_HELPERS = {"_block", "_per_row", "_capped", "_order_key", "_key16", "_emit", "_fb_tile", "_pick", "_fb_cut"}
_CONSTEXPRS = {"BLOCK", "BLOCK_IN_ONE_ROW", "CAPPED", "BLOCK_D", "BLOCK_E", "HAS_CAP", "FIXED_MAX", "FAST_TANH",
               "WRITE_GRAD", "WRITE_G8", "WRITE_DENSE", "BLOCK_MAX", "BLOCK_M", "VEC", "EVEN", "CAP", "GROUP", "SUB",
               "ROWS", "STAGE", "TILE", "CHUNK", "W_MULT"}


def _module_of(name: str):
    return next(m for m in _MODULES if isinstance(getattr(m, name, None), JITFunction))


def _selection_cases():
    # (kernel, signature, constexprs, num_warps); ``n`` is i32 below 2**31 entries and i64 above. Any float
    # scores (fp32: the candidate step of other dtypes), the default launch shape and the largest of the
    # benchmark's sweep.
    for dt, n, one_row, (block, warps) in itertools.product(("bf16", "fp16", "fp32"), ("i32", "i64"), (True, False),
                                                            ((T.BLOCK, T.NUM_WARPS), (8192, 8))):
        if (dt, n) not in {("bf16", "i32"), ("bf16", "i64"), ("fp16", "i32"), ("fp32", "i32")}:
            continue
        meta = {"BLOCK": block, "BLOCK_IN_ONE_ROW": one_row}
        yield ("_count_ge_kernel", {"x_ptr": f"*{dt}", "lo_ptr": f"*{dt}", "cnt_ptr": "*i32", "n": n,
                                    "row_len": "i32"}, meta, warps)
        for capped in (False, True):
            yield ("_compact_ordered_kernel", {"x_ptr": f"*{dt}", "lo_ptr": f"*{dt}", "pre_ptr": "*i64",
                                               "idx_ptr": "*i64", "val_ptr": f"*{dt}", "n": n, "row_len": "i32",
                                               "cap": "i32"}, {**meta, "CAPPED": capped}, warps)


def _one_pass_cases():
    # the one-pass selection (16-bit scores only): i32 sizes below 2**31 entries, i64 above; the default stash
    # shape and the sweep's extremes; blocks inside rows or split by them; the tail block masked or not
    for dt, n, (block, warps), even, one_row in itertools.product(
            ("bf16", "fp16"), ("i32", "i64"), ((T.STASH_BLOCK, T.STASH_WARPS), (2048, 4), (16384, 16)),
            (True, False), (True, False)):
        if dt == "fp16" and (n == "i64" or block != T.STASH_BLOCK):
            continue
        yield ("_stash_kernel", {"x_ptr": f"*{dt}", "lo_ptr": f"*{dt}", "cnt_ptr": "*i32", "slot_ptr": "*i32",
                                 "n": n, "row_len": n, "cap": "i32"},
               {"BLOCK": block, "VEC": T._VEC, "EVEN": even, "BLOCK_IN_ONE_ROW": one_row}, warps)
    for dt, n, rows, (cap, block) in itertools.product(("bf16", "fp16"), ("i32", "i64"), (False, True),
                                                       ((32, T.STASH_BLOCK), (1024, 2048), (16384, 16384))):
        yield ("_compact_stash_kernel", {"x_ptr": f"*{dt}", "lo_ptr": f"*{dt}", "cnt_ptr": "*i32", "incl_ptr": "*i64",
                                         "slot_ptr": "*i32", "idx_ptr": "*i64", "key_ptr": "*i32", "n": n, "nb": "i32",
                                         "row_len": n, "cand_cap": "i32"},
               {"BLOCK": block, "CAP": cap, "GROUP": max(1, T._COMPACT_SLOTS // cap), "SUB": min(block, 256),
                "ROWS": rows}, 4)
    for dt, n in (("bf16", "i32"), ("bf16", "i64"), ("fp16", "i32")):
        sizes = {"rows": "i32", "row_len": n, "n_tiles": "i32", "tiles_per_row": "i32", "n_keep": n}
        for stage in (0, 1):
            yield ("_fb_hist_kernel", {"x_ptr": f"*{dt}", "fast_ptr": "*i32", "hist_ptr": "*i64", **sizes},
                   {"STAGE": stage, "TILE": T._FB_TILE}, 4)
        yield ("_fb_count_kernel", {"x_ptr": f"*{dt}", "fast_ptr": "*i32", "hist_ptr": "*i64", "gt_ptr": "*i32",
                                    "eq_ptr": "*i32", **sizes}, {"TILE": T._FB_TILE}, 4)
        yield ("_fb_write_kernel", {"x_ptr": f"*{dt}", "fast_ptr": "*i32", "hist_ptr": "*i64",
                                    "eq_before_ptr": "*i64", "kept_before_ptr": "*i64", "out_ptr": "*i64", **sizes},
               {"TILE": T._FB_TILE}, 4)
        yield ("_fb_scan_kernel", {"fast_ptr": "*i32", "hist_ptr": "*i64", "gt_ptr": "*i32", "eq_ptr": "*i32",
                                   "eq_before_ptr": "*i64", "kept_before_ptr": "*i64", "rows": "i32",
                                   "tiles_per_row": "i32", "n_keep": n}, {"CHUNK": T._FB_CHUNK}, 4)
    # the CLT decode's gradient at the kept entries: 16-bit (autocast) or fp32 decoders, aligned or not
    for w, mult, per_layer in (("bf16", 8, "i32"), ("bf16", 1, "i64"), ("fp16", 8, "i32"), ("fp32", 4, "i64")):
        yield ("_grad_kept_kernel", {"idx_ptr": "*i64", "w_off_ptr": "*i64", "w0_ptr": f"*{w}", "g_ptr": f"*{w}",
                                     "out_ptr": "*fp32", "nnz": "i32", "per_layer": per_layer, "n_features": "i32",
                                     "d": "i32", "n_layers": "i32"},
               {"W_MULT": mult, "BLOCK_E": 16, "BLOCK_D": 128}, 4)


def _decode_cases():
    meta = {"BLOCK_D": D._BLOCK_D, "BLOCK_E": D._BLOCK_E}
    # weights fp32 (parameters) or bf16/fp16 (autocast copies); values their own dtype; ids int64 (ours) or int32
    for w, v, i in (("fp32", "fp32", "i64"), ("bf16", "bf16", "i64"), ("fp16", "fp32", "i64"),
                    ("fp32", "bf16", "i32"), ("bf16", "fp32", "i32")):
        yield ("_forward_kernel", {"idx_ptr": f"*{i}", "val_ptr": f"*{v}", "start_ptr": "*i64", "end_ptr": "*i64",
                                   "w_ptr": f"*{w}", "out_ptr": f"*{w}", "D": "i32", "stride_w": "i32",
                                   "stride_out": "i32"}, meta, 4)
        yield ("_grad_values_kernel", {"idx_ptr": f"*{i}", "row_ptr": f"*{i}", "gout_ptr": f"*{w}",
                                       "w_ptr": f"*{w}", "gval_ptr": "*fp32", "nnz": "i32", "D": "i32",
                                       "stride_w": "i32", "stride_g": "i32"}, meta, 4)
        yield ("_grad_weight_kernel", {"idx_ptr": f"*{i}", "row_ptr": "*i64", "val_ptr": f"*{v}",
                                       "gout_ptr": f"*{w}", "gw_ptr": "*fp32", "nnz": "i32", "D": "i32",
                                       "stride_g": "i32"}, meta, 4)
    yield ("_grad_values_kernel", {"idx_ptr": "*i64", "row_ptr": "*i64", "gout_ptr": "*bf16", "w_ptr": "*fp32",
                                   "gval_ptr": "*fp32", "nnz": "i64", "D": "i32", "stride_w": "i64",
                                   "stride_g": "i64"}, meta, 4)


def _softcap_cases():
    # training (gradient written, fast tanh on the GPU) and evaluation sweeps, the cap as the row maximum or a
    # running maximum, no cap; the FP8 head's e5m2 copy instead of (or, via softcap_ce_rows_, besides) the dense
    # gradient; the running maximum per lane or per row (BLOCK_MAX); bf16 logits (autocast) and fp32; int64
    # targets (torch's default)
    for dt in ("bf16", "fp32"):
        for has_cap, fixed, fast, grad, g8, dense, block_max in (
            (True, True, True, True, True, False, False), (True, True, False, False, False, True, False),
            (True, False, True, True, False, True, False), (False, False, False, True, False, True, False),
            (True, True, True, True, True, True, False), (False, False, False, True, False, True, True),
            (False, False, False, False, False, True, True), (True, False, True, True, False, True, True),
        ):
            yield ("_softcap_ce_kernel", {"logits_ptr": f"*{dt}", "targets_ptr": "*i64", "loss_ptr": "*fp32",
                                          "g8_ptr": "*fp8e5" if g8 else "*fp32", "V": "i32", "stride": "i32",
                                          "cap": "fp32", "ignore_index": "i32", "g8_mult": "fp32"},
                   {"HAS_CAP": has_cap, "FIXED_MAX": fixed, "FAST_TANH": fast, "WRITE_GRAD": grad,
                    "WRITE_G8": g8, "WRITE_DENSE": dense, "BLOCK_MAX": block_max, "BLOCK": S.BLOCK_V},
                   S.NUM_WARPS)
    # the e5m2 gradient's [V, N] transpose (bytes), at sizes whose product exceeds 2**31
    yield ("_transpose_bytes_kernel", {"src_ptr": "*u8", "dst_ptr": "*u8", "N": "i32", "V": "i32"},
           {"BLOCK_M": S.TILE_M, "BLOCK": S.TILE_V}, S.NUM_WARPS)


def _all_cases():
    # (kernel, signature, constexprs, num_warps, aligned); aligned: every pointer 16-byte aligned and every int
    # a multiple of 16, as Triton specialises a real launch at CLT shapes (tt.divisibility hints change codegen)
    seen = set()
    for name, sig, consts, warps in (*_selection_cases(), *_one_pass_cases(), *_decode_cases(), *_softcap_cases()):
        yield name, sig, consts, warps, False
        if name not in seen:
            seen.add(name)
            yield name, sig, consts, warps, True


_CASES = list(_all_cases())


def _case_id(case) -> str:
    name, sig, consts, warps, aligned = case
    types = "-".join(sorted({t.lstrip("*") for t in sig.values()}))
    flags = "-".join(f"{k}={v}" for k, v in consts.items())
    return f"{name}[{types}|{flags}|w{warps}{'|aligned' if aligned else ''}]"


def _compile(name: str, sig: dict[str, str], consts: dict[str, object], warps: int, aligned: bool):
    module = _module_of(name)
    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    names = list(full)
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if aligned}
    return triton.compile(ASTSource(fn=getattr(module, name), signature=full, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def test_every_kernel_of_the_package_is_covered():
    jitted = {name for m in _MODULES for name, obj in vars(m).items() if isinstance(obj, JITFunction)}
    missing = jitted - _KERNELS - _HELPERS
    assert not missing, f"new Triton kernels {sorted(missing)}: add their signatures to this test"
    assert {case[0] for case in _CASES} == _KERNELS
    for name, sig, *_ in _CASES:  # signatures name every runtime argument, in order
        params = [p for p in getattr(_module_of(name), name).arg_names if p not in _CONSTEXPRS]
        assert list(sig) == params, name


@pytest.mark.parametrize("case", _CASES, ids=_case_id)
def test_kernel_compiles_for_sm90(case):
    try:
        kernel = _compile(*case)
    except (RuntimeError, FileNotFoundError) as err:  # no ptxas in this triton install: IR stage only
        if "ptxas" not in str(err).lower():
            raise
        pytest.skip(f"no ptxas: {err}")
    assert kernel.asm.get("cubin")


def _addptrs(name: str, sig: dict[str, str], consts: dict[str, object]) -> list[str]:
    import re

    ttir = _compile(name, sig, consts, 4, aligned=False).asm["ttir"]
    return [re.sub(r"\s+loc\(.*$", "", line.strip()) for line in ttir.splitlines() if "tt.addptr" in line]


def test_one_pass_offsets_are_64_bit_at_32_bit_sizes():
    """Index math past 2**31 entries (an x of 2**31 bf16 scores is 4 GiB): with every size passed as i32, as
    Triton types them at the CLT's shapes, the one-pass kernels still address the scores, the candidate outputs and
    the decoders with 64-bit offsets (the program id is widened before it is multiplied)."""
    sizes = {"rows": "i32", "row_len": "i32", "n_tiles": "i32", "tiles_per_row": "i32", "n_keep": "i32"}
    stash = _addptrs("_stash_kernel", {"x_ptr": "*bf16", "lo_ptr": "*bf16", "cnt_ptr": "*i32", "slot_ptr": "*i32",
                                       "n": "i32", "row_len": "i32", "cap": "i32"},
                     {"BLOCK": 4096, "VEC": 8, "EVEN": True, "BLOCK_IN_ONE_ROW": True})
    # the block's first entry: a scalar 64-bit offset; the entries inside the block: 32-bit offsets from there
    assert any(line.startswith("%") and "tt.addptr %x_ptr" in line and line.endswith("!tt.ptr<bf16>, i64")
               for line in stash), stash
    assert any("tt.addptr %slot_ptr" in line and line.endswith("!tt.ptr<i32>, i64") for line in stash), stash
    tensors = {
        "_compact_stash_kernel": ({"x_ptr": "*bf16", "lo_ptr": "*bf16", "cnt_ptr": "*i32", "incl_ptr": "*i64",
                                   "slot_ptr": "*i32", "idx_ptr": "*i64", "key_ptr": "*i32", "n": "i32", "nb": "i32",
                                   "row_len": "i32", "cand_cap": "i32"},
                                  {"BLOCK": 4096, "CAP": 32, "GROUP": 32, "SUB": 256, "ROWS": True}),
        "_fb_hist_kernel": ({"x_ptr": "*bf16", "fast_ptr": "*i32", "hist_ptr": "*i64", **sizes},
                            {"STAGE": 1, "TILE": 4096}),
        "_fb_write_kernel": ({"x_ptr": "*bf16", "fast_ptr": "*i32", "hist_ptr": "*i64", "eq_before_ptr": "*i64",
                              "kept_before_ptr": "*i64", "out_ptr": "*i64", **sizes}, {"TILE": 4096}),
        "_grad_kept_kernel": ({"idx_ptr": "*i64", "w_off_ptr": "*i64", "w0_ptr": "*bf16", "g_ptr": "*bf16",
                               "out_ptr": "*fp32", "nnz": "i32", "per_layer": "i32", "n_features": "i32", "d": "i32",
                               "n_layers": "i32"}, {"W_MULT": 8, "BLOCK_E": 16, "BLOCK_D": 128}),
    }
    for name, (sig, consts) in tensors.items():
        # every per-entry address into the scores (bf16) or the int64 outputs and tables: 64-bit offsets (the
        # 256 bins of a row's histogram aside)
        lines = [line for line in _addptrs(name, sig, consts)
                 if ("x!tt.ptr<bf16>>" in line or "x!tt.ptr<i64>>" in line) and "%bins" not in line]
        assert lines and all(line.endswith("xi64>") for line in lines), (name, lines)
