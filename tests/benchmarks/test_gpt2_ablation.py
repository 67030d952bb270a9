"""benchmarks/gpt2_ablation.py: one baseline, a measured noise band, equal tokens per row, code costs counted from
the source, missing packages reported as not measured; its rendering in gpt2_report.py and make_docs.py."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import gpt2_ablation, gpt2_report, make_docs
from benchmarks._results import load_result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ablation():
    return gpt2_ablation


@pytest.fixture(scope="module")
def smoke(ablation, tmp_path_factory):
    """The full default table in smoke mode (builtin corpus, tiny model, CPU), with its report page."""
    out = tmp_path_factory.mktemp("ablation")
    payload = ablation.main(["--smoke", "--amp", "fp32", "--out", str(out)])  # bf16 autocast is slow on a CPU
    path = out / f"gpt2_ablation_{ablation.device_slug()}.json"
    return payload, path, out / "gpt2.md"


def test_code_lines_count_code_only(ablation, tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""Module docstring\n\nover three lines."""\n'  # 1-3
        "import os\n"  # 4
        "\n"  # 5
        "# a comment\n"  # 6
        "class A:\n"  # 7
        '    """Class docstring."""\n'  # 8
        "    def f(self, flag):\n"  # 9
        "        if flag:  # trailing comment\n"  # 10
        "            return os.sep\n"  # 11
        "        return 'flag'\n"  # 12
        "\n"  # 13
        "def g(flag):\n"  # 14
        "    return [flag,\n"  # 15
        "            1]\n"  # 16
    )
    assert ablation.code_lines(src) == {4, 7, 9, 10, 11, 12, 14, 15, 16}
    assert ablation.code_lines(src, objects=("A.f",)) == {9, 10, 11, 12}
    assert ablation.code_lines(src, objects=("A",)) == {7, 9, 10, 11, 12}
    # an identifier, not the string 'flag' on line 12
    assert ablation.code_lines(src, names=("flag",)) == {9, 10, 14, 15}
    with pytest.raises(LookupError):
        ablation.code_lines(src, objects=("B",))
    code = (ablation.Code("m.py", objects=("g",)), ablation.Code("m.py", names=("flag",)))
    total, parts = ablation.count_code(code, root=tmp_path)
    assert total == len({14, 15, 16} | {9, 10, 14, 15}) and [p["lines"] for p in parts] == [3, 4]


@pytest.mark.parametrize("steps,batch", [(8, 4), (100, 32), (257, 32), (3, 8)])
def test_batch_ramp_keeps_the_tokens(ablation, steps, batch):
    base, _, _ = ablation.scaled_recipe(6, 128, 64, 256, steps, batch)
    ramp = ablation._batch_ramp(base)
    assert ramp.tokens() == base.tokens() == steps * batch * 64
    assert ramp.steps > base.steps and ramp.geometry().at(0) == (batch // 4, 64)


def test_scaled_recipe_is_the_recipe_at_another_size(ablation):
    recipe, optim, _, raw = ablation.load_yaml_config(ablation.RECIPE)
    base, adamw, info = ablation.scaled_recipe(6, 384, 1024, None, 250, 32)
    m = base.model
    assert (m.n_layer, m.n_embd, m.head_dim) == (6, 384, recipe.head_dim)
    same = ("pos_emb", "norm", "qk_norm", "mlp", "logit_softcap", "unet_skips", "x0_mix", "embed_norm", "tie_embeddings",
            "zero_init_proj", "vocab_size", "rope_base", "rope_truncate", "n_value_embeds")
    assert {f: getattr(m, f) for f in same} == {f: getattr(recipe, f) for f in same}
    assert m.skip_attn_layers == tuple(i * 6 // recipe.n_layer for i in recipe.skip_attn_layers)
    assert replace(base.optim, muon_momentum_warmup_steps=0) == replace(optim, muon_momentum_warmup_steps=0)
    assert base.optim.muon_momentum_warmup_steps == round(optim.muon_momentum_warmup_steps * 250 / info["recipe_max_steps"])
    ex = base.execution
    assert (ex.head_fp8, ex.mlp_fp8, ex.attn_fp8, ex.attn_backend) == (False, False, False, "sdpa")
    assert ex.loss_impl == raw["model"]["execution"]["loss_impl"] and adamw.name == "adamw"


def test_verify_refuses_a_torch_optimizer_for_the_8bit_row(ablation):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    assert "not a bitsandbytes optimizer" in ablation._is_bnb(None, torch.optim.AdamW([p]))


def test_row_cap_stops_a_row_and_says_so(ablation):
    from lightning_opt.data.corpus import default_corpus_shards

    train, val = default_corpus_shards()
    data = ablation.ShardTokens([train], [val], torch.device("cpu"), 2048, 100_000)
    base, _, _ = ablation.scaled_recipe(2, 128, 64, 256, 50, 4)
    r = ablation.train_row(replace(base, warm=2, amp="fp32"), data, cap_s=0.0)
    assert r["stopped"].startswith("row time cap") and r["steps"] == 3 and r["tokens"] == 3 * 4 * 64
    assert math.isfinite(r["final_val_loss"]) and r["val_tokens"] == 2048


def test_smoke_table(ablation, smoke):
    payload, path, _ = smoke
    written = load_result(path)
    assert written["results"]["rows"].keys() == payload["rows"].keys()
    assert written["baseline"] == json.loads(json.dumps(payload["baseline"])) and written["notes"] == payload["notes"]
    rows = payload["rows"]
    names = [r.name for r in ablation.rows(*ablation.scaled_recipe(6, 128, 64, 256, 8, 4)[:2])]
    assert list(rows) == names and payload["format"] == 2
    # the noise band comes from the two seeds
    s0, s1, noise = rows["baseline"], rows["baseline_seed1"], payload["noise"]
    assert (s0["spec"]["seed"], s1["spec"]["seed"]) == (0, 1) and s0["status"] == s1["status"] == "measured"
    spread = abs(s0["final_val_loss"] - s1["final_val_loss"])
    mean = (s0["final_val_loss"] + s1["final_val_loss"]) / 2
    assert noise["val_loss_band"] == pytest.approx([mean - spread, mean + spread], abs=1e-5)
    base_tokens = payload["baseline"]["tokens"]
    table = {r.name: r for r in ablation.rows(*ablation.scaled_recipe(6, 128, 64, 256, 8, 4)[:2])}
    cpu = torch.device("cpu")
    for name in ("adamw_8bit", "flash_attn"):  # packages absent here, or present and needing CUDA
        pkg = table[name].extras[0]
        assert table[name].needs(cpu) in (f"{pkg} not installed", f"{pkg} needs CUDA (this run is on cpu)")
    for name, r in rows.items():
        reason = table[name].needs(cpu) if table[name].needs else None
        if reason:  # never run on a fallback
            assert r["status"] == "not_measured" and r["reason"] == reason and "tokens_per_s" not in r, name
            continue
        assert r["status"] == "measured", (name, r.get("reason"))
        assert r["tokens"] == base_tokens and r["val_tokens"] == payload["data"]["val_tokens"], name
        assert math.isfinite(r["final_val_loss"]) and r["tokens_per_s"] > 0
        if name not in ablation.SEED_ROWS:
            lo, hi = noise["val_loss_band"]
            assert r["loss_real"] == (not lo <= r["final_val_loss"] <= hi), name
            assert r["d_val_loss"] == pytest.approx(r["final_val_loss"] - noise["val_loss_mean"], abs=1e-5)
    # code costs: recounted from the source, positive for every option
    for name, r in rows.items():
        if table[name].code:
            assert r["code_lines"] == ablation.count_code(table[name].code)[0] > 0, name
    assert rows["batch_schedule"]["steps"] > rows["baseline"]["steps"]
    assert rows["seq_schedule"]["spec"]["seq_schedule"] and rows["tf32_off"]["spec"]["matmul_precision"] == "highest"
    assert "mtp_k2" in payload["left_out"] and "compile" in payload["left_out"]


def test_report_renders_the_new_and_the_old_format(ablation, smoke, tmp_path):
    payload, path, page = smoke
    text = page.read_text()
    assert "| row | change | tokens/s | vs baseline | peak GB | val loss | vs baseline | code lines | extra deps |" in text
    lo, hi = payload["noise"]["val_loss_band"]
    assert f"band [{lo:.4f}, {hi:.4f}]" in text
    for name, r in payload["rows"].items():
        line = next(x for x in text.splitlines() if x.startswith(f"| {name} |"))
        if r["status"] == "not_measured":
            assert f"not measured: {r['reason']}" in line
        else:
            assert f"{r['final_val_loss']:.4f}" in line and f"| {r['code_lines'] or '-'} |" in line
    # old-format files (one seed, no band) still render, with the caveat
    report = gpt2_report
    old = sorted((ROOT / "benchmarks" / "results").glob("gpt2_ablation_*.json"))
    old = [p for p in old if load_result(p)["results"].get("format", 1) < 2]
    doc = report.main(["--ablation", str(path), *map(str, old), "--doc", str(tmp_path / "gpt2.md")])
    both = doc.read_text()
    assert "code lines" in both
    for p in old:
        assert f"### Ablation on {load_result(p)['env']['device']}" in both
    if old:
        assert "its loss differences are not shown to exceed run-to-run noise" in both


def test_make_docs_index_reads_the_new_format(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    _, path, _ = smoke
    res = tmp_path / "results"
    res.mkdir()
    shutil.copy(path, res / "gpt2_ablation_cpu.json")  # the smoke result under the committed result's name
    make_docs.main(["--results", str(res), "--out", str(tmp_path / "out")])
    index = (tmp_path / "out" / "index.md").read_text()
    line = next(x for x in index.splitlines() if "gpt2_ablation_cpu.json" in x)
    assert "noise.val_loss_seed0_vs_seed1 = " in line and "noise.tokens_per_s_seed0_vs_seed1_pct = " in line
    assert not (tmp_path / "out" / "gpt2_ablation.md").exists()  # gpt2_report.py writes its page
