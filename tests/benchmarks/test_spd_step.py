"""benchmarks/spd_step.py on CPU: every variant is recorded, a timeout is an error row and not a crash,
and the JSON is written with the fields the GPU run is read by (PGD cost per step, compile time, the summary
against the goal, whether goodfire's spd could run)."""

from __future__ import annotations

import pytest

from benchmarks import spd_step
from benchmarks._results import load_result


def _bench():
    return spd_step


def test_smoke_records_a_compile_timeout_and_keeps_going(tmp_path):
    out = tmp_path / "spd_step.json"
    res = _bench().main([
        "--smoke", "--no-peer", "--workloads", "resid_mlp1", "--compile-budget-s", "0.05", "--out", str(out),
    ])
    written = load_result(out)
    on_disk = written["results"]
    assert on_disk["workloads"].keys() == res["workloads"].keys() == {"resid_mlp1"}
    assert written["env"]["device"] and "einops" in written["env"] and written["command"]  # the peer's versions too
    assert written["goals"] == {"best_vs_best_at_least": 4.0, "compile_s_at_most": 60.0}
    for key in ("budgets_s", "elapsed_s"):
        assert key in on_disk, key
    rows = {r["variant"]: r for r in on_disk["workloads"]["resid_mlp1"]["rows"]}
    # the compiled variants ran out of their 0.05 s budget: recorded as timeouts (a variant whose graphs an
    # earlier test in this process already compiled may finish inside it: then it has a step time)
    compiled = ("ours_regional_bf16", "ours_regional_fp32", "ours_full_bf16")
    timed_out = {n for n in compiled if str(rows[n].get("error", "")).startswith("timeout")}
    assert timed_out, [rows[n] for n in compiled]
    for name in set(compiled) - timed_out:
        assert rows[name]["step_ms"] > 0, rows[name]
    # ... and the eager variants after them still ran
    for name in ("ours_eager_bf16", "ours_eager_fp32", "ours_eager_fp32_sync"):
        assert rows[name]["step_ms"] > 0 and rows[name]["timed_iters"] == 2, rows[name]
    speed = on_disk["workloads"]["resid_mlp1"]["speedup"]
    assert "fewer syncs (ours fp32 eager: loss read every step / never)" in speed
    summary = on_disk["workloads"]["resid_mlp1"]["summary"]
    assert set(summary["timed_out"]) == timed_out
    # within the limit only when no regional variant timed out (each that finished compiled well within 60 s)
    assert summary["ours_regional_compile_within_60_s"] is not any(n.startswith("ours_regional") for n in timed_out)
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


def test_smoke_gpt2_layer_reports_pgd_cost_compile_time_and_regions(tmp_path):
    """The GPT-2-layer workload at smoke size: each variant is timed with and without PGD (the same module), the
    regional variants list what they compiled and trace without graph breaks, and the summary names our best."""
    out = tmp_path / "g.json"
    res = _bench().main(["--smoke", "--no-peer", "--no-full-compile", "--out", str(out)])
    assert load_result(out)["results"]["workloads"].keys() == {"gpt2_layer"}
    w = res["workloads"]["gpt2_layer"]
    rows = {r["variant"]: r for r in w["rows"]}
    assert set(rows) == {"ours_eager_bf16", "ours_regional_bf16", "ours_eager_fp32", "ours_eager_fp32_sync",
                         "ours_regional_fp32"}
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        if name != "ours_eager_fp32_sync":
            assert r["step_ms_nopgd"] > 0 and r["pgd_ms"] == pytest.approx(r["step_ms"] - r["step_ms_nopgd"])
    for name in ("ours_regional_bf16", "ours_regional_fp32"):
        # the blocks around the decomposed one (block 1 of 3), the masked layers and the KL
        assert rows[name]["compiled"] == ["blocks.0", "blocks.2", "masked_linear", "kl"]
        assert rows[name]["graph_breaks"] == 0 and rows[name]["graphs"] >= 4
        assert rows[name]["compile_s"] >= 0
    assert res["peer_runnable"] is None  # --no-peer
    assert w["differences"] and w["summary"]["best_ours"]["variant"] in rows
    assert w["summary"]["ours_regional_compile_within_60_s"] is True
    assert "best_vs_best" not in w["summary"]  # no peer, no ratio


def test_variants_runs_only_the_named_ones_in_order_and_rejects_unknown_names(tmp_path):
    out = tmp_path / "v.json"
    res = _bench().main(["--smoke", "--no-peer", "--variants", "ours_full_bf16_lean,ours_eager_bf16", "--out", str(out)])
    w = load_result(out)["results"]["workloads"]["gpt2_layer"]
    assert [r["variant"] for r in w["rows"]] == ["ours_full_bf16_lean", "ours_eager_bf16"]
    full, eager = w["rows"]
    assert "error" not in full and "error" not in eager, (full.get("error"), eager.get("error"))
    assert full["compile_order"] == 1 and full["compile_options"] == {"triton.autotune_pointwise": False}
    assert full["compile_s"] >= 0 and "compile_s" not in eager
    # the PGD terms are a compiled part of their own: the full step is timed without them too
    assert full["step_ms_nopgd"] > 0 and full["pgd_ms"] == pytest.approx(full["step_ms"] - full["step_ms_nopgd"])
    assert res["workloads"]["gpt2_layer"]["summary"]["best_ours"]["variant"] in ("ours_full_bf16_lean", "ours_eager_bf16")
    with pytest.raises(SystemExit, match="unknown variant"):
        _bench().main(["--smoke", "--no-peer", "--variants", "ours_nonexistent", "--out", str(tmp_path / "x.json")])


def test_peer_without_its_checkout_is_recorded_as_not_runnable(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench.peer, "PEER_DIR", tmp_path / "no-checkout")
    res = bench.main(["--smoke", "--no-ablations", "--workloads", "resid_mlp1", "--out", str(tmp_path / "p.json")])
    assert res["peer_runnable"] is False and "checkout not found" in res["peer_error"]
    assert not any(r["variant"].startswith("peer") for r in res["workloads"]["resid_mlp1"]["rows"])


def test_smoke_with_goodfire_spd_side_by_side(tmp_path):
    """With their checkout and wheels in ``.peers/`` (git-ignored; see benchmarks/spd_peer_runner.py): their step
    runs beside ours on the GPT-2-layer workload, with and without PGD, and the summary gives best vs best."""
    bench = _bench()
    if not (bench.peer.PEER_DIR / "spd" / "__init__.py").exists():
        pytest.skip("goodfire spd is not in .peers/spd")
    res = bench.main(["--smoke", "--no-ablations", "--out", str(tmp_path / "s.json")])
    if not res["peer_runnable"]:
        pytest.skip(f"goodfire spd cannot run here: {res['peer_error']}")
    w = res["workloads"]["gpt2_layer"]
    rows = {r["variant"]: r for r in w["rows"]}
    assert rows["peer_bf16"]["step_ms"] > 0 and rows["peer_bf16"]["step_ms_nopgd"] > 0, rows["peer_bf16"]
    s = w["summary"]
    assert s["best_peer"]["variant"] == "peer_bf16"
    assert s["best_vs_best"] == pytest.approx(s["best_peer"]["step_ms"] / s["best_ours"]["step_ms"])
    assert "best_vs_best_at_least_4x" in s
