"""The GPT-2 recipe scaling benchmark's plan, time-to-target interpolation and efficiency summary."""

from __future__ import annotations

import pytest

from benchmarks.gpt2_recipe_scaling import parse_plan, summarise, time_to


def test_plan_groups_run_in_order_and_lanes_name_their_gpus() -> None:
    assert parse_plan("1@0 2@1,2 | 4@0,1,2,3") == [[(1, "0"), (2, "1,2")], [(4, "0,1,2,3")]]
    assert parse_plan("1 2") == [[(1, None), (2, None)]]
    with pytest.raises(SystemExit, match="names 1 GPUs for 2"):
        parse_plan("2@0")


def test_time_to_target_interpolates_between_the_val_points_around_it() -> None:
    curve = [{"step": 10, "val_loss": 5.0, "train_time_s": 10.0}, {"step": 20, "val_loss": 4.0, "train_time_s": 20.0}]
    assert time_to(curve, 4.5) == (15.0, 20)
    assert time_to(curve, 5.0) == (10.0, 10)
    assert time_to(curve, 3.9) == (None, None)


def test_summary_is_against_the_one_gpu_row_of_the_same_call() -> None:
    rows = [{"gpus": 1, "steady_tokens_per_s": 100.0, "time_to_target_s": 40.0},
            {"gpus": 4, "steady_tokens_per_s": 360.0, "time_to_target_s": 11.0}]
    out = summarise(rows)
    assert out["efficiency_4gpu"] == 0.9 and out["goal_efficiency_4gpu_ge_0p90"] is True
    assert out["time_to_target_s_ratio_4gpu_over_1gpu"] == 0.275 and out["goal_time_to_target_4gpu_le_0p30"] is True
    assert summarise(rows[1:]) == {}  # no 1-GPU row: nothing to compare with
