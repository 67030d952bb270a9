"""Global BatchTopK on 2 gloo ranks with batch B equals one process with batch 2B: masks, losses, grads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _clt_helpers import (
    TinyCLTModule,
    assert_states_close,
    fit_single,
    loader,
    make_clt,
    make_clt_module,
    make_data,
    params_of,
    trainer_kwargs,
)

from lightning_opt.models.clt_parallel import sum_forward
from lightning_opt.strategies import GlobalBatchTopKStrategy

WORLD = 2


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_equivalence() -> dict[str, float]:
    """Run inside an initialised 2-rank gloo group; raises on any mismatch."""
    rank = dist.get_rank()
    checked = {}
    x, y = make_data(n=24)
    per = x.shape[0] // WORLD
    sl = slice(rank * per, (rank + 1) * per)
    for loss_kind in ("mse", "fvu"):
        # Reference: one process, the whole batch, local BatchTopK.
        ref = make_clt()
        out_ref = ref(x)
        if loss_kind == "mse":
            loss_ref = F.mse_loss(out_ref.recon, y)
        else:
            loss_ref = ((y - out_ref.recon) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
        loss_ref.backward()

        # Distributed: this rank's half, global BatchTopK, gradients averaged like DDP.
        clt = make_clt()
        clt.topk_group = dist.group.WORLD
        out = clt(x[sl])
        if loss_kind == "mse":
            loss = F.mse_loss(out.recon, y[sl])
        else:
            n = torch.tensor(float(per))
            dist.all_reduce(n)
            total = y[sl].sum(0)
            dist.all_reduce(total)
            sst = sum_forward(((y[sl] - total / n) ** 2).sum().detach(), dist.group.WORLD, WORLD)
            loss = sum_forward(((y[sl] - out.recon) ** 2).sum(), dist.group.WORLD, WORLD) / sst
        loss.backward()
        for p in clt.parameters():
            dist.all_reduce(p.grad)
            p.grad /= WORLD

        mask_ref = out_ref.acts[:, sl] != 0
        if not torch.equal(out.acts != 0, mask_ref):
            raise AssertionError(f"{loss_kind}: rank {rank} kept a different set of entries")
        active = (out.acts != 0).sum(dim=(0, 2)).float().mean()
        mean_loss = loss.detach().clone()
        if loss_kind == "mse":
            dist.all_reduce(mean_loss)
            mean_loss /= WORLD
        torch.testing.assert_close(mean_loss, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        for name, g in _grads(clt).items():
            torch.testing.assert_close(g, _grads(ref)[name], rtol=1e-4, atol=1e-6, msg=f"{loss_kind} {name}")
        if not active > 0:
            raise AssertionError("no active features: the check is vacuous")
        checked[loss_kind] = float(mean_loss)
    return checked


def run_counts() -> dict[str, list[int]]:
    """Kept counts from the selection (no count exchange) and the gather that uses them, on 2 ranks."""
    from lightning_opt.models.clt_parallel import gather_sparse
    from lightning_opt.ops.global_topk import batch_topk_threshold_sparse

    rank = dist.get_rank()
    # Ties at the threshold across both ranks: the counts must follow the (rank, flat index) tie rule.
    x = torch.tensor([[3.0, 2.0, 2.0, 1.0], [2.0, 0.5, 2.0, 0.0]]) if rank == 0 else torch.full((2, 4), 2.0)
    x = x.clone().requires_grad_(True)
    idx, vals, counts = batch_topk_threshold_sparse(x, k=2, group=dist.group.WORLD, return_counts=True)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(WORLD)]
    dist.all_gather(sizes, torch.tensor([idx.numel()]))
    if counts != [int(s) for s in sizes] or sum(counts) != 2 * 4:
        raise AssertionError(f"counts {counts} != kept sizes {[int(s) for s in sizes]} (K=8)")
    # Totals given by the caller (no sizing sync): same selection; and K >= all entries keeps everything.
    idx2, _, counts2 = batch_topk_threshold_sparse(
        x, k=2, group=dist.group.WORLD, tokens_total=4, numel_total=16, return_counts=True
    )
    assert torch.equal(idx2, idx) and counts2 == counts
    idx3, _, counts3 = batch_topk_threshold_sparse(
        x, k=4, group=dist.group.WORLD, tokens_total=4, numel_total=16, return_counts=True
    )
    assert idx3.numel() == 8 and counts3 == [8, 8]
    with_counts = gather_sparse(idx, vals, dist.group.WORLD, WORLD, counts=counts)
    without = gather_sparse(idx, vals, dist.group.WORLD, WORLD)
    for a, b in zip(with_counts, without):
        torch.testing.assert_close(a, b)
    # Backward: each rank gets the summed gradient of its own entries (both ranks weight by 1 + rank).
    (with_counts[1] * (1.0 + rank)).sum().backward()
    expected = torch.zeros(8).index_put_((idx,), torch.full((idx.numel(),), 3.0))
    torch.testing.assert_close(x.grad.view(-1), expected)
    try:
        gather_sparse(idx, vals, dist.group.WORLD, WORLD, counts=[c + 1 for c in counts])
    except ValueError:
        pass
    else:
        raise AssertionError("wrong counts were accepted")
    return {"counts": counts}


def test_selection_counts_feed_the_sparse_gather(strategy_runs: dict) -> None:
    # rank 0 holds 3.0 and four 2.0s; rank 1 eight 2.0s: K=8 takes 3.0, rank 0's 2.0s, then 3 of rank 1's
    assert strategy_runs["counts"]["counts"] == [5, 3]


def test_16bit_grad_compression_trains_close_to_exact_but_not_bitwise(strategy_runs: dict, tmp_path) -> None:
    reference = fit_single(TinyCLTModule(loss="mse", batch_size=16), tmp_path)
    state, exact = strategy_runs["global_fp16"]["state"], strategy_runs["global_mse"]["state"]
    assert_states_close(state, reference, tol=1e-4)

    def max_diff(got: dict[str, torch.Tensor]) -> float:
        return max(float((got[k] - reference[k]).abs().max()) for k in reference)

    # The hook was active: rounding the gradients moves the result well beyond the exact run's float noise.
    assert max_diff(state) > 10 * max_diff(exact)


def test_sigterm_flag_goes_over_a_cpu_group_and_stops_every_rank(strategy_runs: dict) -> None:
    # Both strategies replace Lightning's per-step device broadcast + .item() (a GPU drain per step) with a
    # gloo broadcast from rank 0; a signal seen by rank 0 alone still stops both ranks.
    per_rank = strategy_runs["sigterm_on_cpu"]["per_rank"]
    for flags in per_rank:
        for name in ("global", "sharded"):
            assert flags[name] == {"installed": "broadcast_sigterm_on_cpu", "stopped": True}, (name, flags)


def test_grad_compression_is_validated() -> None:
    with pytest.raises(ValueError, match="grad_compression"):
        GlobalBatchTopKStrategy(grad_compression="int8")
    with pytest.raises(ValueError, match="not both"):
        GlobalBatchTopKStrategy(grad_compression="bf16", ddp_comm_hook=lambda state, bucket: None)
    assert GlobalBatchTopKStrategy()._ddp_kwargs["gradient_as_bucket_view"] is True


def test_two_ranks_equal_one_big_batch_masks_losses_grads(strategy_runs: dict) -> None:
    result = strategy_runs["equivalence"]
    assert set(result) >= {"mse", "fvu"}


def test_trainer_fit_mse_matches_single_process_big_batch(strategy_runs: dict, tmp_path) -> None:
    result = strategy_runs["global_mse"]
    assert result["topk_modules"] == 1
    assert result["topk_after"] is None  # teardown restores the local BatchTopK
    reference = fit_single(TinyCLTModule(loss="mse", batch_size=16), tmp_path)
    assert_states_close(result["state"], reference)


def test_trainer_fit_fvu_via_loss_sum_matches_single_process(strategy_runs: dict, tmp_path) -> None:
    reference = fit_single(TinyCLTModule(loss="fvu", batch_size=16), tmp_path)
    assert_states_close(strategy_runs["global_fvu"]["state"], reference)


def test_strategy_refuses_a_model_without_topk_group(tmp_path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(
        strategy=GlobalBatchTopKStrategy(), devices=1, **trainer_kwargs(tmp_path, max_steps=1)
    )
    try:
        with pytest.raises(ValueError, match="topk_group"):
            trainer.fit(BoringModel())
    finally:  # the 1-rank DDP group must not leak into later tests of this process
        if dist.is_initialized():
            dist.destroy_process_group()


def test_project_clt_module_trains_under_the_strategy_like_one_big_batch(
    strategy_runs: dict, tmp_path
) -> None:
    import lightning.pytorch as pl

    module = make_clt_module()
    pl.Trainer(devices=1, **trainer_kwargs(tmp_path, limit_val_batches=0)).fit(
        module, train_dataloaders=loader(16)
    )
    assert_states_close(strategy_runs["clt_module_global"]["params"], params_of(module))
