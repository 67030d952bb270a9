"""Generate ``docs/benchmarks/gpt2.md`` and its plot from the GPT-2 benchmark JSON files (no typed numbers).

Reads ``benchmarks/results/gpt2_{speedrun,record,ablation}_<device>.json`` (one current result per device;
the newest run heads its section; or the files given), writes the markdown page and ``docs/benchmarks/img/gpt2_val_vs_time.png`` (val loss against
training seconds, ours and the peers). A missing result leaves a "GPU figures: pending" line in its section.
The per-corpus record results (``gpt2_record_<corpus>_<record>_<device>.json``) get their own section and plot
(``docs/benchmarks/img/gpt2_corpora_val_vs_time.png``) through ``benchmarks/gpt2_corpus_report.py``.

    python -m benchmarks.gpt2_report
    python -m benchmarks.gpt2_report --speedrun R1.json --record R2.json --ablation R3.json --doc /tmp/x.md
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from benchmarks import gpt2_corpus_report
from benchmarks._results import load_result, payload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks" / "gpt2.md"


def shown(kind: str) -> list[Path | None]:
    """The ``gpt2_<kind>_<device>.json`` results, those with nanoGPT rows first, then newest first; ``[None]`` when
    there is none. The per-corpus record results are left out (their own section)."""
    files = [f for f in RESULTS.glob(f"gpt2_{kind}_*.json")
             if "_smoke" not in f.name and not gpt2_corpus_report.is_corpus_file(f)]

    def key(f: Path) -> tuple[bool, bool, str, str]:
        # a throughput file with nanoGPT rows leads (the page's first section compares with it), one with the
        # speedrun recipe's rows before one of the classic config alone, then the newest
        d = payload(load_result(f))
        rows = d.get("results") or {}
        with_peer = any(k.startswith("nanogpt") for k in rows)
        with_speedrun = any(k.startswith("ours-speedrun") for k in rows)
        return with_peer, with_speedrun, d.get("env", {}).get("date_utc", ""), f.name

    return sorted(files, key=key, reverse=True) or [None]


def load(path: str | Path | None) -> tuple[dict[str, Any] | None, Path | None]:
    if path is None:
        return None, None
    p = Path(path)
    return payload(load_result(p)), p


def fmt(v: Any, spec: str = "", dash: str = "-") -> str:
    if v is None:
        return dash
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def pct(v: Any, spec: str = "+.1f") -> str:
    return "-" if v is None else f"{format(v, spec)}%"


def rel(path: Path, doc: Path) -> str:
    return os.path.relpath(path.resolve(), doc.parent.resolve())


def env_line(d: dict[str, Any], path: Path, doc: Path) -> str:
    e = d["env"]
    return (f"Device: **{e['device']}**, torch {e['torch']}, lightning {e.get('lightning')}, triton "
            f"{e.get('triton')}, flash-attn {e.get('flash_attn') or 'not installed'}, bitsandbytes "
            f"{e.get('bitsandbytes') or 'not installed'}; {e['date_utc']}. Command: `{d['command']}`. "
            f"Raw numbers: [{path.name}]({rel(path, doc)})." + (" **Smoke run (CPU, tiny model): numbers are "
                                                                 "not meaningful.**" if d.get("smoke") else ""))


def speedrun_section(d: dict[str, Any] | None, path: Path | None, doc: Path,
                     title: str = "## Throughput: ours (bare loop and Lightning) vs nanoGPT") -> list[str]:
    out = [title, ""]
    if d is None:
        return out + ["GPU figures: pending (run `python -m benchmarks.gpt2_speedrun` on an H100).", ""]
    s = d["settings"]
    out += [env_line(d, path, doc), ""]
    if isinstance(d.get("notes"), str):
        out += [f"Note: {d['notes']}", ""]
    out += [
            f"{s['steps']} optimizer steps of {s['micro_batch']} x {s['seq_len']} x {s['accum']} = "
            f"{s['micro_batch'] * s['seq_len'] * s['accum']:,} tokens, same data order for every run; tokens/s "
            f"over the steps after the first {s['warm']} (compile excluded, reported separately); MFU against "
            "989.4 TFLOP/s (H100/H200 SXM dense bf16); val loss on the first "
            f"{d['data']['val_tokens']:,} val tokens, off the clock.", "",
            "| variant | micro-batch x accum | tokens/s | MFU | ms/step | compile s | peak GB | final val loss | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in d["results"].items():
        if "tokens_per_s" not in r:
            out.append(f"| {name} | - | - | - | - | - | - | - | {(r.get('error') or r.get('skipped') or '')[:120]} |")
            continue
        spec = r.get("spec") or {}
        geometry = f"{spec['micro_batch']} x {spec['accum']}" if "micro_batch" in spec and "accum" in spec else "-"
        out.append(f"| {name} | {geometry} | {r['tokens_per_s']:,.0f} | {pct(r.get('mfu') and 100 * r['mfu'], '.1f')} | "
                   f"{fmt(r.get('step_ms'), '.1f')} | {fmt(r.get('compile_s'), '.1f')} | "
                   f"{fmt(r.get('peak_mem_gb'), '.1f')} | {fmt(r.get('final_val_loss'), '.4f')} | "
                   f"{r.get('stopped') or ''} |")
    # "summary", and any other summary block a result file carries (e.g. one per recipe it judged)
    for key in [k for k in d if k.startswith("summary")]:
        sm = d[key]
        head = "ratio / goal" if key == "summary" else f"{key.replace('_', ' ')}"
        out += ["", f"| {head} | value |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in sm.items()]
    return out + [""]


def record_section(d: dict[str, Any] | None, path: Path | None, doc: Path,
                   title: str = "## Time to target: the 2025-01-04 record script vs ours") -> list[str]:
    out = [title, ""]
    if d is None:
        return out + ["GPU figures: pending (run `python -m benchmarks.gpt2_record` on an H100).", ""]
    rec = d["results"].get("record", {})
    out += [env_line(d, path, doc), ""]
    if isinstance(d.get("notes"), str):
        out += [f"Note: {d['notes']}", ""]
    out += [
            f"Budget: {d['settings']['steps']} steps of 524,288 tokens. Target: the record script's final val "
            "loss. Compile and validation excluded for both; the record's own clock leaves its first 10 steps "
            "out, the adjusted time adds them back at its steady step time.", "",
            "| run | tokens/s | ms/step | compile s | peak GB | final val loss | train s |", "|---|---:|---:|---:|---:|---:|---:|"]
    ours_runs = [(k, r) for k, r in d["results"].items() if k.startswith("ours")]
    named = [("record 2025-01-04 (1 GPU)", rec)] + [
        (f"{k} (gpt2-124m-speedrun{', ' + r['variant']['name'] if r.get('variant') else ''}, Lightning)", r)
        for k, r in ours_runs]
    for name, r in named:
        if r.get("skipped"):
            out.append(f"| {name} | not run in this call ({r['skipped']}) | | | | | |")
            continue
        if r.get("error") and "tokens_per_s" not in r:
            out.append(f"| {name} | {r['error'][:150]} | | | | | |")
            continue
        t = r.get("record_train_s_adjusted") or r.get("train_s")
        out.append(f"| {name} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('step_ms'), '.1f')} | "
                   f"{fmt(r.get('compile_s'), '.1f')} | {fmt(r.get('peak_mem_gb'), '.1f')} | "
                   f"{fmt(r.get('final_val_loss'), '.4f')} | {fmt(t, '.1f')} |")
    summaries = d.get("summaries") or {"ours": d.get("summary", {})}
    for key, sm in summaries.items():
        out += ["", f"| ratio / goal ({key}) | value |" if len(summaries) > 1 else "| ratio / goal | value |",
                "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in sm.items()]
    return out + [""]


def ablation_section(d: dict[str, Any] | None, path: Path | None, doc: Path,
                     title: str = "## Ablation table") -> list[str]:
    out = [title, ""]
    if d is None:
        return out + ["GPU figures: pending (run `python -m benchmarks.gpt2_ablation` on an H100).", ""]
    out += [env_line(d, path, doc), ""] + ([f"Note: {d['notes']}", ""] if isinstance(d.get("notes"), str) else [])
    if d.get("format", 1) >= 2:
        return out + ablation_table(d)
    s = d.get("settings", {})
    out += [f"This result has one seed and no noise band ({s.get('steps')} steps of {s.get('micro_batch')} x "
            f"{s.get('seq_len')} tokens per row): its loss differences are not shown to exceed run-to-run noise.", ""]
    out += [f"- {n}" for n in (d["notes"] if isinstance(d.get("notes"), list) else [])] + [
        "", "| row | toggle | tokens/s | d tokens/s | peak GB | val loss | d val loss | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, r in d["rows"].items():
        out.append(
            f"| {name} | {r.get('toggle', '')} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{pct(r.get('d_tokens_per_s_pct'))} | {fmt(r.get('peak_mem_gb'), '.1f')} | "
            f"{fmt(r.get('final_val_loss'), '.4f')} | {fmt(r.get('d_val_loss'), '+.4f')} | "
            f"{r.get('verdict', '')}{' (fallback: ' + r['fallback'][0][:100] + ')' if r.get('fallback') else ''} |")
    return out + [""]


def _in_band(real: bool | None) -> str:
    return "" if real is None else " (real)" if real else " (noise)"


def ablation_table(d: dict[str, Any]) -> list[str]:
    """The table of a ``gpt2_ablation.py`` result with a baseline, a noise band and per-row code costs."""
    b, n, c = d["baseline"], d.get("noise"), d.get("calibration", {})
    params = d["rows"].get("baseline", {}).get("params")
    out = [f"Baseline: the `{b['recipe']}` recipe's model and optimizer at {b['n_layer']} layers x {b['n_embd']} "
           f"({b['n_head']} heads{f', {params / 1e6:.1f}M parameters' if params else ''}), {b['steps']} steps of "
           f"{b['micro_batch']} x {b['seq_len']} tokens ({b['tokens']:,} tokens per row; steps limited by "
           f"{c.get('limited_by', '-')}), {'torch.compile' if b['compile'] else 'eager (no torch.compile)'}, "
           f"{b['amp']}, attention `{b['attn_backend']}`, FP8 off, float32 matmuls `{b['matmul_precision']}`. Val loss "
           f"on the first {d['data']['val_tokens']:,} val tokens, the same windows for every row; tokens/s after "
           f"{b['warm']} warm-up steps.", ""]
    if n:
        out += [f"Noise band (seeds {n['seeds'][0]} and {n['seeds'][1]} of the baseline): val loss "
                f"{n['val_loss'][0]:.4f} and {n['val_loss'][1]:.4f}, band [{n['val_loss_band'][0]:.4f}, "
                f"{n['val_loss_band'][1]:.4f}] (mean +- difference); tokens/s {n['tokens_per_s'][0]:,.0f} and "
                f"{n['tokens_per_s'][1]:,.0f}, band +-{n['tokens_per_s_seed0_vs_seed1_pct']:.1f}%. Deltas are against "
                "the seeds' mean; an effect is marked real only outside its band.", ""]
    else:
        out += ["Noise band: not measured (a baseline seed did not finish); no effect is marked real.", ""]
    out += ["| row | change | tokens/s | vs baseline | peak GB | val loss | vs baseline | code lines | extra deps | "
            "when to skip the option | verdict |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for name, r in d["rows"].items():
        deps = ", ".join(f"{p} {r.get('extra_versions', {}).get(p.split()[0]) or ''}".strip()
                         for p in r.get("extra_deps", [])) or "none"
        head = f"| {name} | {r.get('toggle', '')} |"
        tail = f" {fmt(r.get('code_lines'))} | {deps} | {r.get('skip_when', '')} |"
        if r.get("status") != "measured":
            status = {"not_measured": "not measured", "skipped": "skipped"}.get(r.get("status"), "failed")
            out.append(f"{head} - | - | - | - | - |{tail} {status}: {r.get('reason', '')} |")
            continue
        loss = fmt(r.get("final_val_loss"), ".4f") + (f" ({r['tokens']:,} tokens)" if r.get("stopped") else "")
        out.append(f"{head} {fmt(r.get('tokens_per_s'), ',.0f')} | {pct(r.get('d_tokens_per_s_pct'))}"
                   f"{_in_band(r.get('speed_real'))} | {fmt(r.get('peak_mem_gb'), '.2f')} | {loss} | "
                   f"{fmt(r.get('d_val_loss'), '+.4f')}{_in_band(r.get('loss_real'))} |{tail} {r.get('verdict', '')} |")
    out += ["", "Code lines: the option's own classes, functions or files plus the lines that use its switch, counted "
            "from the source at run time (docstrings and comments left out); each row's parts are in the JSON."]
    if d.get("left_out"):
        out += ["", "Left out of this run:", ""] + [f"- `{k}`: {v}" for k, v in d["left_out"].items()]
    if isinstance(d.get("notes"), list):
        out += ["", "Notes:", ""] + [f"- {x}" for x in d["notes"]]
    return out + [""]


def plot(speedrun: dict | None, record: dict | None, img: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = []
    if speedrun:
        for name, r in speedrun["results"].items():
            if r.get("val_curve"):
                series.append((f"{name} (throughput run)", r["val_curve"], "-"))
    if record:
        keys = [("record", "record 2025-01-04")] + [
            (k, f"{k} (time-to-target run)") for k in record["results"] if k.startswith("ours")]
        for key, label in keys:
            r = record["results"].get(key, {})
            if r.get("val_curve"):
                series.append((label, [row for row in r["val_curve"] if row.get("step", 1) > 0], "--"))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, curve, style in series:
        pts = [(row["train_s"], row["val_loss"]) for row in curve if row.get("train_s") is not None]
        if pts:
            ax.plot(*zip(*pts), style, marker="o", ms=3, label=label)
    target = (record or {}).get("summary", {}).get("target_val_loss")
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target (record's final val loss {target:.3f})")
    ax.set_xlabel("training seconds (compile and validation excluded)")
    ax.set_ylabel("val loss")
    ax.set_title("GPT-2 124M on the novels shards, one GPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    img.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(img, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speedrun", nargs="*", default=None,
                   help="speedrun result JSONs, newest first (the first one also feeds the plot)")
    p.add_argument("--record", nargs="*", default=None, help="record result JSONs, newest first")
    p.add_argument("--ablation", nargs="*", default=None, help="ablation result JSONs, newest first")
    p.add_argument("--corpus-results", default=str(RESULTS),
                   help="folder of the per-corpus record results (gpt2_record_<corpus>_<record>_<device>.json)")
    p.add_argument("--manifest", default=str(gpt2_corpus_report.MANIFEST), help="the corpora manifest")
    p.add_argument("--doc", default=str(DOC))
    a = p.parse_args(argv)
    doc = Path(a.doc)
    runs = [load(x) for x in (a.speedrun or shown("speedrun"))]
    sp, sp_path = runs[0]
    records = [load(x) for x in (a.record or shown("record"))]
    rc, rc_path = records[0]
    ablations = [load(x) for x in (a.ablation or shown("ablation"))]
    ab, ab_path = ablations[0]
    img = doc.parent / "img" / "gpt2_val_vs_time.png"
    # one device per plot: the speedrun run measured on the record's machine, else the newest
    same = [r for r in runs if r[0] and rc and r[0]["env"]["device"] == rc["env"]["device"]]
    has_plot = plot((same[0] if same else runs[0])[0], rc, img)
    lines = [
        "# GPT-2 benchmarks", "",
        "<!-- generated by benchmarks/gpt2_report.py from the JSON files linked below; do not edit by hand -->", "",
        "How our GPT-2 speedrun recipe compares with a bare PyTorch loop (Lightning's overhead), with nanoGPT and "
        "with the modded-nanogpt record script of 2025-01-04, on one GPU in one call, and what each architecture "
        "or systems toggle does. Scripts: `benchmarks/gpt2_speedrun.py`, `benchmarks/gpt2_record.py`, "
        "`benchmarks/gpt2_ablation.py` (each has `--smoke`), and for where a step's time goes and the loss kernel alone "
        "`benchmarks/gpt2_step_profile.py` and `benchmarks/softcap_ce_kernel.py`; the peers' code is read from the git-ignored "
        "`.peers/` folder and never committed. See [docs/gpt2.md](../gpt2.md) for the model and recipe.", "",
    ]
    lines += speedrun_section(sp, sp_path, doc)
    for older, older_path in runs[1:]:
        lines += speedrun_section(older, older_path, doc, f"### Throughput on {older['env']['device']} ({older_path.name})")
    lines += record_section(rc, rc_path, doc)
    for older, older_path in records[1:]:
        lines += record_section(older, older_path, doc, f"### Time to target on {older['env']['device']} ({older_path.name})")
    manifest = gpt2_corpus_report.load_manifest(Path(a.manifest))
    corpus_files = gpt2_corpus_report.corpus_files(Path(a.corpus_results))
    corpus_img = doc.parent / "img" / gpt2_corpus_report.IMG_NAME
    drawn = gpt2_corpus_report.plot(corpus_files, manifest, corpus_img)
    lines += gpt2_corpus_report.section(corpus_files, manifest, doc, corpus_img if drawn else None)
    lines += ["## Val loss vs training time", ""]
    lines += ([f"![val loss vs training seconds](img/{img.name})", ""] if has_plot
              else ["GPU figures: pending (the plot is drawn from the speedrun and record results).", ""])
    lines += ablation_section(ab, ab_path, doc)
    for older, older_path in ablations[1:]:
        lines += ablation_section(older, older_path, doc, f"### Ablation on {older['env']['device']}")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))
    return doc


if __name__ == "__main__":
    print(main())
