"""Make a runnable copy of a modded-nanogpt record script for our data, changing nothing else.

A record log ``records/track_1_short/<record>/<id>.txt`` of github.com/KellerJordan/modded-nanogpt starts with
the exact code that produced it, followed by a line of 100 ``=`` and the log. This script reads that file (from
the git-ignored ``.peers/modded-nanogpt/record_<date>.txt``), keeps the code, and changes exactly four values
of its ``Hyperparameters``: the train and val data paths (or glob patterns), the iteration count and the val
token count, plus, for a record whose code has no gradient accumulation, its one training forward/backward line
(the record's tokens per step on one GPU). Each must match exactly once, or it stops with an error (so a
different file is never half-patched). The output goes to ``.peers/modded-nanogpt/train_gpt_<date>.py``; their
code is never committed here.

Records (:data:`RECORDS`):

* ``2025-01-04`` (``2025-01-04_SoftCap``): 8 x 64 x 1024 = 524,288 tokens per step; its clock restarts after
  step 10. Its train loader cycles over the shards.
* ``2025-07-13`` (``2025-07-13_UpgradeTorch190``): the newest record whose train loader reads the shards in
  order (the later ones start every sequence at an ``<|endoftext|>`` found within a fixed window, which long
  documents such as novels exceed) and that imports only torch (no flash-attn, no ``kernels`` package);
  8 x 48 x 1024 = 393,216 tokens per step. Its code takes one 48 x 1024-token sequence per GPU per step, so
  the patch wraps its training forward/backward in ``for _ in range(8 // world_size)``, the accumulation loop
  the later records have (eight sequences per step on one GPU, one on eight: the 8-GPU run unchanged; the
  gradient is the sum over the eight sequences where eight GPUs average theirs, a scale its Muon updates do
  not depend on, nor its Adam ones beyond their 1e-10 epsilon). Compile warm-up and 10 profiled steps (a
  trace written to ``traces/``) before the clock; each matched train file read once; validation in batches
  of 4 x 64 x 1024 tokens.
* ``2025-08-23`` (``2025-08-23_SparseAttnGate``): the newest record that imports only torch and Triton (no
  flash-attn, no ``kernels`` package); 8 x 48 x 1024 = 393,216 tokens per step (one GPU: 8 accumulation steps),
  compile warm-up before the clock. Its train loader reads each matched file once and starts each sequence at
  an ``<|endoftext|>`` within a window of 2 x 8 x 48 x 1024 tokens per step (on one GPU), asserting when a
  document does not end inside it (:func:`record_data` checks this first); its validation reads in windows of
  8 x 262,144 tokens.

Records whose train loader reads each matched file once get a pattern over enough links to the train shard
(:func:`record_data`); a val file shorter than the val loader reads is given the val shard repeated (only the
first ``val_tokens`` are evaluated).

    python -m benchmarks.peers.patch_record --train .data/novels/novels_train_000000.bin \
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
    edits: tuple[tuple[str, str, str], ...]  # (what is changed, pattern, replacement template)
    tokens_per_step: int
    warm_reset: int  # steps its clock leaves out after the start (compile happens in them)
    train_passes_per_file: bool  # True: the loader reads each matched train file once
    val_window_tokens: int  # tokens its val loader reads ahead at a time (0: no constraint)
    train_bos_window: bool = False  # True: each sequence starts at an <|endoftext|> within a fixed window

    @property
    def log(self) -> Path:
        return PEER_DIR / f"record_{self.date}.txt"

    @property
    def patched(self) -> Path:
        return PEER_DIR / f"train_gpt_{self.date}.py"


# the four values as the 2025-07-13 and 2025-08-23 scripts write them (double-quoted paths)
_DQ_EDITS = (("train data", r"^(\s*train_files = )\"[^\"]*\"", "{0}{train_q}"),
             ("val data", r"^(\s*val_files = )\"[^\"]*\"", "{0}{val_q}"),
             ("iterations", r"^(\s*num_iterations = )\d+", "{0}{iterations}"),
             ("val tokens", r"^(\s*val_tokens = )\d+", "{0}{val_tokens}"))
# the training forward/backward of a record without accumulation (at the training loop's indent, so a loop that
# accumulates already is refused), in the accumulation loop of the later records (8 // world_size sequences per
# GPU per step: the 8-GPU run is unchanged)
_ACCUMULATION_EDIT = (
    "accumulation",
    r"^( {4})inputs, targets = next\(train_loader\)\n\1model\(inputs, targets, get_window_size_blocks\(step\)\)\.backward\(\)$",
    "{0}for _ in range(8 // world_size):\n{0}    inputs, targets = next(train_loader)\n"
    "{0}    model(inputs, targets, get_window_size_blocks(step)).backward()")

RECORDS: dict[str, Record] = {
    "2025-01-04": Record(
        "2025-01-04", "records/track_1_short/2025-01-04_SoftCap",
        (("train data", r"^(\s*train_bin = )'[^']*'", "{0}{train!r}"),
         ("val data", r"^(\s*val_bin = )'[^']*'", "{0}{val!r}"),
         ("iterations", r"^(\s*num_iterations = )\d+", "{0}{iterations}"),
         ("val tokens", r"^(\s*val_tokens = )\d+", "{0}{val_tokens}")),
        tokens_per_step=8 * 64 * 1024, warm_reset=10, train_passes_per_file=False, val_window_tokens=0),
    "2025-07-13": Record(
        "2025-07-13", "records/track_1_short/2025-07-13_UpgradeTorch190", _DQ_EDITS + (_ACCUMULATION_EDIT,),
        tokens_per_step=8 * 48 * 1024, warm_reset=0, train_passes_per_file=True, val_window_tokens=4 * 64 * 1024),
    "2025-08-23": Record(
        "2025-08-23", "records/track_1_short/2025-08-23_SparseAttnGate", _DQ_EDITS,
        tokens_per_step=8 * 48 * 1024, warm_reset=0, train_passes_per_file=True, val_window_tokens=8 * 4 * 64 * 1024,
        train_bos_window=True),
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


def _passes_needed(train: Path, steps: int, seq_len: int, bos_window: bool, accum: int = 8, bos: int = 50256) -> int:
    """Passes over ``train`` that the record's loader reads on one GPU for ``steps`` steps of ``accum`` sequences
    of ``seq_len`` tokens, loading the next matched file when the one it reads is short of what it reads ahead.

    Without ``bos_window`` (2025-07-13) it takes the tokens in order, ``seq_len`` a sequence. With it
    (2025-08-23) it reads ahead a window of ``accum`` x 2 x ``seq_len`` tokens a step, and each sequence starts
    at the first ``<|endoftext|>`` in what is left of the window and consumes up to the first one at least
    ``seq_len`` after it; a document that does not end inside the window stops that loader with an assertion
    ("increase token_window if necessary", a value its code computes), so this raises instead, before a run."""
    n = _shard_tokens(train)
    if not bos_window:
        per_pass = (n - 2) // seq_len  # it reads a sequence while pos + seq_len + 1 < n
        if per_pass < 1:
            raise ValueError(f"{train} holds {n} tokens, fewer than one {seq_len}-token sequence")
        return -(-steps * accum // per_pass)
    toks = np.memmap(train, dtype=np.uint16, mode="r", offset=4 * _HEADER_INTS, shape=(n,))
    starts = np.flatnonzero(toks == bos)
    passes, pos = 1, 0
    full = accum * 2 * seq_len
    for step in range(steps):
        window = full
        if pos + window + 1 >= n:  # the next link to the same shard
            passes, pos = passes + 1, 0
        for _ in range(accum):
            i = int(np.searchsorted(starts, pos))
            j = int(np.searchsorted(starts, starts[i] + seq_len)) if i < starts.size else starts.size
            if j >= starts.size or starts[j] >= pos + window:
                raise ValueError(
                    f"{train}: at step {step} no {seq_len}-token sequence starting at an <|endoftext|> ends at "
                    f"the next one within the {window} tokens left of the {full}-token window the record's loader "
                    "reads ahead (a document longer than that): the record asserts 'increase token_window if "
                    "necessary'; use a record whose loader reads in order (--record 2025-07-13)")
            window -= int(starts[j]) - pos
            pos = int(starts[j])
    return passes


def record_data(record: str, train: Path, val: Path, iterations: int, val_tokens: int, workdir: Path
                ) -> tuple[str, str]:
    """The train and val paths to patch in for ``record``: the shards themselves, or, for a record whose loader
    reads each train file once, a pattern over enough links to the train shard for ``iterations`` steps (the
    same tokens, in order, pass after pass), and for a record whose val loader reads further than the val
    shard holds, a val file holding the val shard repeated (only the first ``val_tokens`` are evaluated).
    Everything new goes under ``workdir``; the shards are not modified."""
    rec = RECORDS[record]
    train_s, val_s = str(train.resolve()), str(val.resolve())
    if rec.train_passes_per_file:
        copies = _passes_needed(train, iterations, rec.tokens_per_step // 8, rec.train_bos_window) + 1
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
        # it reads val_window_tokens at a time, each only while pos + val_window_tokens + 1 < n
        needed = -(-val_tokens // rec.val_window_tokens) * rec.val_window_tokens + 2
        if n < needed:
            toks = np.fromfile(val, dtype=np.uint16, offset=4 * _HEADER_INTS, count=n)
            reps = -(-needed // n)
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
