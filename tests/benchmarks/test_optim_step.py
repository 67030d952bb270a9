from __future__ import annotations

from benchmarks import optim_step
from benchmarks._results import load_result


def _bench():
    return optim_step


def test_smoke_times_each_optimizer_and_reports_state_memory(tmp_path):
    out = tmp_path / "optim.json"
    result = _bench().main(["--smoke", "--out", str(out)])
    assert load_result(out)["results"]["rows"] == result["rows"]
    rows = {r["optimizer"]: r for r in result["rows"]}
    # AdamW keeps two moments per parameter, Lion one: the state sizes are measured, not assumed
    assert rows["adamw"]["state_over_param_bytes"] > 1.9
    assert 0.9 < rows["lion"]["state_over_param_bytes"] < 1.1
    assert rows["lion"]["step_ms_median"] > 0
    # without bitsandbytes on CUDA the factory falls back, and the row says so instead of timing torch AdamW
    if not any("bitsandbytes" in b for b in rows["adamw8bit"]["built"]):
        assert "step_ms_median" not in rows["adamw8bit"] and "fallback" in rows["adamw8bit"]["note"]
