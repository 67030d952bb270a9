"""Code, configs, docs and results describe the product, not its development history (that is git's job).

Fails on numbered work periods and their short tags in file names, issue numbers, goal bookkeeping and
narration of earlier states of the code, anywhere in the tracked tree's text files (this file included: the
patterns are written so that they do not match themselves).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCOPES = ("lightning_opt", "docs", "benchmarks", "README.md", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".txt", ".toml", ".cfg", ".ipynb"}
PATTERNS = [
    re.compile(r"\bsessions? \d", re.I),  # a numbered work period, also a range of them
    re.compile(r"\bsession-\d", re.I),  # the same as an adjective
    re.compile(r"(?<![A-Za-z0-9])s\d+[a-z]?_(?=[a-z0-9])"),  # a work-period tag inside a file name
    re.compile(r"\bissue #?\d", re.I),  # an issue number
    re.compile(r"\bgoal \d", re.I),  # numbered goal bookkeeping
    re.compile(r"\bbefore\sthe\sfix", re.I),  # narration of earlier states of the code
    re.compile(r"\bfirst\stry\b", re.I),
    re.compile(r"\bthe\sprevious\sversion\b", re.I),
    re.compile(r"\bour\sfirst\sversion\b", re.I),
]


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPES],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if Path(f).suffix in SUFFIXES and (ROOT / f).is_file()]


def test_no_development_history_in_the_tree():
    hits = []
    for path in _files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in PATTERNS:
                if m := pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:120]}")
    assert not hits, f"{len(hits)} development-log phrases (describe what the thing is instead):\n" + "\n".join(hits)


def test_the_patterns_catch_each_kind():
    # built from pieces, so that this file does not hold the phrases themselves
    samples = ["sess" + "ion 7 result", "the sess" + "ion-6 recipe", "gpt2_s" + "7e_h100.json", "iss" + "ue #4",
               "go" + "al 1: met", "bef" + "ore the fix", "our fir" + "st try", "the prev" + "ious version"]
    for text in samples:
        assert any(p.search(text) for p in PATTERNS), text


# The user pages (README.md and docs/, not the results under docs/benchmarks/) speak the user's language: a
# benchmark run on a GPU machine is a "run", not a "call" of the machine; no "lanes", "budgets" or "device time"
# of the machines that measured it, and no stop-time flags in the commands a user copies.
USER_PAGE_PATTERNS = [
    re.compile(r"\b(same|this|that|earlier|later|next|another|other|one|each|two|three)\s+(GPU-machine\s+)?calls?\b"
               r"(?!\s+(to|of|site|per)\b)", re.I),
    re.compile(r"\bin\s+(one|a|the\s+same)\s+call\b", re.I),
    re.compile(r"\blanes?\b(?!\s+(of|per)\s+(a\s+)?(warp|vector|register))", re.I),
    re.compile(r"\bbudgets?\b", re.I),
    re.compile(r"\bdevice[\s-]+time\b", re.I),
    re.compile(r"--(end-unix|deadline|budget-s)\b"),
]


def _user_pages() -> list[Path]:
    return [ROOT / "README.md",
            *sorted(p for p in (ROOT / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(ROOT / "docs").parts)]


def test_user_pages_carry_no_lab_jargon():
    hits = []
    for path in _user_pages():
        text = path.read_text()
        for pattern in USER_PAGE_PATTERNS:
            for m in pattern.finditer(text):  # across line breaks: a phrase may wrap
                n = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {text.splitlines()[n - 1].strip()[:120]}")
    assert not hits, (f"{len(hits)} lab words on user pages (say 'run', 'time limit', 'GPU time'; results and their "
                      "story belong under docs/benchmarks/):\n" + "\n".join(hits))


def test_the_jargon_patterns_catch_each_kind():
    samples = ["measured in the same\n  call", "the 2025-07-13 lanes", "the token budget", "device time left",
               "--end-unix 1795726108", "in one call on one machine"]
    for text in samples:
        assert any(p.search(text) for p in USER_PAGE_PATTERNS), text
    for text in ["the call is kept out of the compiled graph", "one call per layer to the kernel", "GPU time per call"]:
        assert not any(p.search(text) for p in USER_PAGE_PATTERNS), text
