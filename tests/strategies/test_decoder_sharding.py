"""Decoder sharding on 2 gloo ranks equals one process: training, loss hooks, checkpoints both formats."""

from __future__ import annotations

import pytest
import torch
from _clt_helpers import TinyCLTModule, assert_states_close, fit_single

from lightning_opt.strategies import DecoderShardingStrategy


def _adam_module() -> TinyCLTModule:
    return TinyCLTModule(loss="mse", optimizer="adam", lr=0.01, batch_size=8)


def test_fit_matches_single_process_and_module_is_whole_after_fit(strategy_runs: dict, tmp_path) -> None:
    result = strategy_runs["sharded_mse_consolidated"]
    reference = fit_single(_adam_module(), tmp_path)
    # Full-width tensors again after fit (the strategy gathers the shards at teardown).
    assert_states_close(result["state"], reference)
    # Validation inside fit (after step 2) ran on the whole module, and training went on sharded.
    assert result["val_shapes"] and all(
        s[-1] == reference["clt.b_dec"].shape[-1] for s in result["val_shapes"]
    )


def test_fvu_through_loss_hooks_and_norm_clipping_match_single_process(strategy_runs: dict, tmp_path) -> None:
    from _fit_worker import CLIP

    reference = fit_single(TinyCLTModule(loss="fvu", batch_size=8), tmp_path, gradient_clip_val=CLIP)
    assert_states_close(strategy_runs["sharded_fvu"]["state"], reference)


def test_consolidated_checkpoint_loads_and_resumes_in_one_process(strategy_runs: dict, tmp_path) -> None:
    ckpt = torch.load(strategy_runs["sharded_mse_consolidated"]["ckpt"], weights_only=False)
    module = _adam_module()
    module.load_state_dict(ckpt["state_dict"])  # full shapes: loads with no strategy at all
    assert_states_close(dict(module.state_dict()), fit_single(_adam_module(), tmp_path / "a", max_steps=2))
    params = dict(module.named_parameters())
    names = list(params)
    for idx, state in ckpt["optimizer_states"][0]["state"].items():
        assert state["exp_avg"].shape == params[names[idx]].shape
    # Resuming the consolidated checkpoint in one process continues the same run.
    import lightning.pytorch as pl
    from _clt_helpers import trainer_kwargs

    resumed = _adam_module()
    pl.Trainer(devices=1, **trainer_kwargs(tmp_path / "b")).fit(
        resumed, ckpt_path=strategy_runs["sharded_mse_consolidated"]["ckpt"]
    )
    assert_states_close(dict(resumed.state_dict()), fit_single(_adam_module(), tmp_path / "c"))


def test_sharded_checkpoint_writes_one_file_per_shard_and_resumes(strategy_runs: dict, tmp_path) -> None:
    result = strategy_runs["sharded_checkpoint_resume"]
    assert result["files"] == ["decoder_shard_000_of_002.ckpt", "decoder_shard_001_of_002.ckpt"]
    assert_states_close(result["state"], fit_single(_adam_module(), tmp_path))


def test_pure_data_parallel_layout_matches_big_batch(strategy_runs: dict, tmp_path) -> None:
    reference = fit_single(TinyCLTModule(loss="mse", batch_size=16), tmp_path)
    assert_states_close(strategy_runs["data_parallel_via_sharding_strategy"]["state"], reference)


def test_the_model_computes_its_own_shard_like_the_whole_model(strategy_runs: dict) -> None:
    # CLT.shard_ on 2 gloo ranks, no Trainer: recon columns, every gradient slice, the clipping norm and the
    # gathered (evaluation) output equal the whole CLT in one process; the forward is the class's own
    for rank, checks in enumerate(strategy_runs["model_owns_its_shard"]["per_rank"]):
        for name, c in checks.items():
            where = f"rank {rank}, {name}"
            assert c["max_err"] < 1e-5 and c["norm_err"] < 1e-5 and c["gathered_err"] < 1e-5, (where, c)
            assert c["own_methods"] == [] and c["forward_is_the_class"], where
            assert c["new_parameters"] and c["whole_again"], where
        assert checks["replicated"]["shapes"][-1] == (3, 4)  # b_dec: [L, d_model / 2]
        assert checks["features"]["shapes"][-2:] == [(3, 8, 8), (3, 8)]  # W_enc, b_enc: half the features


def test_strategy_sets_a_spec_and_overrides_no_method(strategy_runs: dict) -> None:
    # no instance attribute shadows a method of the CLT or of the precision plugin during training
    for name in ("sharded_mse_consolidated", "sharded_encoder", "sharded_fvu"):
        assert strategy_runs[name]["overrides"] == set(), name


def test_norm_clipping_of_shards_refuses_lightnings_default_hook(strategy_runs: dict) -> None:
    message = strategy_runs["clipping_needs_the_hook"]["error_message"]
    assert message is not None and "clip_grad_norm_" in message


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="checkpoint_format"):
        DecoderShardingStrategy(checkpoint_format="zip")
    with pytest.raises(ValueError, match="model_parallel_size"):
        DecoderShardingStrategy(model_parallel_size=0)
    with pytest.raises(ValueError, match="selection"):
        DecoderShardingStrategy(selection="fastest")


def test_project_clt_module_trains_sharded_like_one_process(strategy_runs: dict, tmp_path) -> None:
    import lightning.pytorch as pl
    from _clt_helpers import loader, make_clt_module, params_of, trainer_kwargs

    module = make_clt_module()
    pl.Trainer(devices=1, **trainer_kwargs(tmp_path, limit_val_batches=0)).fit(
        module, train_dataloaders=loader(8)
    )
    assert_states_close(strategy_runs["clt_module_sharded"]["params"], params_of(module))


def test_feature_sharded_encoders_match_single_process(strategy_runs: dict, tmp_path) -> None:
    result = strategy_runs["sharded_encoder"]
    assert_states_close(result["state"], fit_single(_adam_module(), tmp_path / "a"))
    assert result["val_shapes"]
    # The consolidated checkpoint holds full-width encoders too and loads in one process.
    ckpt = torch.load(result["ckpt"], weights_only=False)
    module = _adam_module()
    module.load_state_dict(ckpt["state_dict"])
    assert_states_close(dict(module.state_dict()), fit_single(_adam_module(), tmp_path / "b", max_steps=2))


def test_feature_sharded_encoders_fall_back_when_the_padded_pool_is_too_small(strategy_runs: dict, tmp_path) -> None:
    result = strategy_runs["sharded_encoder_fallback"]
    assert result["synced_selections"] > 0  # the check fired and the synced path ran
    assert_states_close(result["state"], fit_single(_adam_module(), tmp_path / "a"))


def test_project_clt_module_with_feature_sharded_encoders(strategy_runs: dict, tmp_path) -> None:
    import lightning.pytorch as pl
    from _clt_helpers import loader, make_clt_module, params_of, trainer_kwargs

    module = make_clt_module()
    pl.Trainer(devices=1, **trainer_kwargs(tmp_path, limit_val_batches=0)).fit(
        module, train_dataloaders=loader(8)
    )
    assert_states_close(strategy_runs["clt_module_sharded_encoder"]["params"], params_of(module))
