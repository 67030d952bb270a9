"""benchmarks/comm_bytes.py --smoke: every strategy's measured collective bytes per step are within 5% of the
formulas (docs/strategies.md, "Several machines"), on 2 and 4 gloo processes."""

from __future__ import annotations

from benchmarks import comm_bytes


def test_measured_bytes_match_the_formulas(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench = comm_bytes
    result = bench.main(["--smoke"])
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(bench.VARIANTS)
    assert {r["world"] for r in rows.values()} == {2, 4}
    for name, row in rows.items():
        assert row["measured_bytes"] > 0, name
        assert abs(row["measured_bytes"] / row["predicted_bytes"] - 1) <= 0.05, (name, row["predicted_terms"],
                                                                                 row["measured_calls"])
