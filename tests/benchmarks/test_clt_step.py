"""benchmarks/clt_step.py on CPU (``--smoke``): the selection's paths side by side with their exactness checks and
the module step's host-sync field, written where the GPU run's result is read from."""

from __future__ import annotations

import json
import os

import pytest

from tests.benchmarks._load import load_benchmark


def _bench():
    return load_benchmark("clt_step")


def _triton_interpreted() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


def test_smoke_selection_and_module(tmp_path) -> None:
    out = tmp_path / "clt_step.json"
    report = _bench().main(["--smoke", "--features", "64", "--variants", "select", "module", "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["results"] == json.loads(json.dumps(report["results"]))
    for key in ("device", "command", "torch", "shapes"):
        assert key in on_disk, key
    row = on_disk["results"]["64"]
    for key in ("select_ours", "select_ours_candidates", "select_ours_torch_candidates", "select_ours_per_layer",
                "phase_candidates", "select_torch_topk", "select_global_topk"):
        assert row[key]["median_ms"] > 0, key
    assert row["select_exact"] is True and row["select_backends_agree"] is True and row["select_ties_exact"] is True
    assert row["select_path"] in ("triton_1pass", "candidates")
    assert set(row["select_host_syncs"]) >= {"select_ours", "select_ours_candidates"}
    assert row["module"]["host_syncs_per_step"] == "not counted on CPU" and row["module"]["median_ms"] > 0
    assert row["module"]["log_every_n_steps"] == 50


@pytest.mark.skipif(not _triton_interpreted(), reason="needs triton with TRITON_INTERPRET=1")
def test_smoke_one_pass_selection_beside_the_two_pass(tmp_path) -> None:
    # the GPU run's comparison, through Triton's interpreter: the one-pass path is what auto takes, the two-pass
    # selection and the forced fallback are timed beside it, every answer is the same
    report = _bench().main(["--smoke", "--features", "64", "--variants", "select", "--out", str(tmp_path / "x.json")])
    row = report["results"]["64"]
    assert row["select_path"] == "triton_1pass"
    for key in ("select_ours_2pass", "select_ours_per_layer_2pass", "phase_stash", "select_ours_fallback"):
        assert row[key]["median_ms"] > 0, key
    assert row["select_fast_path"] is True and row["select_fallback_exact"] is True
    assert row["select_backends_agree"] is True and row["select_ties_exact"] is True
    assert row["select_sweep"]["path"] == "triton_1pass" and row["select_sweep"]["default"] == "4096x8"
    assert all(isinstance(v, float) for v in row["select_sweep"]["ms"].values())
    assert row["select_sweep_2pass"]["path"] == "triton_2pass"


def test_default_result_path_names_the_device() -> None:
    bench = _bench()
    results = os.path.join(bench.ROOT, "benchmarks", "results")
    assert bench.default_out(smoke=True) == os.path.join(results, "clt_step_smoke.json")
    # this machine has no GPU: "cpu"; a GPU run writes clt_step_<its device slug>.json
    assert bench.default_out(smoke=False) == os.path.join(results, f"clt_step_{bench.device_slug()}.json")
