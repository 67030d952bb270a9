"""Turn text into train/val token shards (text files or a streamed Hugging Face dataset).

Each document is preceded by the tokenizer's end-of-text token (50256 for GPT-2, 255 for bytes), as in
FineWeb's shards. Documents go to validation deterministically (see :func:`is_val_doc`). Shards are
``{prefix}_{split}_{index:06d}.bin`` with at most ``shard_tokens`` tokens each, plus ``{prefix}_meta.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_opt._optional import require
from lightning_opt.data.shards import PathLike, resolve_files, write_shard
from lightning_opt.data.tokenizer import ByteTokenizer, GPT2Tokenizer, get_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000  # as FineWeb's shards


def normalize_text(text: str) -> str:
    """Strip a leading byte-order mark and turn CRLF line ends into LF."""
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def is_val_doc(index: int, val_fraction: float) -> bool:
    """Whether document ``index`` of a stream goes to validation: ``floor((i+1)f) > floor(i f)``, i.e.
    every ``1/f``-th document (documents 9, 19, 29, ... for ``f = 0.1``). Needs no document count."""
    return math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


class ShardWriter:
    """Appends token arrays and writes ``{prefix}_{split}_{index:06d}.bin`` shards of ``shard_tokens``."""

    def __init__(self, out_dir: Path, prefix: str, split: str, shard_tokens: int) -> None:
        self.out_dir, self.prefix, self.split, self.shard_tokens = out_dir, prefix, split, shard_tokens
        self.pending: list[np.ndarray] = []  # grows to one shard at most, so small runs stay small
        self.fill = 0
        self.files: list[Path] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), self.shard_tokens - self.fill)
            self.pending.append(tokens[:take])
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if self.fill:
            path = self.out_dir / f"{self.prefix}_{self.split}_{len(self.files):06d}.bin"
            self.files.append(write_shard(path, np.concatenate(self.pending)))
            self.tokens += self.fill
            self.pending, self.fill = [], 0

    def close(self) -> list[Path]:
        self._flush()
        return self.files

    def remove(self) -> None:
        """Delete the shards written so far (after a failed run)."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files, self.pending, self.fill = [], [], 0


def _check_out_dir(out_dir: Path, prefix: str, overwrite: bool) -> None:
    existing = sorted(out_dir.glob(f"{prefix}_train_*.bin")) + sorted(out_dir.glob(f"{prefix}_val_*.bin"))
    if existing and not overwrite:
        raise FileExistsError(
            f"'{out_dir}' already has {len(existing)} '{prefix}' shards (e.g. '{existing[0].name}'); pass "
            f"--overwrite to replace them, or choose another --out-dir/--prefix"
        )
    for path in existing:  # stale shards from a larger earlier run would be picked up by globs
        path.unlink()


def write_documents(
    documents: Iterable[str],
    out_dir: PathLike,
    tokenizer: ByteTokenizer | GPT2Tokenizer,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    prefix: str = "data",
    overwrite: bool = False,
    source: str = "",
    batch_docs: int = 256,
) -> dict[str, Any]:
    """Tokenize a stream of documents into train/val shards.

    With exactly one document and ``val_fraction > 0``, its last ``val_fraction`` of tokens is the
    validation set instead (a document-level split would leave nothing for one side).

    If it fails, the shards it wrote and the folders it created are removed (a folder that existed
    before is left as it was, and nothing else in it is touched).

    Returns:
        The metadata also written to ``{prefix}_meta.json``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out_dir).expanduser()
    created = [d for d in (out, *out.parents) if not d.exists()]  # removed again if this run fails
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write_documents(documents, out, tokenizer, val_fraction, shard_tokens, prefix, overwrite,
                                source, batch_docs)
    except BaseException:
        for folder in created:  # deepest first; only folders this run made, and only if left empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _write_documents(
    documents: Iterable[str],
    out: Path,
    tokenizer: ByteTokenizer | GPT2Tokenizer,
    val_fraction: float,
    shard_tokens: int,
    prefix: str,
    overwrite: bool,
    source: str,
    batch_docs: int,
) -> dict[str, Any]:
    _check_out_dir(out, prefix, overwrite)
    writers = {s: ShardWriter(out, prefix, s, shard_tokens) for s in ("train", "val")}
    eot = np.array([tokenizer.eot], dtype=np.uint16)
    counts = {"train": 0, "val": 0}

    def route(i: int, tokens: np.ndarray) -> None:
        split = "val" if is_val_doc(i, val_fraction) else "train"
        writers[split].add(tokens)
        counts[split] += 1

    try:
        first: np.ndarray | None = None  # held until we know whether it is the only document
        index = 0
        for chunk in _chunks(documents, batch_docs):
            texts = [normalize_text(t) for t in chunk]
            if isinstance(tokenizer, GPT2Tokenizer):
                encoded: Iterable[list[int]] = tokenizer.encode_batch(texts)
            else:
                encoded = map(tokenizer.encode, texts)
            for ids in encoded:
                tokens = np.concatenate([eot, np.asarray(ids, dtype=np.uint16)])
                if index == 0:
                    first = tokens
                else:
                    if index == 1:
                        route(0, first)  # type: ignore[arg-type]
                    route(index, tokens)
                index += 1
        if index == 0:
            raise ValueError("no documents to tokenize; check the input files / dataset")
        if index == 1:  # a single document: its tail is the validation set
            cut = len(first) - int(len(first) * val_fraction)  # type: ignore[arg-type]
            writers["train"].add(first[:cut])  # type: ignore[index]
            writers["val"].add(first[cut:])  # type: ignore[index]
            counts = {"train": 1, "val": int(cut < len(first))}  # type: ignore[arg-type]
        if val_fraction > 0 and counts["val"] == 0:
            raise ValueError(
                f"{index} documents and val_fraction={val_fraction} give no validation document; pass more "
                f"documents, a larger --val-fraction (>= {1 / index:.3g}), or --val-fraction 0"
            )
        files = {s: [p.name for p in w.close()] for s, w in writers.items()}
    except BaseException:
        for w in writers.values():  # no half-made shard set is left to be picked up by a glob
            w.remove()
        raise
    meta = {
        "source": source,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot": tokenizer.eot,
        "val_fraction": val_fraction,
        "documents": counts,
        "tokens": {s: w.tokens for s, w in writers.items()},
        "files": files,
        "format": "FineWeb/llm.c .bin: 256 int32 header [20240520, 1, n_tokens] + uint16 tokens",
    }
    (out / f"{prefix}_meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _chunks(items: Iterable[str], n: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _read_text_files(files: Sequence[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"'{path}' is not valid UTF-8 text ({err}); convert it to UTF-8 first") from err


def prepare_text_files(
    inputs: PathLike | Sequence[PathLike],
    out_dir: PathLike,
    tokenizer: str = "gpt2",
    bpe_file: PathLike | None = None,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    prefix: str = "data",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize text files (one document each, in sorted glob order) into shards.

    Args:
        inputs: file paths or globs, e.g. ``"texts/*.txt"``.
        out_dir: output folder.
        tokenizer: ``"gpt2"`` (the GPT-2 BPE shipped with the package; offline) or ``"byte"``.
        bpe_file: another ``r50k_base.tiktoken`` file for the GPT-2 BPE (default: the shipped one).
        val_fraction: share of documents for validation.
        shard_tokens: maximum tokens per shard.
        prefix: shard name prefix.
        overwrite: replace existing shards with this prefix.
    """
    files = resolve_files(inputs)
    tok = get_tokenizer(tokenizer, bpe_file)
    source = "text files: " + ", ".join(p.name for p in files[:20]) + (" ..." if len(files) > 20 else "")
    return write_documents(
        _read_text_files(files), out_dir, tok, val_fraction, shard_tokens, prefix, overwrite, source=source
    )


def prepare_hf_dataset(
    name: str,
    out_dir: PathLike,
    split: str = "train",
    text_field: str = "text",
    config: str | None = None,
    tokenizer: str = "gpt2",
    bpe_file: PathLike | None = None,
    val_fraction: float = 0.1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    prefix: str = "data",
    max_docs: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Stream a Hugging Face dataset (``datasets``, the ``hf`` extra) into shards.

    Args:
        name: dataset id, e.g. ``"HuggingFaceFW/fineweb-edu"``.
        split: dataset split to read.
        text_field: the record field holding the text.
        config: dataset configuration name, e.g. ``"sample-10BT"``.
        max_docs: stop after this many documents.
        Other arguments as in :func:`prepare_text_files`.
    """
    datasets = require("datasets", "hf", purpose="prepare --hf-dataset")
    tok = get_tokenizer(tokenizer, bpe_file)
    stream = datasets.load_dataset(name, config, split=split, streaming=True)

    def texts() -> Iterator[str]:
        for i, record in enumerate(stream):
            if max_docs is not None and i >= max_docs:
                return
            if text_field not in record:
                raise KeyError(
                    f"dataset '{name}' records have no field {text_field!r}; fields are {sorted(record)}; "
                    f"pass --text-field"
                )
            yield record[text_field]

    source = f"huggingface dataset {name}" + (f"/{config}" if config else "") + f" split {split}"
    return write_documents(
        texts(), out_dir, tok, val_fraction, shard_tokens, prefix, overwrite, source=source, batch_docs=1024
    )
