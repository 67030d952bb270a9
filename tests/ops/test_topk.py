from __future__ import annotations

import pytest
import torch

from lightning_opt.ops import topk as topk_mod
from lightning_opt.ops.topk import batch_topk_rows, jumprelu, scatter_dense, token_topk


def _reference(x2d: torch.Tensor, n: int) -> torch.Tensor:
    """Stable descending sort per row: (value desc, index asc) - the stated tie rule."""
    rows, m = x2d.shape
    order = torch.sort(x2d, dim=1, descending=True, stable=True).indices[:, :n]
    return (order + torch.arange(rows)[:, None] * m).reshape(-1).sort().values


@pytest.fixture(params=["histogram", "topk"])
def threshold_method(request: pytest.FixtureRequest) -> str:
    """Run a test with each threshold step of the selection (both must give identical indices)."""
    return request.param


@pytest.mark.parametrize("rows,m,n", [(1, 3000, 700), (4, 5000, 321), (1, 200_000, 4000), (3, 70_000, 1000)])
def test_batch_topk_rows_matches_sorted_reference(rows: int, m: int, n: int, threshold_method: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, m)
    idx, vals = batch_topk_rows(x, n, threshold_method=threshold_method)
    assert idx.numel() == rows * n  # exactly n per row
    assert torch.equal(idx.sort().values, _reference(x, n))
    assert torch.equal(vals, x.reshape(-1)[idx])
    # the kept multiset of values equals torch.topk's
    ref_vals = torch.topk(x, n, dim=1).values.reshape(-1).sort().values
    assert torch.equal(vals.sort().values, ref_vals)


def test_batch_topk_ties_keep_smallest_flat_index(threshold_method: str) -> None:
    # bf16 has few distinct values: many ties at the cut-off, also on the sampled path
    torch.manual_seed(1)
    x = (torch.randn(2, 100_000) * 4).round().to(torch.bfloat16)
    idx, _ = batch_topk_rows(x, 5000, threshold_method=threshold_method)
    assert idx.numel() == 10_000
    assert torch.equal(idx, _reference(x.float(), 5000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_batch_topk_signed_zero_and_negative_cutoffs(dtype: torch.dtype, rows: int, threshold_method: str) -> None:
    # cut-off at 0 with +0 and -0 mixed (equal values: ties by flat index), then a cut-off among negatives
    torch.manual_seed(4)
    x = torch.randn(rows, 30_000).clamp_max(0.0)  # about half the entries are +0
    x[:, ::3] = -0.0
    x = x.to(dtype)
    for n in (9_000, 20_000):  # 9000: the cut-off is a zero; 20000: a negative value (fp16/bf16: many ties)
        idx, vals = batch_topk_rows(x, n, threshold_method=threshold_method)
        assert torch.equal(idx, _reference(x.float(), n)), n
        assert torch.equal(vals, x.reshape(-1)[idx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_histogram_and_topk_threshold_steps_agree_with_torch_topk(dtype: torch.dtype) -> None:
    # the same candidates through both threshold steps, and the kept multiset against torch.topk
    torch.manual_seed(5)
    x = (torch.randn(2, 120_000) * 8).round().div(8).to(dtype)  # coarse values: heavy ties
    out = {method: batch_topk_rows(x, 3_000, threshold_method=method) for method in ("histogram", "topk")}
    assert torch.equal(out["histogram"][0], out["topk"][0])
    ref = torch.topk(x.float(), 3_000, dim=1).values.reshape(-1).sort().values
    assert torch.equal(out["histogram"][1].float().sort().values, ref)


def test_batch_topk_fallback_when_sample_misses(monkeypatch: pytest.MonkeyPatch, threshold_method: str) -> None:
    # A bound that is too high forces the exact fallback path; the result must not change.
    torch.manual_seed(2)
    x = torch.randn(2, 50_000)
    monkeypatch.setattr(topk_mod, "_row_lower_bounds", lambda x2d, n: (torch.full((x2d.shape[0],), 10.0), 0.02))
    idx, _ = batch_topk_rows(x, 800, threshold_method=threshold_method)
    assert torch.equal(idx, _reference(x, 800))


def test_batch_topk_gradient_reaches_only_kept_entries() -> None:
    x = torch.randn(3, 100, requires_grad=True)
    idx, vals = batch_topk_rows(x, 10)
    vals.sum().backward()
    mask = torch.zeros(300, dtype=torch.bool)
    mask[idx] = True
    assert torch.equal(x.grad.reshape(-1) != 0, mask)


def test_batch_topk_errors() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        batch_topk_rows(torch.randn(2, 5), 6)
    with pytest.raises(ValueError, match="2-D"):
        batch_topk_rows(torch.randn(5), 1)
    with pytest.raises(ValueError, match="non-negative int"):
        batch_topk_rows(torch.randn(2, 5), -1)
    with pytest.raises(ValueError, match="threshold_method='sort' is unknown"):
        batch_topk_rows(torch.randn(2, 5), 1, threshold_method="sort")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="candidates_backend"):
        batch_topk_rows(torch.randn(2, 5), 1, candidates_backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block must be a power-of-two"):
        batch_topk_rows(torch.randn(2, 5), 1, triton_block=1000)
    with pytest.raises(ValueError, match="num_warps must be a power-of-two"):
        batch_topk_rows(torch.randn(2, 5), 1, triton_num_warps=0)


def test_launch_shape_defaults_agree() -> None:
    """batch_topk_rows's launch-shape defaults are the kernels' (topk.py repeats them to import no triton)."""
    import inspect

    from lightning_opt.ops import _topk_triton as kt

    params = inspect.signature(batch_topk_rows).parameters
    assert (params["triton_block"].default, params["triton_num_warps"].default) == (None, None)  # the path's
    assert (topk_mod._TRITON_BLOCK, topk_mod._TRITON_NUM_WARPS) == (kt.BLOCK, kt.NUM_WARPS) == (2048, 4)
    assert (topk_mod._STASH_BLOCK, topk_mod._STASH_WARPS) == (kt.STASH_BLOCK, kt.STASH_WARPS) == (2048, 8)
    assert topk_mod._launch_shape("triton", None, None) == (2048, 8)
    assert topk_mod._launch_shape("triton_2pass", None, 8) == (2048, 8)
    for fn in (kt.count_ge, kt.compact_counted, kt.compact_ge, kt.select_16bit, topk_mod.candidates_ge):
        p = inspect.signature(fn).parameters
        assert (p["block"].default, p["num_warps"].default) == (2048, 4), fn.__name__
    p = inspect.signature(kt.select_16bit_1pass).parameters
    assert (p["block"].default, p["num_warps"].default) == (2048, 8)


def test_token_topk_and_scatter() -> None:
    x = torch.randn(2, 7, 20)
    idx, vals = token_topk(x, 3)
    dense = scatter_dense(idx, vals, x)
    assert dense.shape == x.shape
    assert ((dense != 0).sum(-1) == 3).all()
    assert torch.equal(dense.topk(3, dim=-1).values, x.topk(3, dim=-1).values)


def test_jumprelu_forward_and_ste_gradients() -> None:
    x = torch.tensor([[0.10, 0.50, 0.96, 1.04, 2.0]], requires_grad=True)
    th = torch.tensor([1.0], requires_grad=True)
    eps = 0.1
    y = jumprelu(x, th, eps)
    assert torch.equal(y.detach(), torch.tensor([[0.0, 0.0, 0.0, 1.04, 2.0]]))
    y.sum().backward()
    # input gradient: pass-through where x > threshold
    assert torch.equal(x.grad, torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0]]))
    # threshold gradient: -(theta/eps) for each x within eps/2 of theta (0.96 and 1.04)
    assert th.grad is not None and torch.allclose(th.grad, torch.tensor([-2 * 1.0 / eps]))


def test_jumprelu_threshold_grad_reduces_over_broadcast_dims() -> None:
    x = torch.full((3, 4, 5), 1.0, requires_grad=True)
    th = torch.full((3, 1, 5), 1.0, requires_grad=True)
    jumprelu(x, th, 0.5).sum().backward()
    assert th.grad.shape == th.shape
    assert torch.allclose(th.grad, torch.full((3, 1, 5), -4 * 1.0 / 0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_topk_exact_at_clt_scale_on_gpu() -> None:
    # 12 layers x 4096 tokens x 8192 features, k=200 per token: the gpt2-small-like selection, in bf16
    g = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(12 * 4096 * 8192, device="cuda", generator=g).to(torch.bfloat16)
    n = 200 * 4096
    idx, vals = batch_topk_rows(pre.view(1, -1), n)
    assert idx.numel() == n
    ref = torch.topk(pre.float(), n).values
    assert torch.equal(vals.float().sort().values, ref.sort().values)
    # per-layer rows
    idx2, _ = batch_topk_rows(pre.view(12, -1), n)
    assert torch.equal(torch.bincount(idx2 // (4096 * 8192), minlength=12), torch.full((12,), n, device="cuda"))


def _triton_runs_here() -> bool:
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_candidates_match_torch(dtype: torch.dtype) -> None:
    from lightning_opt.ops._topk_triton import compact_ge

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    x = (torch.randn(3, 40_000, device=dev) * 3).round().to(dtype)  # many ties
    x[1, 7] = float("nan")
    lo = torch.tensor([1.0, 4.0, -2.0], device=dev).to(dtype)
    ref = torch.nonzero((x >= lo[:, None]).view(-1)).squeeze(1)
    # blocks inside rows (40,000 = 78 x 512 + 64: not for 512 and 4096)
    for block, num_warps in ((2048, 4), (512, 4), (4096, 8)):
        idx, vals = compact_ge(x.view(-1), lo, 40_000, block=block, num_warps=num_warps)
        assert torch.equal(idx, ref) and torch.equal(vals, x.view(-1)[ref])
    # the whole selection, both backends: identical indices (same set and tie rule)
    for rows, n in ((1, 5000), (3, 700)):
        x2 = x.view(rows, -1).nan_to_num(-100.0)
        ref_idx, _ = batch_topk_rows(x2, n, select_backend="candidates", candidates_backend="torch")
        idx, vals = batch_topk_rows(x2, n, select_backend="candidates", candidates_backend="triton")
        assert torch.equal(idx, ref_idx) and torch.equal(vals, x2.reshape(-1)[idx])


def _stable_sort_reference(x2d: torch.Tensor, n: int) -> torch.Tensor:
    """The tie rule spelled out: per row the n largest, ties by smallest index, NaN never; ascending flat indices."""
    rows, m = x2d.shape
    order = torch.sort(x2d.float().nan_to_num(float("-inf")), dim=1, descending=True, stable=True).indices
    return (order[:, :n].sort(dim=1).values + torch.arange(rows, device=x2d.device)[:, None] * m).reshape(-1)


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,m,n", [(1, 9000, 700), (3, 3000, 250), (5, 777, 40), (2, 2048, 100)])
def test_triton_two_pass_selection_matches_stable_sort(dtype: torch.dtype, rows: int, m: int, n: int) -> None:
    from lightning_opt.ops import _topk_triton as kt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = 512  # rows of 3000 / 777 entries split blocks, 2048 do not
    torch.manual_seed(5)
    x = (torch.randn(rows, m, device=dev) * 3).round().to(dtype)  # many ties at the cut-off
    x[0, 3], x[-1, 4], x[-1, 5] = float("nan"), -0.0, 0.0
    ref = _stable_sort_reference(x, n)
    lo = torch.full((rows,), -1e4, device=dev).to(dtype)
    assert torch.equal(kt.select_16bit(x, n, lo, block=block), ref)
    assert torch.equal(kt.select_16bit(x, n, lo, block=block, num_warps=8), ref)
    assert torch.equal(kt.select_16bit(x, n, lo), ref)  # the default launch shape
    assert topk_mod._select_16bit_works(x.device, block=block)  # the per-device self-check passes
    # a bound no row reaches: None (the caller falls back)
    assert kt.select_16bit(x, n, torch.full((rows,), 100.0, device=dev).to(dtype), block=block) is None
    # through batch_topk_rows: the Triton selection and the candidate path agree with the reference
    for backend in ("triton", "candidates"):
        idx, vals = batch_topk_rows(x, n, select_backend=backend, triton_block=block)
        assert torch.equal(idx, ref) and torch.equal(vals, x.reshape(-1)[idx])


def _nan_last_reference(x2d: torch.Tensor, n: int) -> torch.Tensor:
    """Per row the n largest, ties by smallest index, NaN ranked below every value (the one-pass fallback's rule
    for rows with fewer than n non-NaN entries); ascending flat indices."""
    rows, m = x2d.shape
    order = torch.sort(x2d.float().nan_to_num(float("-inf")), dim=1, descending=True, stable=True).indices
    nan_last = torch.sort(x2d.float().isnan().gather(1, order).to(torch.uint8), dim=1, stable=True).indices
    order = order.gather(1, nan_last)
    return (order[:, :n].sort(dim=1).values + torch.arange(rows, device=x2d.device)[:, None] * m).reshape(-1)


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,m,n", [(1, 9000, 700), (3, 3000, 250), (5, 777, 40), (2, 2048, 100)])
def test_triton_one_pass_selection_matches_stable_sort(dtype: torch.dtype, rows: int, m: int, n: int) -> None:
    """The one-pass selection on its fast path and through each of its rare paths: blocks with more hits than
    slots (read again from x), more candidates than the buffer, rows short of n (a bound too high): always the
    stable-sort answer, and the device flag says which path wrote it."""
    from lightning_opt.ops import _topk_triton as kt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = 512  # rows of 9000 / 3000 / 777 entries split blocks, 2048 do not
    torch.manual_seed(5)
    x = (torch.randn(rows, m, device=dev) * 3).round().to(dtype)  # many ties at the cut-off
    x[0, 3], x[-1, 4], x[-1, 5] = float("nan"), -0.0, 0.0
    ref = _stable_sort_reference(x, n)
    lo = x.float().nan_to_num(float("-inf")).topk(n, dim=1).values[:, -1].to(dtype)  # exact: ties pass too
    expect = n / m

    def run(bound: torch.Tensor, **kw) -> bool:
        got, fast = kt.select_16bit_1pass(x, n, bound, expect, block=block, **kw)
        assert got.dtype == torch.int64 and torch.equal(got, ref), kw
        return bool(fast)

    assert run(lo)  # fast path
    assert run(lo, num_warps=4) and run(lo, slot_cap=512)  # launch shape / no block over its slots
    # 16 slots per block: blocks with more hits are read again from x by the compaction
    hits = torch.nn.functional.pad((x >= lo[:, None]).reshape(-1).int(), (0, -(rows * m) % block))
    assert int(hits.view(-1, block).sum(1).max()) > 16
    assert run(lo, slot_cap=16, cand_cap=rows * m)
    # the device counters: calls, calls the fallback answered, blocks read again from x
    stats = torch.zeros(3, dtype=torch.int64, device=dev)
    kt.select_16bit_1pass(x, n, lo, expect, block=block, slot_cap=16, cand_cap=rows * m, stats=stats)
    over = int((hits.view(-1, block).sum(1) > 16).sum())
    assert stats.tolist() == [1, 0, over]
    kt.select_16bit_1pass(x, n, torch.full((rows,), 100.0, device=dev).to(dtype), expect, block=block, stats=stats)
    assert stats.tolist() == [2, 1, over]
    assert not run(lo, cand_cap=rows * n + 1) or int((x >= lo[:, None]).sum()) <= rows * n + 1  # ties overflow
    # every entry a candidate: more than the buffer holds
    assert not run(torch.full((rows,), -1e4, device=dev).to(dtype), cand_cap=rows * n)
    assert not run(torch.full((rows,), 100.0, device=dev).to(dtype))  # no candidates: rows short
    got, fast = kt.select_16bit_1pass(x, n, lo, expect)  # the default launch shape
    assert torch.equal(got, ref) and bool(fast)
    assert topk_mod._select_16bit_works(x.device, "triton", block, 8)  # the per-device self-check passes
    for backend in ("triton", "triton_2pass", "candidates"):  # through batch_topk_rows: identical indices
        idx, vals = batch_topk_rows(x, n, select_backend=backend, triton_block=block)
        assert torch.equal(idx, ref) and torch.equal(vals, x.reshape(-1)[idx]), backend


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
def test_triton_one_pass_rows_with_nan_and_sampled_bounds() -> None:
    from lightning_opt.ops import _topk_triton as kt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # a row with fewer than n non-NaN entries: no sync to raise, so its NaN entries come last (flat order)
    x = torch.randn(2, 3000, device=dev).to(torch.bfloat16)
    x[1, ::2] = float("nan")
    x[1, 1::4] = float("nan")  # row 1: 750 real values
    n = 1000
    for lo in (torch.full((2,), -1e4, device=dev), x.float().nan_to_num(-1e4).topk(n, dim=1).values[:, -1]):
        got, fast = kt.select_16bit_1pass(x, n, lo.to(x.dtype), n / 3000, block=512)
        assert not bool(fast) and torch.equal(got, _nan_last_reference(x, n))
    with pytest.raises(ValueError, match="fewer than 1000 non-NaN"):  # the synced paths raise instead
        batch_topk_rows(x, n, select_backend="candidates")
    # rows longer than the sample (2**18 columns): sampled bounds, the expected fraction sizes the buffers
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 300_000, generator=g).to(torch.bfloat16).to(dev)
    lo, expect = topk_mod._row_lower_bounds(x, 600)
    assert 600 / 300_000 < expect < 1.5 * 600 / 300_000
    idx, _ = batch_topk_rows(x, 600, select_backend="triton")
    assert torch.equal(idx, _stable_sort_reference(x, 600))
    got, fast = kt.select_16bit_1pass(x, 600, lo.to(x.dtype), expect)
    assert bool(fast) and torch.equal(got, idx)  # the sample's bound held: no fallback


def test_one_pass_capacities() -> None:
    from lightning_opt.ops import _topk_triton as kt

    # slots: a power of two, at least twice a block's expected hits, at most the block
    assert kt.stash_capacity(0.0, 4096) == 16
    for expect, block in ((1.4e-3, 4096), (5e-3, 2048), (0.03, 4096), (0.5, 4096), (1.0, 512)):
        cap = kt.stash_capacity(expect, block)
        assert cap & (cap - 1) == 0 and min(block, 2 * expect * block) <= cap <= block
    # candidates: 1.5 x expected + 1024 per row, at most the row
    assert kt.candidate_capacity(0.001, 12, 1_000_000) == 12 * 2524
    assert kt.candidate_capacity(0.9, 2, 1000) == 2000


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
def test_one_pass_argument_errors() -> None:
    from lightning_opt.ops import _topk_triton as kt

    x = torch.zeros(2, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block must be in"):
        kt.select_16bit_1pass(x, 5, torch.zeros(2, dtype=torch.bfloat16), 0.1, block=32)
    with pytest.raises(ValueError, match="n_keep must be"):
        kt.select_16bit_1pass(x, 0, torch.zeros(2, dtype=torch.bfloat16), 0.1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        kt.select_16bit_1pass(x.float(), 5, torch.zeros(2), 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and _triton_runs_here()), reason="needs CUDA and triton")
def test_triton_selection_parity_at_clt_scale_on_gpu() -> None:
    from lightning_opt.ops.global_topk import global_batch_topk

    g = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(12 * 4096 * 8192, device="cuda", generator=g).to(torch.bfloat16)
    n = 200 * 4096
    out = {}
    for select, backend in (("candidates", "torch"), ("candidates", "triton"), ("triton", "torch"),
                            ("triton_2pass", "torch")):
        paths = dict(select_backend=select, candidates_backend=backend)
        out[select, backend] = (batch_topk_rows(pre.view(1, -1), n, **paths)[0],
                                batch_topk_rows(pre.view(12, -1), n, **paths)[0],
                                global_batch_topk(pre.view(4096, -1), 200, candidates_backend=backend))
    ref = out["candidates", "torch"]
    for got in out.values():
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and _triton_runs_here()), reason="needs CUDA and triton")
def test_one_pass_selection_makes_no_host_sync_on_gpu() -> None:
    import warnings

    g = torch.Generator(device="cuda").manual_seed(0)
    pre = torch.randn(12 * 4096 * 4096, device="cuda", generator=g).to(torch.bfloat16).view(1, -1)
    for select in ("triton", "triton_2pass"):
        batch_topk_rows(pre, 200 * 4096, select_backend=select)  # compile and self-check first
    torch.cuda.synchronize()
    counts = {}
    for select in ("triton", "triton_2pass"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                batch_topk_rows(pre, 200 * 4096, select_backend=select)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts[select] = sum("synchroniz" in str(w.message) for w in caught)
    assert counts == {"triton": 0, "triton_2pass": 1}


def _ops_run(fn) -> set[str]:
    """Names of the aten ops ``fn()`` runs (CPU profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_threshold_method_argument_picks_the_threshold_step() -> None:
    # the histogram step counts order keys with index_add_; the top-k step never does
    x = torch.randn(2, 50_000, generator=torch.Generator().manual_seed(6))
    hist = _ops_run(lambda: batch_topk_rows(x, 500, threshold_method="histogram"))
    topk = _ops_run(lambda: batch_topk_rows(x, 500, threshold_method="topk"))
    assert "aten::index_add_" in hist and "aten::index_add_" not in topk


def test_clt_config_topk_paths_reach_the_selection_and_the_hparams() -> None:
    from lightning_opt.models.clt import CLTConfig
    from lightning_opt.modules.clt import CLTModule

    base = dict(n_layers=2, d_model=8, n_features=64, activation="batchtopk", k=4)
    x = torch.randn(64, 2, 8, generator=torch.Generator().manual_seed(7))
    selected, ops = {}, {}
    for method in ("histogram", "topk"):
        torch.manual_seed(0)
        cfg = CLTConfig(**base, topk_select_backend="candidates", topk_candidates_backend="torch",
                        topk_threshold_method=method)
        module = CLTModule(cfg)
        saved = module.hparams["clt"]
        assert (saved.topk_select_backend, saved.topk_candidates_backend, saved.topk_threshold_method) == (
            "candidates", "torch", method)
        pre = module.model.encode(x)
        ops[method] = _ops_run(lambda clt=module.model, pre=pre: clt.activate(pre))
        selected[method] = module.model.activate(pre)[1]
    assert torch.equal(selected["histogram"], selected["topk"])  # the same entries either way
    assert "aten::index_add_" in ops["histogram"] and "aten::index_add_" not in ops["topk"]
    with pytest.raises(ValueError, match="threshold_method='sort' is unknown"):
        CLTConfig(**base, topk_threshold_method="sort")  # type: ignore[arg-type]


@pytest.mark.skipif(not _triton_runs_here(), reason="needs triton on CUDA (or TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 3)])
def test_grad_kept_matches_the_torch_gather_dot(dtype: torch.dtype, d: int) -> None:
    """The CLT dense decode's gradient at the kept entries, every source layer in one launch (no layer bounds on
    the host), against the per-layer torch gather-dot; rows 16-byte aligned (vector loads) or not (d=3)."""
    from lightning_opt.models import clt as clt_mod
    from lightning_opt.ops import _topk_triton as kt

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    L, N, nf = 4, 9, 13
    ws = [torch.randn(nf, (L - s) * d, generator=gen).to(dev, dtype) for s in range(L)]
    g = torch.randn(N, L, d, generator=gen).to(dev, dtype)
    idx = torch.randperm(L * N * nf, generator=gen)[:100].sort().values.to(dev)
    idx = idx[idx >= N * nf]  # no entry in layer 0: a layer without entries
    got = kt.grad_kept(idx, g, ws, N, nf)
    ref = clt_mod._grad_at_kept_torch(idx, g, ws, N, nf)
    assert got.dtype == torch.float32 and got.shape == idx.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert kt.grad_kept(idx[:0], g, ws, N, nf).numel() == 0
    assert clt_mod._grad_kept_works(torch.device(dev))
    with pytest.raises(ValueError, match="weights"):
        kt.grad_kept(idx, g, [w.t() for w in ws], N, nf)
