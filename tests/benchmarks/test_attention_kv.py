"""benchmarks/attention_kv.py --smoke: every variant runs, and the JSON holds what the lead's GPU run is read by."""

from __future__ import annotations

from benchmarks import attention_kv
from benchmarks._results import load_result


def test_smoke_runs_every_variant(tmp_path):
    mod = attention_kv
    out = tmp_path / "attention_kv.json"
    mod.main(["--smoke", "--out", str(out)])
    saved = load_result(out)
    assert saved["benchmark"] == "attention_kv" and saved["env"]["torch"] and saved["command"]
    res = saved["results"]
    for key in ("spec", "rows", "relative_to_mha"):
        assert key in res, key
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["mha", "gqa_kv4", "gqa_kv2", "mla_r32_rope4", "mla_r16_rope4"]
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("traceback"))
        assert row["train_step_ms"] > 0 and row["decode_step_ms"] > 0 and row["prefill_ms"] > 0
        assert row["cache_bytes_match_formula"], name
    cache = {name: row["kv_cache_bytes_per_token_bf16"] for name, row in rows.items()}
    # 2 layers, bf16: MHA 2 x 64, GQA 2 x (4 or 2) x 8, MLA latent + rope key
    assert cache == {"mha": 512, "gqa_kv4": 256, "gqa_kv2": 128, "mla_r32_rope4": 144, "mla_r16_rope4": 80}
    assert res["relative_to_mha"]["mla_r16_rope4"]["kv_cache_bytes_per_token_bf16"] == 80 / 512
