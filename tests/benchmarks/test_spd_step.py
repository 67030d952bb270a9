"""benchmarks/spd_step.py on CPU: every variant is recorded, a timeout is an error row and not a crash,
and the JSON is written with the fields the lead's GPU run is read by."""

from __future__ import annotations

import json

from tests.benchmarks._load import load_benchmark


def _bench():
    return load_benchmark("spd_step")


def test_smoke_records_a_compile_timeout_and_keeps_going(tmp_path):
    out = tmp_path / "spd_step.json"
    res = _bench().main([
        "--smoke", "--no-peer", "--workloads", "resid_mlp1", "--compile-budget-s", "0.05", "--out", str(out),
    ])
    on_disk = json.loads(out.read_text())
    assert on_disk["workloads"].keys() == res["workloads"].keys() == {"resid_mlp1"}
    for key in ("device", "versions", "command", "budgets_s", "elapsed_s"):
        assert key in on_disk, key
    rows = {r["variant"]: r for r in on_disk["workloads"]["resid_mlp1"]["rows"]}
    # the compiled variants ran out of their 0.05 s budget: recorded as timeouts
    for name in ("ours_compiled_bf16", "ours_compiled_fp32"):
        assert rows[name]["error"].startswith("timeout"), rows[name]
    # ... and the eager variants after them still ran
    for name in ("ours_eager_bf16", "ours_eager_fp32", "ours_eager_fp32_sync"):
        assert rows[name]["step_ms"] > 0 and rows[name]["timed_iters"] == 2, rows[name]
    speed = on_disk["workloads"]["resid_mlp1"]["speedup"]
    assert "fewer syncs (ours fp32 eager: loss read every step / never)" in speed
    # a compile cut off by the alarm must leave torch.compile usable in this process (the alarm once
    # landed inside inductor's first import and broke every later compile in the test session)
    import torch
    import torch._dynamo

    explained = torch._dynamo.explain(lambda t: t * 2 + 1)(torch.ones(3))
    assert explained.graph_count == 1
    torch._dynamo.reset()


def test_global_budget_skips_the_rest(tmp_path):
    res = _bench().main(["--smoke", "--no-peer", "--workloads", "resid_mlp1", "--budget-s", "0", "--out", str(tmp_path / "x.json")])
    rows = res["workloads"]["resid_mlp1"]["rows"]
    assert rows and all("skipped" in r for r in rows)
