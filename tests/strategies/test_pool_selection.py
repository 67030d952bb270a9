"""The pool selection of feature-sharded encoders: exact top-n with the position tie rule, padding ignored."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.ops import global_topk
from lightning_opt.ops.global_topk import shard_candidates_padded, top_positions


def _reference(values: torch.Tensor, valid: torch.Tensor, n_keep: int) -> torch.Tensor:
    # stable descending sort of the valid entries: ties keep the smaller position first
    v = torch.where(valid, values.float(), float("-inf"))
    order = torch.sort(v, descending=True, stable=True).indices
    return torch.sort(order[:n_keep]).values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_positions_match_a_stable_sort_with_ties_and_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # few distinct values: many ties at the cut-off; -0.0 and +0.0 are equal values
    values = torch.randint(-6, 7, (4000,), generator=gen).to(dtype) / 2
    values[::97] = -0.0
    valid = torch.rand(4000, generator=gen) > 0.3
    values[~valid] = float("nan")  # padding holds garbage; it must never be chosen
    for n_keep in (1, 17, 1000, int(valid.sum())):
        got = top_positions(values, valid, n_keep)
        assert torch.equal(got, _reference(values, valid, n_keep)), (dtype, n_keep)
    assert torch.equal(top_positions(values[valid], None, 5), _reference(values[valid], valid[valid], 5))


def test_padded_candidates_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # one process (group None): the padded buffers hold nonzero(x >= bound) then -1, and ok says whether they
    # hold at least K candidates and all of them
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3000, generator=gen).to(torch.bfloat16)
    k = 20
    idx, counts, ok = shard_candidates_padded(x, k, None, 64)
    count = int(counts[0])
    assert bool(ok) and count >= k * 64 and idx.numel() > count
    flat = x.reshape(-1)
    lo = flat[idx[:count]].min()
    assert torch.equal(idx[:count], torch.nonzero(flat >= lo).squeeze(1))
    assert bool((idx[count:] == -1).all())
    # the pool's top K equals the exact top K of x
    top = top_positions(flat[idx[:count]], None, k * 64)
    ref = torch.sort(torch.sort(flat.float(), descending=True, stable=True).indices[: k * 64]).values
    assert torch.equal(idx[:count][top], ref)
    # a capacity below the count: ok is false (the caller falls back)
    monkeypatch.setattr(global_topk, "_sample_rank", lambda s, frac: 1)
    assert not bool(shard_candidates_padded(x, k, None, 64)[2])
    # a bound too high (fewer than K candidates): ok is false
    monkeypatch.undo()
    monkeypatch.setattr(global_topk, "_lower_bound", lambda flat, frac: flat.max().float())
    assert not bool(shard_candidates_padded(x, k, None, 64)[2])
