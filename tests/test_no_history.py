"""Code, configs, docs and results describe the product, not its development history (that is git's job).

Fails on work-period tags ("session 7", "s6b_"), issue numbers ("issue #4"), goal bookkeeping ("goal 1: met")
and "before the fix"-style narration anywhere in the tracked tree's text files.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCOPES = ("lightning_opt", "docs", "benchmarks", "README.md", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".txt", ".toml", ".cfg", ".ipynb"}
PATTERNS = [
    re.compile(r"\bsessions? \d", re.I),  # "session 7", "sessions 4-6"
    re.compile(r"\bsession-\d", re.I),  # "the session-6 recipe"
    re.compile(r"(?<![A-Za-z0-9])s\d+[a-z]?_(?=[a-z0-9])"),  # "s6b_nogain", "gpt2_speedrun_s7e_..."
    re.compile(r"\bissue #?\d", re.I),  # "issue #4", "issue 9"
    re.compile(r"\bgoal \d", re.I),  # "goal 1: met"
    re.compile(r"\bbefore the fix", re.I),
    re.compile(r"\bfirst try\b", re.I),
    re.compile(r"\bthe previous version\b", re.I),
    re.compile(r"\bour first version\b", re.I),
]


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCOPES],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    me = Path(__file__).resolve()
    return [ROOT / f for f in out if Path(f).suffix in SUFFIXES and (ROOT / f).is_file() and (ROOT / f).resolve() != me]


def test_no_development_history_in_the_tree():
    hits = []
    for path in _files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in PATTERNS:
                if m := pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:120]}")
    assert not hits, f"{len(hits)} development-log phrases (describe what the thing is instead):\n" + "\n".join(hits)
