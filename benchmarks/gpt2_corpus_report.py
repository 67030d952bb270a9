"""Time to target per corpus: the section of ``docs/benchmarks/gpt2.md`` and its plot drawn from the per-corpus
``gpt2_record.py`` results (no typed numbers).

Reads ``benchmarks/results/gpt2_record_<corpus>_<record>_<device>.json`` (one ``gpt2_record.py --record <record>
--data-dir .data/corpora/<corpus> --out ...`` call each: the record script, then one or more variants of ours) and
``benchmarks/results/corpora_manifest.json`` (each corpus's kind, which corpus is held out from tuning). Called by
``benchmarks/gpt2_report.py``; the table has one row per (corpus, record, variant), the plot one panel per
(corpus, record[, device]).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from benchmarks._results import load_result, payload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = RESULTS / "corpora_manifest.json"
IMG_NAME = "gpt2_corpora_val_vs_time.png"
# ``gpt2_record_code_2025-08-23_nvidia-h100-80gb-hbm3.json``: corpus, record date, device slug
CORPUS_FILE = re.compile(r"^gpt2_record_(?P<corpus>[a-z0-9-]+)_(?P<record>\d{4}-\d{2}-\d{2})_(?P<device>[a-z0-9-]+)\.json$")
# the time each record is to be beaten by on every corpus: ours / record at most this
# (2025-07-13: the newest record that runs on one GPU here, in place of 2025-08-23; docs/gpt2.md says why)
GOALS: dict[str, float] = {"2025-01-04": 0.70, "2025-07-13": 0.75, "2025-08-23": 0.75}
SHIPPED = "recipe"  # the variant of ours that is the shipped default


def is_corpus_file(path: Path) -> bool:
    return CORPUS_FILE.match(path.name) is not None


def corpus_files(folder: Path = RESULTS) -> list[Path]:
    """The per-corpus record results in ``folder`` (smoke runs left out), by corpus, record and device."""
    files = [p for p in sorted(folder.glob("gpt2_record_*.json")) if is_corpus_file(p) and "_smoke" not in p.name]
    return [p for p in files if not load_result(p)["results"].get("smoke")]


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    return payload(load_result(path)) if path.exists() else {}


def corpus_info(manifest: dict[str, Any], corpus: str) -> tuple[str, bool, bool]:
    """(kind, held out, tuned on) of ``corpus`` as the corpora manifest says."""
    c = (manifest.get("corpora") or {}).get(corpus, {})
    held = manifest.get("held_out") == corpus or bool(c.get("held_out"))
    return c.get("kind") or "-", held, corpus in (manifest.get("tuned_on") or [])


def interpolated_time(curve: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds at which the val curve first reaches ``target``, linear between the val points around it."""
    points = [(r["train_s"], r["val_loss"]) for r in curve if r.get("train_s") is not None]
    for i, (t, v) in enumerate(points):
        if v > target:
            continue
        if i == 0 or points[i - 1][1] == v:
            return t
        t0, v0 = points[i - 1]
        return t0 + (v0 - target) / (v0 - v) * (t - t0)
    return None


@dataclass
class Row:
    """One variant of ours against the record on one corpus, as the table shows it."""

    file: Path
    key: str  # the result's key in the file: ``ours`` or ``ours-<variant>``
    corpus: str
    kind: str
    held_out: bool
    tuned_on: bool
    record: str
    device: str
    command: str
    variant: str
    long: bool
    val_tokens: int | None
    target: float | None  # the record's final val loss
    record_s: float | None  # the record's training seconds, adjusted (every step counted)
    record_note: str | None  # why the record has no time: "failed: ..." or "not run (...)"
    ours_s: float | None  # ours to the target, interpolated; None when not reached
    ours_final: float | None
    ours_error: str | None
    time_ratio: float | None
    tokens_per_s_ratio: float | None
    marked: bool = False  # the shipped variant, or every variant of a file without one
    same_as_recipe: bool = False  # another name for the shipped recipe's spec
    shipped: bool = False  # the shipped recipe's spec, under its name or another
    cut_at_step: int | None = None  # the call's deadline stopped the run at this step


def read_rows(path: Path, manifest: dict[str, Any]) -> list[Row]:
    d = payload(load_result(path))
    m = CORPUS_FILE.match(path.name)
    s, env, results = d.get("settings") or {}, d.get("env") or {}, d.get("results") or {}
    corpus = Path(s["data_dir"]).name if s.get("data_dir") else m.group("corpus")
    record = s.get("record") or m.group("record")
    kind, held, tuned = corpus_info(manifest, corpus)
    rec = results.get("record") or {}
    target = rec.get("final_val_loss")
    record_s = rec.get("record_train_s_adjusted")
    if rec.get("error"):
        record_note = f"failed: {rec['error']}" + (f" ({d['record_diagnosis']})" if d.get("record_diagnosis") else "")
    else:
        record_note = f"not run ({rec['skipped']})" if rec.get("skipped") else None
    common = dict(file=path, corpus=corpus, kind=kind, held_out=held, tuned_on=tuned, record=record,
                  device=env.get("device") or m.group("device"), command=d["command"] or "-",
                  val_tokens=s.get("val_tokens"), target=target, record_s=record_s, record_note=record_note)
    recipe = recipe_spec()
    rows = []
    for key, r in results.items():
        if not key.startswith("ours"):
            continue
        v = r.get("variant") or {}
        variant = v.get("name") or key.removeprefix("ours-")
        ours_s = interpolated_time(r.get("val_curve") or [], target) if target is not None else None
        tps = r.get("tokens_per_s"), rec.get("tokens_per_s")
        rows.append(Row(
            **common, key=key, variant=variant, long=bool(v.get("long")), ours_s=ours_s,
            ours_final=r.get("final_val_loss"), ours_error=None if r.get("val_curve") else r.get("error") or r.get("skipped"),
            time_ratio=ours_s / record_s if ours_s is not None and record_s else None,
            tokens_per_s_ratio=tps[0] / tps[1] if all(tps) else None,
            cut_at_step=r.get("steps") if r.get("stopped") == "deadline" else None,
            same_as_recipe=variant != SHIPPED and is_recipe_spec(v, r.get("spec"), recipe)))
    if not rows:  # the record failed and nothing of ours ran after it: one row that says so
        rows.append(Row(**common, key="-", variant="-", long=False, ours_s=None, ours_final=None,
                        ours_error="no result (the call's deadline stopped it)", time_ratio=None,
                        tokens_per_s_ratio=None))
    shipped = [r for r in rows if r.same_as_recipe or (r.variant == SHIPPED and (
        recipe is None or _model_matches(results[r.key].get("spec"), recipe[3])))]
    for r in shipped:
        r.shipped = True
    for r in shipped or rows:
        r.marked = True
    return rows


@lru_cache(maxsize=1)  # one read of the YAML for every result file of a report
def recipe_spec() -> tuple[int, bool, float, dict] | None:
    """The shipped recipe as ``gpt2_record.py`` runs it (``--ours recipe``): micro-batches of 32 x 1024 per step,
    long sequences, budget, and the model values a variant may override (the config's ``window_schedule``)."""
    try:
        from benchmarks.gpt2_common import load_yaml_config  # noqa: PLC0415
        from benchmarks.gpt2_record import OURS_VARIANTS  # noqa: PLC0415
    except ImportError:
        return None
    accum, long, budget, *_ = OURS_VARIANTS[SHIPPED]
    model = load_yaml_config("gpt2-124m-speedrun")[0]
    return accum, long, budget, {"window_schedule": list(model.window_schedule or []) or None}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _model_matches(spec: dict[str, Any] | None, values: dict[str, Any]) -> bool:
    """The run's recorded model (``spec.model``, where the result has one) has the recipe's values."""
    model = (spec or {}).get("model") or {}
    return all(_plain(model[k]) == _plain(v) for k, v in values.items() if k in model)


def is_recipe_spec(variant: dict[str, Any], spec: dict[str, Any] | None,
                   recipe: tuple[int, bool, float, dict] | None) -> bool:
    """A run of another name ran the shipped recipe's spec: the same geometry and budget, overrides that only set
    the recipe's own values, and (where recorded) the recipe's model values."""
    if recipe is None:
        return False
    accum, long, budget, values = recipe
    if (variant.get("accum"), bool(variant.get("long")), variant.get("budget")) != (accum, long, budget):
        return False
    overrides = variant.get("model_overrides") or {}
    if any(k not in values or _plain(v) != _plain(values[k]) for k, v in overrides.items()):
        return False
    return _model_matches(spec, values)


def order(manifest: dict[str, Any]):
    """Sort key of a row: tuned-on corpora first, in the manifest's order, the held-out one last; then record, device."""
    names = list(manifest.get("corpora") or {})
    return lambda r: (r.held_out, names.index(r.corpus) if r.corpus in names else len(names), r.corpus, r.record,
                      r.device)


def read_all(files: list[Path], manifest: dict[str, Any]) -> list[Row]:
    rows = [r for f in files for r in read_rows(f, manifest)]
    key = order(manifest)
    return sorted(rows, key=lambda r: (key(r), not r.marked))


def _num(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None or not math.isfinite(v) else f"{format(v, spec)}{unit}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def corpus_cell(r: Row) -> str:
    tag = "**held out**" if r.held_out else "tuned on" if r.tuned_on else ""
    return f"{r.corpus}: {r.kind}{'; ' + tag if tag else ''}"


def ours_cell(r: Row) -> str:
    if r.ours_error:
        return f"failed: {_cell(str(r.ours_error))[:120]}"
    if r.target is None:
        return "no target (the record has no final val loss)"
    if r.ours_s is not None:
        return _num(r.ours_s, ".1f")
    if r.cut_at_step is not None:
        return f"not reached: the call's time stopped it at step {r.cut_at_step} (val loss {_num(r.ours_final, '.4f')})"
    return f"not reached (final {_num(r.ours_final, '.4f')})"


def protocol(r: Row) -> str:
    if r.variant == "-":
        return "-"
    tokens = f"the same first {r.val_tokens:,} val tokens" if r.val_tokens else "the same val tokens"
    if r.long:
        return f"{tokens}; both: the record's document-causal long-context evaluation"
    return f"{tokens}; record: its document-causal long-context evaluation; ours: 1024-token windows"


def table(rows: list[Row], doc: Path) -> list[str]:
    out = ["| corpus | record | record s (adjusted) | target (record's final val loss) | ours (variant) | "
           "ours s to target (interpolated) | time ratio ours / record | tokens/s ratio ours / record | "
           "val protocol | device | command |", "|---|---|---:|---:|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        rec_s = _cell(r.record_note)[:100] if r.record_s is None and r.record_note else _num(r.record_s, ".1f")
        shipped = "" if not r.shipped else " (shipped default)" if r.variant == SHIPPED else \
            " (= recipe, the shipped default's spec)"
        variant = f"**{r.variant}**{shipped}" if r.marked else r.variant
        link = Path(os.path.relpath(r.file.resolve(), doc.parent.resolve())).as_posix()
        out.append(f"| {corpus_cell(r)} | {r.record} | {rec_s} | {_num(r.target, '.4f')} | {variant} | {ours_cell(r)} | "
                   f"{_num(r.time_ratio, '.3f', 'x')} | {_num(r.tokens_per_s_ratio, '.2f', 'x')} | {protocol(r)} | "
                   f"{r.device} | `{_cell(r.command)}` ([raw]({link})) |")
    return out


def standing(r: Row, goal: float) -> str:
    where = f"`{r.variant}` on {r.device}"
    if r.ours_error and r.record_note:
        return f"record {_cell(r.record_note)}; ours {r.ours_error}"
    if r.ours_error:
        return f"{where}: failed"
    if r.record_s is None:
        return f"{where}: no record time to compare with" + (f" (record {r.record_note})" if r.record_note else "")
    if r.time_ratio is None and r.cut_at_step is not None:
        return f"{where}: stopped by the call's time at step {r.cut_at_step}, before the target ({_num(r.target, '.4f')})"
    if r.time_ratio is None:
        return f"{where}: target not reached (final {_num(r.ours_final, '.4f')} vs {_num(r.target, '.4f')})"
    return f"{where}: {r.time_ratio:.3f}x, {'within' if r.time_ratio <= goal else 'above'} {goal:.2f}x"


def goal_lines(rows: list[Row], manifest: dict[str, Any]) -> list[str]:
    """Where each (corpus, record) stands against its record's goal, from the bold rows."""
    corpora = list(manifest.get("corpora") or {}) or sorted({r.corpus for r in rows})
    corpora += sorted({r.corpus for r in rows} - set(corpora))
    goals = " and ".join(f"<= {g:.2f}x the {rec} record's time" for rec, g in GOALS.items())
    out = [f"Goals: ours {goals}, on each corpus. Where each stands (bold rows):", ""]
    for corpus in corpora:
        held = corpus_info(manifest, corpus)[1]
        for rec, goal in GOALS.items():
            mine = [r for r in rows if r.corpus == corpus and r.record == rec and r.marked]
            label = f"{corpus}{' (held out)' if held else ''}, {rec} record (<= {goal:.2f}x)"
            out.append(f"- {label}: " + ("; ".join(standing(r, goal) for r in mine) if mine else "no result"))
    return out


def section(files: list[Path], manifest: dict[str, Any], doc: Path, img: Path | None,
            title: str = "## Time to target per corpus: the record scripts vs ours") -> list[str]:
    out = [title, ""]
    command = ("`python -m benchmarks.gpt2_record --record <2025-01-04|2025-07-13|2025-08-23> --data-dir .data/corpora/<corpus> "
               "--ours <variant> [--ours <variant> ...] --out benchmarks/results/gpt2_record_<corpus>_<record>_<device>.json`")
    if not files:
        return out + ["No per-corpus results yet: no `benchmarks/results/gpt2_record_<corpus>_<record>_<device>.json` "
                      f"file. GPU figures: pending (one {command} per corpus and record, on an H100).", ""]
    rows = read_all(files, manifest)
    held = manifest.get("held_out")
    out += [f"One call per corpus and record ({command}): the record script's final val loss is the target; "
            "ours trains on the same corpus until it reaches it. Compile and validation excluded for both; the record's "
            "time adds back the steps its own clock leaves out. Corpora and their split: [corpora.md](corpora.md)"
            + (f"; `{held}` is held out (never used to tune the recipe)." if held else "."), "",
            f"Bold: the shipped `{SHIPPED}` variant, or every variant of a call that has no `{SHIPPED}` run.", ""]
    out += table(rows, doc) + [""] + goal_lines(rows, manifest) + [""]
    if img is not None:
        out += [f"![val loss vs training seconds per corpus and record](img/{img.name})", ""]
    return out


def plot(files: list[Path], manifest: dict[str, Any], img: Path) -> bool:
    """Val loss against training seconds, the record and each variant of ours, one panel per (corpus, record) and
    device where several devices ran it; the target as a horizontal line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = []
    for f in files:
        results = load_result(f)["results"]["results"]
        rows = read_rows(f, manifest)
        ours = [(f"ours {r.variant}", results[r.key], "-") for r in rows if r.key in results]
        rec = results.get("record") or {}
        if rows and (ours or rec.get("val_curve")):  # a call with nothing measured draws no panel
            panels.append((rows[0], [(f"record {rows[0].record}", rec, "--"), *ours]))
    if not panels:
        return False
    key = order(manifest)
    panels.sort(key=lambda p: key(p[0]))
    several_devices = len({p[0].device for p in panels}) > 1
    cols = min(3, len(panels))
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5.2 * cols, 3.8 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (head, series) in zip(axes.flat, panels):
        for label, r, style in series:
            pts = [(p["train_s"], p["val_loss"]) for p in r.get("val_curve") or []
                   if p.get("train_s") is not None and p.get("step", 1) > 0]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=label)
        if head.target is not None:
            ax.axhline(head.target, color="grey", lw=0.8, ls=":", label=f"target {head.target:.3f}")
        ax.set_title(f"{head.corpus}{' (held out)' if head.held_out else ''}, record {head.record}"
                     + (f"\n{head.device}" if several_devices else ""), fontsize=9)
        ax.set_xlabel("training seconds", fontsize=8)
        ax.set_ylabel("val loss", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("GPT-2 124M time to target per corpus, one GPU (compile and validation excluded)", fontsize=10)
    fig.tight_layout()
    img.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(img, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return True
