"""benchmarks/clt_step.py on CPU (``--smoke``): the selection's paths side by side with their exactness checks and
the module step's host-sync field, written where the GPU run's result is read from."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import clt_step
from benchmarks._results import load_result


def _bench():
    return clt_step


def _triton_interpreted() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


def test_smoke_selection_and_module(tmp_path) -> None:
    out = tmp_path / "clt_step.json"
    report = _bench().main(["--smoke", "--features", "64", "--variants", "select", "module", "--out", str(out)])
    written = load_result(out)
    assert written["env"]["device"] and written["env"]["torch"] and written["command"]
    on_disk = written["results"]
    assert on_disk["results"] == json.loads(json.dumps(report["results"]))
    assert "shapes" in on_disk
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
    assert row["select_sweep"]["path"] == "triton_1pass" and row["select_sweep"]["default"] == "2048x8"
    for key in ("select_sweep", "stash_sweep", "select_sweep_2pass"):
        assert all(isinstance(v, float) for v in row[key]["ms"].values()), key
    assert set(row["stash_sweep"]["ms"]) == set(row["select_sweep"]["ms"]) and "read_tb_per_s" in row["stash_sweep"]
    assert row["select_sweep_2pass"]["path"] == "triton_2pass"
    # the rare paths, counted on the device: none on this input for any stash shape
    rare = row["select_rare_paths"]
    assert set(rare) == set(row["select_sweep"]["ms"])
    assert all(r["calls"] > 0 and r["fallback_per_call"] == 0 for r in rare.values())
    # CPU: wall clock per call (the device / host split needs CUDA), every call of every round counted
    assert row["select_ours"]["timing"] == "end_to_end" and row["select_ours"]["device"] is None
    assert row["select_ours"]["e2e"]["n"] == 2 * 2 and row["select_ours"]["allocator_mallocs"] == 0


def test_smoke_select_variants_subset(tmp_path) -> None:
    # --select-variants times only the named variants; --no-sweep drops the launch-shape sweeps
    report = _bench().main(["--smoke", "--features", "64", "--variants", "select", "--select-variants",
                            "select_ours", "select_torch_topk", "--no-sweep", "--out", str(tmp_path / "x.json")])
    row = report["results"]["64"]
    assert row["select_ours"]["median_ms"] > 0 and row["select_torch_topk"]["median_ms"] > 0
    assert "select_ours_candidates" not in row and "select_sweep" not in row
    assert row["select_exact"] is True


def test_default_result_path_names_the_device() -> None:
    bench = _bench()
    results = os.path.join(bench.ROOT, "benchmarks", "results")
    assert bench.default_out(smoke=True) == os.path.join(results, "clt_step_smoke.json")
    # this machine has no GPU: "cpu"; a GPU run writes clt_step_<its device slug>.json
    assert bench.default_out(smoke=False) == os.path.join(results, f"clt_step_{bench.device_slug()}.json")
