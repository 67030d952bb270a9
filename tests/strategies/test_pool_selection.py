"""The pool selection of feature-sharded encoders: exact top-n with the position tie rule, padding ignored."""

from __future__ import annotations

import pytest
import torch

from lightning_opt.ops.global_topk import top_positions


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
