"""benchmarks/qk_norm_dtype.py --smoke: both variants run, the candidate really puts the gain in the input's dtype,
and the numbers differ (so the change is not a free rewrite)."""

from __future__ import annotations

import torch

from benchmarks import qk_norm_dtype
from benchmarks._results import load_result


def test_smoke_times_both_variants_and_compares_their_numbers(tmp_path, monkeypatch):
    mod = qk_norm_dtype
    out = tmp_path / "qk.json"
    mod.main(["--smoke", "--out", str(out)])
    res = load_result(out)["results"]
    assert {(r["variant"], r["mode"]) for r in res["rows"]} == {("current", "eager"), ("gain_in_input_dtype", "eager")}
    assert all(r["step_ms"] > 0 and len(r["step_ms_all"]) == 4 for r in res["rows"])
    assert set(res["step_time_ratio_candidate_over_current"]) == {"eager"}
    n = res["numerics"]
    # same weights, the gain rounded to bfloat16 in one: close, not equal
    assert 0 < n["loss_abs_diff"] < 1e-3 and 0 < n["grad_max_rel_diff"] < 0.1

    # the candidate's norm: a bfloat16 input meets a bfloat16 gain; the current one keeps it float32
    norm = mod.RMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 8).bfloat16()
    cand = mod.GainInInputDtype(8)
    cand.load_state_dict(norm.state_dict())
    seen = []
    rms_norm = torch.nn.functional.rms_norm
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "rms_norm", lambda x, shape, w, eps: seen.append(w.dtype) or rms_norm(x, shape, w, eps))
        cand(x)
    assert seen == [torch.bfloat16]
    assert norm(x).dtype == cand(x).dtype == torch.bfloat16
