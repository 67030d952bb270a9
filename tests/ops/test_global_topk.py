"""Exactness of global_batch_topk against a single-process stable-sort reference, on 1 and 2 gloo ranks."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from lightning_opt.ops import global_topk
from lightning_opt.ops.global_topk import batch_topk_threshold_sparse, global_batch_topk
from tests._fork import fork_ranks


def reference_batch_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the first k * tokens entries of a stable descending sort: (value desc, flat index asc)."""
    flat = x.reshape(-1)
    budget = min(k * x.shape[0], flat.numel())
    order = torch.sort(flat, descending=True, stable=True).indices[:budget]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order] = True
    return torch.where(mask, flat, torch.zeros_like(flat)).view_as(x)


def _mask(x: torch.Tensor, k: int) -> torch.Tensor:
    flat = x.reshape(-1)
    budget = min(k * x.shape[0], flat.numel())
    order = torch.sort(flat, descending=True, stable=True).indices[:budget]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order] = True
    return mask.view_as(x)


# Each case: (tokens per rank, features, k, value generator). Small integer values make many ties.
def _cases() -> list[tuple[list[int], int, int, str]]:
    return [
        ([16, 16], 64, 4, "normal"),
        ([5, 27], 32, 3, "ties"),  # unequal tokens, heavy ties at the threshold
        ([1, 4], 8, 6, "normal"),  # K = 30 > rank 0's 8 entries
        ([0, 6], 10, 2, "ties"),  # a rank with no tokens
        ([3, 3], 4, 4, "ties"),  # K >= all entries: everything kept
        ([700, 600], 512, 8, "ties"),  # large enough for the sampled bound (n > 2**18)
    ]


def _make(tokens: list[int], features: int, kind: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for t in tokens:
        if kind == "ties":
            xs.append(torch.randint(-3, 4, (t, features), generator=gen).float())
        else:
            xs.append(torch.randn(t, features, generator=gen))
    return xs


@pytest.mark.parametrize("case", _cases())
def test_single_process_matches_reference(case: tuple[list[int], int, int, str]) -> None:
    tokens, features, k, kind = case
    x = torch.cat(_make(tokens, features, kind, seed=1))
    out = global_batch_topk(x, k)
    torch.testing.assert_close(out, reference_batch_topk(x, k), rtol=0, atol=0)
    idx, _ = batch_topk_threshold_sparse(x, k)
    assert torch.equal(idx, _mask(x, k).reshape(-1).nonzero().squeeze(1))


def test_exact_count_and_tie_rule_first_index_wins() -> None:
    x = torch.tensor([[1.0, 2.0, 2.0, 0.5], [2.0, 2.0, 1.0, 3.0]])
    idx, vals = batch_topk_threshold_sparse(x, k=2)  # K = 4: the 3.0, then three of the four 2.0s
    assert idx.tolist() == [1, 2, 4, 7]
    assert vals.tolist() == [2.0, 2.0, 2.0, 3.0]


def test_gradients_reach_only_kept_entries() -> None:
    x = torch.randn(12, 20, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 20, dtype=torch.float64)
    (global_batch_topk(x, 3) * weight).sum().backward()
    mask = _mask(x.detach(), 3)
    torch.testing.assert_close(x.grad, weight * mask)


def test_fallback_when_sampled_bound_is_too_high(monkeypatch: pytest.MonkeyPatch) -> None:
    # An overestimated bound yields fewer than K candidates: the exact top-K path must take over.
    monkeypatch.setattr(global_topk, "_lower_bound", lambda flat, frac: flat.max())
    x = torch.randint(-3, 4, (40, 30)).float()
    torch.testing.assert_close(global_batch_topk(x, 5), reference_batch_topk(x, 5), rtol=0, atol=0)


def test_local_group_and_candidate_backends_match_reference() -> None:
    # without an initialised process group, None and "local" both select over this process's batch
    x = torch.randint(-3, 4, (40, 30)).float()
    ref = reference_batch_topk(x, 5)
    torch.testing.assert_close(global_batch_topk(x, 5, group="local"), ref, rtol=0, atol=0)
    torch.testing.assert_close(global_batch_topk(x, 5, candidates_backend="torch"), ref, rtol=0, atol=0)
    idx, _ = batch_topk_threshold_sparse(x, 5, group="local", candidates_backend="torch")
    assert torch.equal(idx, _mask(x, 5).reshape(-1).nonzero().squeeze(1))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="shape"):
        global_batch_topk(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="non-negative int"):
        global_batch_topk(torch.zeros(2, 3), -1)
    with pytest.raises(RuntimeError, match="not initialised"):
        global_batch_topk(torch.zeros(2, 3), 1, group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'local'"):
        global_batch_topk(torch.zeros(2, 3), 1, group="world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="candidates_backend"):
        global_batch_topk(torch.zeros(2, 3), 1, candidates_backend="cuda")  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:  # an exception here fails fork_ranks in the parent with this rank's traceback
        for i, (tokens, features, k, kind) in enumerate(_cases()):
            xs = _make(tokens, features, kind, seed=10 + i)
            full = torch.cat(xs)
            expected = reference_batch_topk(full, k)
            x = xs[rank].double().requires_grad_(True)
            out = global_batch_topk(x, k, group=dist.group.WORLD)
            start = sum(tokens[:rank])
            exp = expected[start : start + tokens[rank]].double()
            if not torch.equal(out.detach(), exp):
                raise AssertionError(
                    f"case {i} rank {rank}: output differs from the single-process reference"
                )
            # Gradient of sum(out * w) is w on kept entries.
            w = torch.arange(x.numel(), dtype=torch.float64).view_as(x) + 1
            (out * w).sum().backward()
            mask = _mask(full, k)[start : start + tokens[rank]]
            if not torch.equal(x.grad, w * mask):
                raise AssertionError(f"case {i} rank {rank}: gradient is not the kept mask")
        # Ranks hold different features of the same tokens (encoders sharded over features).
        full = torch.randn(24, 40, generator=torch.Generator().manual_seed(7))
        half = full.shape[1] // world
        part = full[:, rank * half : (rank + 1) * half].clone().requires_grad_(True)
        out = global_batch_topk(part, 3, group=dist.group.WORLD, tokens_total=full.shape[0])
        expected = reference_batch_topk(full, 3)[:, rank * half : (rank + 1) * half]
        if not torch.equal(out.detach(), expected):
            raise AssertionError(f"rank {rank}: feature-split selection differs from the reference")
        out.sum().backward()
        if not torch.equal(part.grad, (expected != 0).float()):
            raise AssertionError(f"rank {rank}: feature-split gradient is not the kept mask")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_single_process() -> None:
    fork_ranks(_worker, (2, _free_port()), 2)


def _default_group_worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # rank 0's entries are all larger than rank 1's: a global budget goes mostly to rank 0
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(8, 16, generator=gen) + 10.0, torch.randn(8, 16, generator=gen)]
        k = 4
        full = torch.cat(xs)
        x = xs[rank]
        out = global_batch_topk(x, k)  # group left out: the default (initialised) process group
        kept = torch.tensor([int((out != 0).sum())])
        dist.all_reduce(kept)
        if int(kept) != k * full.shape[0]:
            raise AssertionError(f"rank {rank}: default group kept {int(kept)} over the group, not k * 16")
        expected = reference_batch_topk(full, k)[rank * 8 : (rank + 1) * 8]
        if not torch.equal(out, expected):
            raise AssertionError(f"rank {rank}: default group differs from the global reference")
        idx, _ = batch_topk_threshold_sparse(x, k)
        if not torch.equal(idx, (expected != 0).reshape(-1).nonzero().squeeze(1)):
            raise AssertionError(f"rank {rank}: sparse default group differs from the global reference")
        local = global_batch_topk(x, k, group="local")  # per-rank BatchTopK: k * 8 on every rank
        if int((local != 0).sum()) != k * x.shape[0] or not torch.equal(local, reference_batch_topk(x, k)):
            raise AssertionError(f"rank {rank}: group='local' is not the per-rank selection")
        idx, _ = batch_topk_threshold_sparse(x, k, group="local")
        if idx.numel() != k * x.shape[0]:
            raise AssertionError(f"rank {rank}: sparse group='local' kept {idx.numel()}, not k * 8")
    finally:
        dist.destroy_process_group()


def test_default_group_is_global_and_local_is_per_rank_on_two_gloo_ranks() -> None:
    fork_ranks(_default_group_worker, (2, _free_port()), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference_at_scale(dtype: torch.dtype) -> None:
    # 1024 x 49,152 entries (the sampled bound path), bf16 has many exact ties at the threshold.
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1024, 49152, device="cuda", generator=gen).to(dtype)
    out = global_batch_topk(x, 64)
    torch.testing.assert_close(out, reference_batch_topk(x, 64), rtol=0, atol=0)
    idx, _ = batch_topk_threshold_sparse(x, 64)
    assert idx.numel() == 64 * 1024
