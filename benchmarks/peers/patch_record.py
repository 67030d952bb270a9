"""Make a runnable copy of a modded-nanogpt record script for our data, changing nothing else.

A record log ``records/track_1_short/<record>/<id>.txt`` of github.com/KellerJordan/modded-nanogpt starts with
the exact code that produced it, followed by a line of 100 ``=`` and the log. This script reads that file (from
the git-ignored ``.peers/modded-nanogpt/record_<date>.txt``), keeps the code, and changes exactly four values
of its ``Hyperparameters``: the train and val data paths (or glob patterns), the iteration count and the val
token count. Each must match exactly once, or it stops with an error (so a different file is never
half-patched). The output goes to ``.peers/modded-nanogpt/train_gpt_<date>.py``; their code is never
committed here.

Records (:data:`RECORDS`):

* ``2025-01-04`` (``2025-01-04_SoftCap``): 8 x 64 x 1024 = 524,288 tokens per step; its clock restarts after
  step 10. Its train loader cycles over the shards.
* ``2025-08-23`` (``2025-08-23_SparseAttnGate``): the newest record that imports only torch and Triton (no
  flash-attn, no ``kernels`` package); 8 x 48 x 1024 = 393,216 tokens per step (one GPU: 8 accumulation steps),
  compile warm-up before the clock. Its train loader reads each matched file once, so more than one pass needs
  the pattern to match the shard several times (:func:`record_data`); its validation reads in windows of
  8 x 262,144 tokens, so the val file must hold at least that many (the first ``val_tokens`` are evaluated).

    python benchmarks/peers/patch_record.py --train .data/novels/novels_train_000000.bin \
        --val .data/novels/novels_val_000000.bin --iterations 127 --val-tokens 1048576
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = ROOT / ".peers" / "modded-nanogpt"
SEPARATOR = "=" * 100
_HEADER_INTS = 256
_MAGIC = 20240520


@dataclass(frozen=True)
class Record:
    """One record script: where its log lives, the four lines the patch changes, and how it counts time."""

    date: str
    folder: str
    edits: tuple[tuple[str, str, str], ...]  # (what is changed, pattern on one line, replacement template)
    tokens_per_step: int
    warm_reset: int  # steps its clock leaves out after the start (compile happens in them)
    train_passes_per_file: bool  # True: the loader reads each matched train file once
    val_window_tokens: int  # tokens the val loader needs in one file (0: no constraint)

    @property
    def log(self) -> Path:
        return PEER_DIR / f"record_{self.date}.txt"

    @property
    def patched(self) -> Path:
        return PEER_DIR / f"train_gpt_{self.date}.py"


RECORDS: dict[str, Record] = {
    "2025-01-04": Record(
        "2025-01-04", "records/track_1_short/2025-01-04_SoftCap",
        (("train data", r"^(\s*train_bin = )'[^']*'", "{0}{train!r}"),
         ("val data", r"^(\s*val_bin = )'[^']*'", "{0}{val!r}"),
         ("iterations", r"^(\s*num_iterations = )\d+", "{0}{iterations}"),
         ("val tokens", r"^(\s*val_tokens = )\d+", "{0}{val_tokens}")),
        tokens_per_step=8 * 64 * 1024, warm_reset=10, train_passes_per_file=False, val_window_tokens=0),
    "2025-08-23": Record(
        "2025-08-23", "records/track_1_short/2025-08-23_SparseAttnGate",
        (("train data", r"^(\s*train_files = )\"[^\"]*\"", "{0}{train_q}"),
         ("val data", r"^(\s*val_files = )\"[^\"]*\"", "{0}{val_q}"),
         ("iterations", r"^(\s*num_iterations = )\d+", "{0}{iterations}"),
         ("val tokens", r"^(\s*val_tokens = )\d+", "{0}{val_tokens}")),
        tokens_per_step=8 * 48 * 1024, warm_reset=0, train_passes_per_file=True, val_window_tokens=8 * 4 * 64 * 1024),
}
DEFAULT_RECORD = "2025-01-04"


def record_code(text: str) -> str:
    """The code at the top of a record log: everything before the first line of 100 ``=``."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\n") == SEPARATOR:
            return "".join(lines[:i])
    raise ValueError("no line of 100 '=' found: this is not a modded-nanogpt record log")


def patch(code: str, train: str, val: str, iterations: int, val_tokens: int,
          edits: tuple[tuple[str, str, str], ...] = RECORDS[DEFAULT_RECORD].edits) -> str:
    values = dict(train=str(train), val=str(val), train_q=_dq(train), val_q=_dq(val), iterations=int(iterations),
                  val_tokens=int(val_tokens))
    for what, pattern, template in edits:
        rx = re.compile(pattern, re.MULTILINE)
        hits = rx.findall(code)
        if len(hits) != 1:
            raise ValueError(f"expected exactly one line setting the {what} (/{pattern}/), found {len(hits)}")
        code = rx.sub(lambda m, t=template: t.format(m.group(1), **values), code)
    return code


def _dq(path: str) -> str:
    """A double-quoted Python string literal of ``path`` (the 2025-08-23 script quotes its paths that way)."""
    if '"' in str(path) or "\\" in str(path):
        raise ValueError(f"data path {path!r} has a quote or backslash: use a plain path")
    return f'"{path}"'


def write_patched(train: str, val: str, iterations: int, val_tokens: int, source: Path | None = None,
                  dest: Path | None = None, record: str = DEFAULT_RECORD) -> Path:
    rec = RECORDS[record]
    source = source or rec.log
    dest = dest or rec.patched
    if not source.exists():
        raise FileNotFoundError(
            f"{source} is missing: export {rec.folder}/<id>.txt of github.com/KellerJordan/modded-nanogpt there "
            "(git-ignored, never committed)"
        )
    code = patch(record_code(source.read_text()), train, val, iterations, val_tokens, rec.edits)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(code)
    return dest


def _shard_tokens(path: Path) -> int:
    header = np.fromfile(path, dtype=np.int32, count=_HEADER_INTS)
    if header.size < 3 or header[0] != _MAGIC:
        raise ValueError(f"{path} is not a FineWeb-format shard (magic {_MAGIC} expected)")
    return int(header[2])


def _passes_needed(train: Path, sequences: int, seq_len: int, bos: int = 50256) -> int:
    """Passes over ``train`` that the 2025-08-23 loader consumes for ``sequences`` sequences on one GPU: each
    starts at a document start and consumes up to the first document start at least ``seq_len`` later (so a
    document longer than ``seq_len`` is read only up to ``seq_len``, the rest skipped)."""
    n = _shard_tokens(train)
    toks = np.memmap(train, dtype=np.uint16, mode="r", offset=4 * _HEADER_INTS, shape=(n,))
    starts = np.flatnonzero(toks == bos)
    if starts.size < 2:
        raise ValueError(f"{train} has fewer than two <|endoftext|> tokens: the record's loader needs documents")
    passes, pos = 1, 0
    for _ in range(sequences):
        i = int(np.searchsorted(starts, pos))
        if i >= starts.size:  # next pass (the next link to the same shard)
            passes, pos, i = passes + 1, 0, 0
        j = int(np.searchsorted(starts, starts[i] + seq_len))
        if j >= starts.size:
            passes, pos = passes + 1, 0
            continue
        pos = int(starts[j])
    return passes


def record_data(record: str, train: Path, val: Path, iterations: int, val_tokens: int, workdir: Path
                ) -> tuple[str, str]:
    """The train and val paths to patch in for ``record``: the shards themselves, or, for a record whose loader
    reads each train file once, a pattern over enough links to the train shard for ``iterations`` steps (the
    same tokens, in order, pass after pass), and for a record whose val loader needs a window larger than the
    val shard, a val file holding the val shard twice (only the first ``val_tokens`` are evaluated).
    Everything new goes under ``workdir``; the shards are not modified."""
    rec = RECORDS[record]
    train_s, val_s = str(train.resolve()), str(val.resolve())
    if rec.train_passes_per_file:
        copies = _passes_needed(train, iterations * 8, rec.tokens_per_step // 8) + 1
        tdir = workdir / "train"
        tdir.mkdir(parents=True, exist_ok=True)
        for i in range(copies):
            link = tdir / f"train_{i:06d}.bin"
            if not link.exists():
                os.symlink(train.resolve(), link)
        train_s = str(tdir / "train_*.bin")
    if rec.val_window_tokens:
        n = _shard_tokens(val)
        if n < val_tokens:
            raise ValueError(f"{val} holds {n} tokens, fewer than --val-tokens {val_tokens}")
        if n <= rec.val_window_tokens:
            toks = np.fromfile(val, dtype=np.uint16, offset=4 * _HEADER_INTS, count=n)
            reps = -(-(rec.val_window_tokens + 1) // n)
            header = np.zeros(_HEADER_INTS, dtype=np.int32)
            header[:3] = (_MAGIC, 1, n * reps)
            vdir = workdir / "val"
            vdir.mkdir(parents=True, exist_ok=True)
            out = vdir / "val_000000.bin"
            with open(out, "wb") as f:
                f.write(header.tobytes())
                for _ in range(reps):
                    f.write(toks.tobytes())
            val_s = str(out)
    return train_s, val_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", default=DEFAULT_RECORD, choices=sorted(RECORDS))
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--iterations", type=int, default=127)
    p.add_argument("--val-tokens", type=int, default=1_048_576)
    p.add_argument("--source", default=None, help="the record log (default: .peers/modded-nanogpt/record_<date>.txt)")
    p.add_argument("--dest", default=None)
    a = p.parse_args()
    out = write_patched(str(Path(a.train).resolve()), str(Path(a.val).resolve()), a.iterations, a.val_tokens,
                        Path(a.source) if a.source else None, Path(a.dest) if a.dest else None, a.record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
