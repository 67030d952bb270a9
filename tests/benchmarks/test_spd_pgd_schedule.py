"""benchmarks/spd_pgd_schedule.py --smoke: every variant runs, the schedule runs fewer PGD ascent steps, and the
JSON holds the timing (PGD share of a step) and the final metrics the docs quote."""

from __future__ import annotations

import json

from benchmarks import spd_pgd_schedule
from benchmarks._results import load_result


def test_smoke_compares_the_schedule_with_the_fixed_pgd_steps(tmp_path):
    mod = spd_pgd_schedule
    out = tmp_path / "r.json"
    res = mod.main(["--smoke", "--seeds", "1", "--out", str(out)])
    assert load_result(out)["results"]["rows"] == json.loads(json.dumps(res["rows"]))
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"fixed_1", "fixed_k", "schedule"}
    assert rows["fixed_1"]["pgd_ascent_steps_total"] < rows["schedule"]["pgd_ascent_steps_total"] \
        < rows["fixed_k"]["pgd_ascent_steps_total"]
    for r in rows.values():
        assert 0 < r["pgd_time_share"] < 1 and r["step_cpu_ms"] > 0
        for k in ("recon_stochastic", "recon_ci", "recon_pgd4", "faithfulness", "alive_components"):
            assert r[k] >= 0, k
    assert "step_cpu_time_ratio" in res["schedule_vs_fixed_k"]
