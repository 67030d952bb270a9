"""Make a runnable copy of the modded-nanogpt 2025-01-04 record script for our data, changing nothing else.

The record log ``records/track_1_short/2025-01-04_SoftCap/<id>.txt`` of github.com/KellerJordan/modded-nanogpt
starts with the exact code that produced it, followed by a line of 100 ``=`` and the log. This script
reads that file (from the git-ignored ``.peers/modded-nanogpt/``), keeps the code, and changes exactly four
values of its ``Hyperparameters``: the train and val data paths, the iteration count and the val token
count. Each must match exactly once, or it stops with an error (so a different file is never half-patched).
The output goes to ``.peers/modded-nanogpt/train_gpt_2025-01-04.py``; their code is never committed here.

    python benchmarks/peers/patch_record.py --train .data/novels/novels_train_000000.bin \
        --val .data/novels/novels_val_000000.bin --iterations 127 --val-tokens 1048576
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = ROOT / ".peers" / "modded-nanogpt"
RECORD_TXT = PEER_DIR / "record_2025-01-04.txt"
PATCHED = PEER_DIR / "train_gpt_2025-01-04.py"
SEPARATOR = "=" * 100

# (what is changed, pattern on one line of the Hyperparameters class, replacement template)
_EDITS = (
    ("train data", r"^(\s*train_bin = )'[^']*'", "{0}{train!r}"),
    ("val data", r"^(\s*val_bin = )'[^']*'", "{0}{val!r}"),
    ("iterations", r"^(\s*num_iterations = )\d+", "{0}{iterations}"),
    ("val tokens", r"^(\s*val_tokens = )\d+", "{0}{val_tokens}"),
)


def record_code(text: str) -> str:
    """The code at the top of a record log: everything before the first line of 100 ``=``."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\n") == SEPARATOR:
            return "".join(lines[:i])
    raise ValueError("no line of 100 '=' found: this is not a modded-nanogpt record log")


def patch(code: str, train: str, val: str, iterations: int, val_tokens: int) -> str:
    values = dict(train=str(train), val=str(val), iterations=int(iterations), val_tokens=int(val_tokens))
    for what, pattern, template in _EDITS:
        rx = re.compile(pattern, re.MULTILINE)
        hits = rx.findall(code)
        if len(hits) != 1:
            raise ValueError(f"expected exactly one line setting the {what} (/{pattern}/), found {len(hits)}")
        code = rx.sub(lambda m, t=template: t.format(m.group(1), **values), code)
    return code


def write_patched(train: str, val: str, iterations: int, val_tokens: int, source: Path = RECORD_TXT,
                  dest: Path = PATCHED) -> Path:
    if not source.exists():
        raise FileNotFoundError(
            f"{source} is missing: export records/track_1_short/2025-01-04_SoftCap/*.txt of "
            "github.com/KellerJordan/modded-nanogpt there (git-ignored, never committed)"
        )
    code = patch(record_code(source.read_text()), train, val, iterations, val_tokens)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(code)
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--iterations", type=int, default=127)
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--source", default=str(RECORD_TXT))
    p.add_argument("--dest", default=str(PATCHED))
    a = p.parse_args()
    out = write_patched(str(Path(a.train).resolve()), str(Path(a.val).resolve()), a.iterations, a.val_tokens,
                        Path(a.source), Path(a.dest))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
