"""The offline default corpus: Python's own reference documentation, byte-tokenized.

Provenance: ``pydoc_data.topics.topics`` is part of the CPython standard library (``Lib/pydoc_data``,
generated from the Python Language Reference and Library docs; Python Software Foundation License).
It is real English technical prose (~80 topics, ~0.45 MB of text on CPython 3.11) that every Python
installation already has, so demos, tests and notebooks run on a fresh machine with no download.

It is tokenized with :class:`~lightning_opt.data.tokenizer.ByteTokenizer` (UTF-8 bytes, vocab 256): the
GPT-2 BPE vocabulary would need a download, which an offline machine cannot do. Topics are sorted by
name; every 10th (index 5, 15, ...) goes to validation. Each topic is preceded by the separator 255.

The shards are cached under ``$LIGHTNING_OPT_CACHE/corpus`` (default ``~/.cache/lightning_opt/corpus``),
named by a hash of the text (so another Python version's topics get their own files), verified against
a SHA-256 manifest on every use, and rebuilt when missing or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_opt.data.shards import read_shard, write_shard
from lightning_opt.data.tokenizer import ByteTokenizer

VAL_EVERY = 10
VAL_OFFSET = 5


def cache_root() -> Path:
    """``$LIGHTNING_OPT_CACHE`` or ``~/.cache/lightning_opt``."""
    env = os.environ.get("LIGHTNING_OPT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_opt"


def corpus_documents() -> list[tuple[str, str]]:
    """The ``(name, text)`` documents of the corpus, sorted by name."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:  # some distributions strip pydoc_data
        raise RuntimeError(
            "the default corpus needs the standard-library module 'pydoc_data' (Python's reference docs), "
            "which this Python lacks; install the full standard library (e.g. the python3-doc / libpython "
            "stdlib package) or use your own shards (`lightning-opt-data prepare`)"
        ) from err
    return sorted(topics.items())


def split_documents(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Deterministic split: every ``VAL_EVERY``-th document (from ``VAL_OFFSET``) is validation."""
    train, val = [], []
    for i, (_, text) in enumerate(docs):
        (val if i % VAL_EVERY == VAL_OFFSET else train).append(text)
    return train, val


def _tokens(texts: list[str]) -> np.ndarray:
    tok = ByteTokenizer()
    parts = []
    for text in texts:
        parts.append(np.array([tok.eot], dtype=np.uint16))
        parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
    return np.concatenate(parts)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _valid(manifest: Path, train: Path, val: Path) -> bool:
    try:
        meta = json.loads(manifest.read_text())
        for key, path in (("train", train), ("val", val)):
            if read_shard(path).shape[0] != meta[key]["tokens"] or _sha256(path) != meta[key]["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def default_corpus_shards(cache_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Build (once) and return ``(train_path, val_path)`` of the byte-level default corpus.

    Args:
        cache_dir: where to keep the shards; default ``$LIGHTNING_OPT_CACHE/corpus`` or
            ``~/.cache/lightning_opt/corpus``.

    Returns:
        Paths of the train and val shards (FineWeb format, token ids < 256).
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "corpus"
    docs = corpus_documents()
    digest = hashlib.sha256()
    for name, text in docs:
        digest.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    stem = f"pydoc_topics_{digest.hexdigest()[:12]}"
    train, val = folder / f"{stem}_train.bin", folder / f"{stem}_val.bin"
    manifest = folder / f"{stem}.json"
    if _valid(manifest, train, val):
        return train, val

    train_texts, val_texts = split_documents(docs)
    write_shard(train, _tokens(train_texts))
    write_shard(val, _tokens(val_texts))
    meta = {
        "source": "pydoc_data.topics.topics (CPython standard library, PSF License)",
        "tokenizer": "byte (UTF-8 bytes, vocab 256, separator 255 before each document)",
        "split": f"documents sorted by name; index % {VAL_EVERY} == {VAL_OFFSET} -> val",
        "documents": {"train": len(train_texts), "val": len(val_texts)},
        "train": {"file": train.name, "tokens": int(read_shard(train).shape[0]), "sha256": _sha256(train)},
        "val": {"file": val.name, "tokens": int(read_shard(val).shape[0]), "sha256": _sha256(val)},
    }
    # Manifest last and atomically: its presence means both shards are complete.
    fd, tmp = tempfile.mkstemp(prefix=f".{manifest.name}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, manifest)
    return train, val


class RandomWindows(IterableDataset):
    """An endless stream of ``(x, y)`` next-token batches: ``batch_size`` windows of ``seq_len + 1`` tokens of
    ``tokens`` at random starts (numpy generator seeded with ``seed``), ``y`` one token ahead of ``x``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        n = len(self.tokens) - self.seq_len - 1
        while True:
            starts = rng.integers(0, n, self.batch_size)
            w = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
            t = torch.from_numpy(w)
            yield t[:, :-1], t[:, 1:]


def corpus_windows(split: str, seq_len: int, batch_size: int, seed: int) -> RandomWindows:
    """:class:`RandomWindows` of the default corpus' ``train`` or ``val`` split."""
    train, val = default_corpus_shards()
    return RandomWindows(read_shard(train if split == "train" else val), seq_len, batch_size, seed)
