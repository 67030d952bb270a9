"""lightning_opt/recipes/spd.py (lightning-opt-spd) end to end on CPU: the real CLI, configs and metrics.json, at tiny sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_opt.recipes import CONFIGS

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def _main():
    from lightning_opt.recipes import spd

    return spd.main


def _run(tmp_path: Path, config: str, *extra: str) -> dict:
    args = [
        "--config", str(CONFIGS / config),
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        *extra,
    ]
    metrics = _main()(args)
    files = list(tmp_path.rglob("metrics.json"))
    assert len(files) == 1
    on_disk = json.loads(files[0].read_text())
    assert on_disk["steps"] == metrics["steps"]
    return on_disk


def test_tms_recipe_writes_mmcs_ml2r_ci_l0(tmp_path):
    m = _run(
        tmp_path, "spd_tms_5-2.yaml",
        "--trainer.max_steps", "20", "--model.target.train_steps", "200",
        "--model.train.batch_size", "256", "--model.train.faithfulness_warmup_steps", "20",
    )
    assert m["steps"] == 20
    for k in ("mmcs", "ml2r", "ci_l0", "identity_ci_error/linear1"):
        assert math.isfinite(m[k]), k
    assert -1.0 <= m["mmcs"] <= 1.0


@pytest.mark.parametrize("config", ["spd_tms_40-10.yaml", "spd_tms_5-2-id.yaml", "spd_resid_mlp1.yaml", "spd_resid_mlp2.yaml", "spd_resid_mlp3.yaml"])
def test_other_toy_configs_parse_and_run_two_steps(tmp_path, config):
    m = _run(
        tmp_path, config,
        "--trainer.max_steps", "2", "--model.target.train_steps", "5",
        "--model.train.batch_size", "64", "--model.train.faithfulness_warmup_steps", "2",
        "--model.train.eval_batches", "1",
    )
    assert m["steps"] == 2 and math.isfinite(m["ci_l0"])


def test_lm_demo_recipe_reports_ce_and_kl_under_masks(tmp_path):
    m = _run(
        tmp_path, "spd_lm_demo.yaml",
        "--trainer.max_steps", "3", "--model.target.train_steps", "10",
        "--model.train.batch_size", "2", "--model.train.faithfulness_warmup_steps", "5",
        "--model.train.eval_batches", "1",
    )
    for k in ("ce/target", "ce/ci", "ce/stochastic", "ce/unmasked", "ce/zero", "kl/ci", "kl/zero"):
        assert math.isfinite(m[k]), k
    assert m["kl/unmasked"] >= 0


def test_there_is_no_hand_written_yaml_parser(tmp_path):
    """``--plain`` (a YAML parser of the recipe's own that instantiated any ``class_path``) is gone: the flag is
    an error of LightningCLI's parser, and a logger whose class_path is not a Logger is refused unbuilt."""
    marker = tmp_path / "ran"
    config = CONFIGS / "spd_tms_5-2.yaml"
    with pytest.raises(SystemExit):
        _main()(["--plain", "--config", str(config)])
    with pytest.raises(SystemExit):
        _main()(["--config", str(config), "--trainer.logger.class_path", "os.system",
                 "--trainer.logger.init_args.command", f"touch {marker}"])
    assert not marker.exists()
    source = (ROOT / "lightning_opt" / "recipes" / "spd.py").read_text()
    assert "import yaml" not in source and "import_module" not in source


def test_plot_path_writes_a_copy_of_the_components_plot(tmp_path):
    """``--plot_path`` puts the components-vs-features plot where a GPU command can fetch it (TMS 40-10:
    the cosine panel for more than 2 hidden dimensions is drawn too)."""
    out = tmp_path / "top" / "spd_tms_40-10_components.png"
    _run(
        tmp_path / "run", "spd_tms_40-10.yaml", "--plot_path", str(out),
        "--trainer.max_steps", "2", "--model.target.train_steps", "5",
        "--model.train.batch_size", "64", "--model.train.faithfulness_warmup_steps", "2",
        "--model.train.eval_batches", "1",
    )
    in_run = list((tmp_path / "run").rglob("components.png"))
    assert len(in_run) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.read_bytes() == in_run[0].read_bytes()
    with pytest.raises(SystemExit):  # jsonargparse: "expected one argument"
        _main()(["--config", str(CONFIGS / "spd_tms_40-10.yaml"), "--plot_path"])
