"""Run the reliability suite (default and long randomized variants) and publish its figures.

    python -m benchmarks.reliability_report                  # both variants, ~5-10 min on 2 CPU cores
    python -m benchmarks.reliability_report --quick          # the default (short) variants only
    python -m benchmarks.reliability_report --from-json      # only regenerate the docs table

Each test in ``tests/reliability`` records its fault kind and per-trial outcome (survived, data lost,
hang) through the ``fault`` fixture when ``RELIABILITY_LOG`` is set. This script sets it, runs pytest,
adds the fault kinds whose tests live next to the code they cover (``ELSEWHERE``: one trial per pytest
case, read from pytest's JUnit XML), aggregates the rows per fault kind, writes
``benchmarks/results/reliability.json`` and rewrites the table between the markers in ``docs/reliability.md``. The numbers in the docs come only from that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from benchmarks._results import command_line, environment, load_result, payload, write_result

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- reliability-table:start -->", "<!-- reliability-table:end -->"


def _run_pytest(markers: str, log: Path, extra: list[str]) -> tuple[int, float, list[str]]:
    cmd = [sys.executable, "-m", "pytest", "tests/reliability", "-m", markers, "-q", "-p", "no:cacheprovider",
           "-p", "no:warnings", "--no-header", "-rfEx", *extra]
    env = {**os.environ, "RELIABILITY_LOG": str(log)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    tail = proc.stdout.strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return proc.returncode, seconds, cmd


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


ORDER = ("test_nonfinite", "test_kill_resume", "test_disk_full", "test_bad_data", "test_bad_config",
         "test_bad_checkpoint", "test_checkpoint_folder", "test_untrusted_files")

# Fault kinds whose tests live next to the code they cover (outside tests/reliability): each pytest case is
# one trial, survived when it passes. (kind, what is injected, node ids or test files)
ELSEWHERE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("recipe checkpoint: resume and load",
     "every recipe and shipped config: train 2 steps, resume with --ckpt_path to step 4 from the saved weights, "
     "<Module>.load_from_checkpoint gives them back",
     ("tests/recipes/test_resume.py",)),
    ("NaNSkip: two optimizers, manual optimization",
     "NaN loss or a NaN gradient of the second optimizer only (accumulation 1 and 4, device and host mode): "
     "both optimizers skip, bit-identical to a run without that window",
     ("tests/callbacks/test_nan_skip.py::test_one_decision_covers_every_optimizer_of_the_step",
      "tests/callbacks/test_nan_skip.py::test_flag_raised_after_the_first_optimizer_stepped_skips_the_later_one_alone")),
    ("LossClamp bounds under accumulation",
     "a loss of ~50 with max=20 at accumulate_grad_batches 1 and 4, and with a GradScaler: the bound applies to "
     "what training_step returned",
     ("tests/callbacks/test_loss_clamp.py::test_bounds_are_in_training_step_units_under_accumulation",
      "tests/callbacks/test_loss_clamp.py::test_bounds_are_in_training_step_units_with_a_grad_scaler")),
    ("LossClamp with NaNSkip, either order",
     "a clamped loss with skip_step_when_clamped, and an inf loss, with LossClamp before or after NaNSkip: the step "
     "is skipped (params, AdamW moments, LR schedule unchanged); clamp skips count towards max_consecutive_skips",
     ("tests/callbacks/test_loss_clamp.py::test_skip_step_when_clamped_leaves_params_and_moments_unchanged",
      "tests/callbacks/test_loss_clamp.py::test_inf_loss_is_skipped_by_nan_skip_in_any_order",
      "tests/callbacks/test_loss_clamp.py::test_clamp_skips_count_towards_max_consecutive_skips",
      "tests/callbacks/test_loss_clamp.py::test_skip_step_when_clamped_needs_nan_skip")),
    ("shard file permissions",
     "write_shard under umask 022 and 002, new and replaced files: the mode follows the umask",
     ("tests/data/test_shards.py::test_shard_mode_follows_the_umask",)),
    ("token ids checked in every token",
     "one id >= vocab_size in a shard larger than the sampled scan",
     ("tests/data/test_shards.py::test_vocab_check_finds_one_stray_id_anywhere_in_a_large_shard",)),
    ("same shard twice, val shards = train shards",
     "a file named twice (paths, a link, a glob), val_files equal to or overlapping train_files: read once / warned",
     ("tests/data/test_shards.py::test_resolve_files_reads_a_file_named_twice_once",
      "tests/data/test_datamodule.py::test_val_files_that_are_the_train_files_warn")),
    ("built-in corpus in TokenShardDataModule",
     "TokenShardDataModule('builtin', 'builtin') without the CLI, own train shards with the built-in val shard",
     ("tests/data/test_datamodule.py::test_builtin_corpus_without_the_cli",
      "tests/data/test_datamodule.py::test_own_train_shards_with_the_builtin_val_shard")),
    ("data preparation offline or failing",
     "prepare with no network and no BPE file, a prepare that fails, download-fineweb offline: the error says how "
     "to supply the file, cites no build-machine path, and leaves no folder it created",
     ("tests/data/test_prepare.py::test_offline_gpt2_error_says_how_to_supply_the_bpe_file",
      "tests/data/test_prepare.py::test_failed_prepare_removes_only_the_folders_it_created",
      "tests/data/test_prepare.py::test_download_offline_mode_fails_clearly")),
    ("metrics.json speed of short and resumed runs",
     "a 2-step run and a run resumed from its checkpoint: each reports its own segment's tokens/s",
     ("tests/test_run_summary.py",)),
    ("documented commands",
     "every recipe / lightning-opt-data command in the docs, run with tiny overrides (GPU-only ones parsed)",
     ("tests/test_docs.py::test_docs_commands_are_found", "tests/test_docs.py::test_docs_command_runs")),
)


def _run_elsewhere(extra: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs the ``ELSEWHERE`` tests once; one row per (kind, test function), a trial per pytest case."""
    import xml.etree.ElementTree as ET

    selectors = list(dict.fromkeys(s for _, _, sel in ELSEWHERE for s in sel))
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *selectors, "-m", "not slow and not gpu", "-q", "-p", "no:cacheprovider",
               "-p", "no:warnings", "--no-header", "-rfEx", f"--junitxml={xml}", *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        print("\n".join(proc.stdout.strip().splitlines()[-15:]), flush=True)
        cases = ET.parse(xml).getroot().iter("testcase") if xml.exists() else []
        results = []
        for c in cases:
            module = c.get("classname", "").split(".")
            node = "/".join(module) + ".py::" + c.get("name", "")
            skipped = c.find("skipped") is not None
            failed = c.find("failure") is not None or c.find("error") is not None
            if not skipped:
                results.append((node, not failed, float(c.get("time", 0.0))))
    rows: list[dict[str, Any]] = []
    for kind, description, sel in ELSEWHERE:
        per_test: OrderedDict[str, dict[str, Any]] = OrderedDict()
        for node, passed, secs in results:
            if not any(node == s or node.startswith(s + "[") or node.startswith(s + "::") for s in sel):
                continue
            base = node.split("[", 1)[0]
            r = per_test.setdefault(base, {
                "kind": kind, "description": description, "node": base, "slow": False, "xfail": False, "trials": 0,
                "survived": 0, "data_lost": 0, "hangs": 0, "passed": True, "seconds": 0.0, "notes": [],
            })
            r["trials"] += 1
            r["survived"] += int(passed)
            r["passed"] &= passed
            r["seconds"] = round(r["seconds"] + secs, 2)
            if not passed:
                r["notes"].append(f"failed: {node}")
        if not per_test:  # a selector that found nothing is a row that did not survive, not a missing row
            per_test[sel[0]] = {"kind": kind, "description": description, "node": sel[0], "slow": False,
                                "xfail": False, "trials": 1, "survived": 0, "data_lost": 0, "hangs": 0,
                                "passed": False, "seconds": 0.0, "notes": ["no test ran"]}
        rows += list(per_test.values())
    run = {"command": " ".join(cmd), "exit_code": proc.returncode, "seconds": round(seconds, 1), "tests": len(results)}
    return run, rows


def _rank(row: dict[str, Any]) -> int:
    name = row["node"].split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return ORDER.index(name) if name in ORDER else len(ORDER)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per fault kind: grouped by test file (in ORDER), then in the order the suite met them."""
    kinds: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for r in sorted(rows, key=_rank):
        k = kinds.setdefault(r["kind"], {
            "kind": r["kind"], "description": r["description"], "trials": 0, "survived": 0, "data_lost": 0,
            "hangs": 0, "tests": 0, "tests_passed": 0, "xfail": False, "nodes": [], "notes": [],
        })
        for key in ("trials", "survived", "data_lost", "hangs"):
            k[key] += r[key]
        k["tests"] += 1
        k["tests_passed"] += int(r["passed"])
        k["xfail"] |= r.get("xfail", False)
        if r["node"] not in k["nodes"]:
            k["nodes"].append(r["node"])
            k.setdefault("slow_nodes", []).extend([r["node"]] if r.get("slow") else [])
        k["notes"] += [n for n in r.get("notes", []) if n and n not in k["notes"]][:3]
    return list(kinds.values())


def _cmd(kind: dict[str, Any]) -> str:
    slow = set(kind.get("slow_nodes", []))
    return "<br>".join(f"`{n}`" + (" (slow)" if n in slow else "") for n in kind["nodes"])


def table(result: dict[str, Any]) -> str:
    kinds = result["kinds"]
    lines = [
        f"Measured {result['env']['date_utc']} on {result['env']['host']} (torch {result['env'].get('torch')}, "
        f"lightning {result['env'].get('lightning')}, commit `{result['commit'][:10]}`), from "
        "[`benchmarks/results/reliability.json`](../benchmarks/results/reliability.json). "
        f"{len(kinds)} fault kinds, {sum(k['trials'] for k in kinds)} trials; default suite "
        f"{result['runs'].get('default', {}).get('seconds', float('nan')):.0f} s, long variants "
        f"{result['runs'].get('slow', {}).get('seconds', float('nan')):.0f} s; the tests kept next to the code they "
        f"cover (one trial per pytest case) {result['runs'].get('elsewhere', {}).get('seconds', float('nan')):.0f} s.",
        "",
        "Reproduce a row with `pytest \"<node id>\"` (ids marked slow: `pytest -m slow \"<node id>\"`).",
        "",
        "| # | Fault kind | What is injected | Trials | Survived | Data lost | Hangs | Pytest node ids |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for i, k in enumerate(kinds, 1):
        status = "" if k["survived"] == k["trials"] else " (open bug, see below)"
        lines.append(
            f"| {i} | {k['kind']}{status} | {k['description']} | {k['trials']} | {k['survived']} | "
            f"{k['data_lost']} | {k['hangs']} | {_cmd(k)} |"
        )
    failing = [k for k in kinds if k["survived"] != k["trials"]]
    if failing:
        lines += ["", "Trials that did not survive (first notes per kind):", ""]
        for k in failing:
            lines.append(f"- **{k['kind']}**: {_notes(k)}")
    info = [k for k in kinds if k["survived"] == k["trials"] and k["notes"]]
    if info:
        lines += ["", "What the user is told (first message per kind) and other facts from the runs:", ""]
        lines += [f"- **{k['kind']}**: {_notes(k)}" for k in info]
    return "\n".join(lines)


def _notes(kind: dict[str, Any]) -> str:
    # pytest's temporary folders say nothing to a reader: "<tmp>/file" instead
    flat = (re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/]+/", "<tmp>/", " ".join(n.split())).replace("|", "/")
            for n in kind["notes"][:2])
    return "; ".join(n if len(n) <= 240 else n[:240] + " ..." for n in flat) or "see the test output"


def write_doc(doc: Path, text: str) -> None:
    body = doc.read_text() if doc.exists() else f"# Reliability\n\n{START}\n{END}\n"
    if START not in body or END not in body:
        body += f"\n{START}\n{END}\n"
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reliability.json"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "reliability.md"))
    parser.add_argument("--quick", action="store_true", help="run only the default (short) variants")
    parser.add_argument("--from-json", action="store_true", help="do not run; regenerate the table from --out")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -x, -k kill)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        result = payload(load_result(out))
    else:
        runs: dict[str, Any] = {}
        rows: list[dict[str, Any]] = []
        variants = [("default", "not slow")] + ([] if args.quick else [("slow", "slow")])
        for name, markers in variants:
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "rows.jsonl"
                code, seconds, cmd = _run_pytest(markers, log, args.pytest_args)
                got = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            for r in got:
                r["variant"] = name
            rows += got
            runs[name] = {"command": " ".join(cmd), "exit_code": code, "seconds": round(seconds, 1), "tests": len(got)}
        runs["elsewhere"], got = _run_elsewhere(args.pytest_args)
        rows += [{**r, "variant": "elsewhere"} for r in got]
        env = environment(on_gpu=False)
        env["host"] = f"{platform.machine()} CPU, {os.cpu_count()} cores ({platform.system()})"
        result = payload(write_result(out, benchmark="reliability", env=env, command=command_line(argv),
                                      baseline=None, results={"commit": _git_commit(), "runs": runs,
                                                              "kinds": aggregate(rows), "tests": rows}))
    text = table(result)
    write_doc(Path(args.doc), text)
    print(text)
    totals = {k: sum(x[k] for x in result["kinds"]) for k in ("trials", "survived", "data_lost", "hangs")}
    print(f"\n{len(result['kinds'])} fault kinds: {totals}; wrote {out} and {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
