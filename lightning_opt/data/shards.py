"""Token shards in the FineWeb / llm.c ``.bin`` format.

A shard is a header of 256 little-endian int32 (``[0]`` = magic 20240520, ``[1]`` = version 1,
``[2]`` = number of tokens) followed by the tokens as little-endian uint16. This is the format of
``kjj0/fineweb10B-gpt2`` and of the GPT-2 speedrun, so real FineWeb shards are read unchanged.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKEN_ID = 65535  # uint16

PathLike = Union[str, os.PathLike]

_FORMAT = (
    "FineWeb/llm.c .bin format: 256 int32 header [magic 20240520, version 1, n_tokens], then uint16 tokens"
)
_REBUILD = "re-create it with `lightning-opt-data prepare` or download it again"


def _check_is_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(
            f"token shard '{path}' does not exist; check the path or glob pattern "
            f"(create shards with `lightning-opt-data prepare` or `lightning-opt-data download-fineweb`)"
        )
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(
            f"token shard '{path}' is {kind}; pass the path of a .bin shard file "
            f"(or a glob such as '{path / '*.bin'}')"
        )


def read_header(path: PathLike) -> int:
    """Validate a shard's header and size; return its token count.

    Reads only the 1 KiB header and the file size, so it is cheap for 100M-token shards.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the path is not a file, or the file is empty, truncated, longer than its header
            says, or has the wrong magic or version.
    """
    path = Path(path)
    _check_is_file(path)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token shard '{path}' is empty (0 bytes); expected the {_FORMAT}; {_REBUILD}")
    if size < HEADER_BYTES:
        raise ValueError(
            f"token shard '{path}' has a truncated header: {size} bytes, the header alone is "
            f"{HEADER_BYTES} bytes ({_FORMAT}); the file is incomplete, {_REBUILD}"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, n_tokens = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        raise ValueError(
            f"token shard '{path}' has magic {magic}, expected {MAGIC} ({_FORMAT}); "
            f"this is not a token shard in this format, convert the data with `lightning-opt-data prepare`"
        )
    if version != VERSION:
        raise ValueError(
            f"token shard '{path}' has version {version}, expected {VERSION} (uint16 tokens); "
            f"other versions are not supported, convert the data with `lightning-opt-data prepare`"
        )
    if n_tokens < 0:
        raise ValueError(
            f"token shard '{path}' has a negative token count {n_tokens} in its header; {_REBUILD}"
        )
    expected = HEADER_BYTES + 2 * n_tokens
    if size != expected:
        what = "shorter" if size < expected else "longer"
        raise ValueError(
            f"token shard '{path}' has a token count mismatch: the header says {n_tokens} tokens "
            f"({expected} bytes) but the file has {size} bytes ({what} than the header says, "
            f"{(size - HEADER_BYTES) / 2:g} tokens); the file is truncated or corrupt, {_REBUILD}"
        )
    return n_tokens


def read_shard(path: PathLike) -> np.memmap:
    """Memory-map a shard's tokens (uint16, read-only, no copy) after validating it.

    Args:
        path: a ``.bin`` shard.

    Returns:
        A read-only ``np.memmap`` of shape ``[n_tokens]``. A shard whose header says 0 tokens gives an
        empty (non-mapped) uint16 array, since a zero-length file region cannot be mapped.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_header`.
    """
    n_tokens = read_header(path)
    if n_tokens == 0:
        return np.empty(0, dtype=np.uint16)  # type: ignore[return-value]
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def write_shard(path: PathLike, tokens: Any) -> Path:
    """Write tokens as a shard, atomically (temporary file, fsync, rename).

    Args:
        path: destination; its parent folder is created if needed.
        tokens: a 1-D integer sequence (numpy array, list, torch tensor) with ids in [0, 65535].

    Returns:
        The destination path.

    Raises:
        ValueError: tokens are not 1-D integers or are outside the uint16 range.
    """
    path = Path(path)
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(
            f"write_shard('{path}'): tokens must be 1-D, got shape {arr.shape}; flatten them first"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"write_shard('{path}'): tokens must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ValueError(
                f"write_shard('{path}'): token ids must be in [0, {MAX_TOKEN_ID}] (uint16), got min {lo}, "
                f"max {hi}; this format cannot store vocabularies larger than 65536"
            )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique temp name in the same folder so the final rename is atomic and concurrent writers
    # (e.g. several ranks building the same cache) never see a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype("<u2", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms/filesystems cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_GLOB_CHARS = set("*?[")


def resolve_files(patterns: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand shard paths and glob patterns into a list of files.

    Each glob's matches are sorted (so ``fineweb_train_*.bin`` is read in shard order); the order of
    the patterns themselves is kept and duplicates are dropped. ``~`` is expanded.

    Args:
        patterns: a path or glob, or a list of them.

    Returns:
        The files, in order.

    Raises:
        FileNotFoundError: a pattern matches nothing, or a plain path does not exist, or nothing given.
        ValueError: a plain path is a directory.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise FileNotFoundError(
            "no token shard files given; pass a path or glob such as 'data/*_train_*.bin'"
        )
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        text = os.path.expanduser(os.fspath(pattern))
        if _GLOB_CHARS & set(text):
            matches = sorted(Path(m) for m in glob.glob(text) if not os.path.isdir(m))
            if not matches:
                raise FileNotFoundError(
                    f"glob pattern '{text}' matches no files (searched from '{os.getcwd()}'); check the "
                    f"pattern, or create shards with `lightning-opt-data prepare`"
                )
        else:
            path = Path(text)
            _check_is_file(path)
            matches = [path]
        for m in matches:
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


def max_token_id(
    path: PathLike, full_scan_tokens: int = 1 << 24, sample_blocks: int = 16, block: int = 1 << 16
) -> int:
    """Largest token id in a shard: exact for shards up to ``full_scan_tokens``, sampled above.

    Shards up to 16M tokens (32 MB) are scanned fully. A full scan of 100 FineWeb shards would read
    20 GB on every rank, so above the threshold we read ``sample_blocks`` evenly spaced blocks of
    ``block`` tokens (first and last included; 2 MB a shard by default), which catches a shard made with
    another tokenizer (ids everywhere) but not a single stray id.
    """
    tokens = read_shard(path)
    n = tokens.shape[0]
    if n == 0:
        return -1
    if n <= full_scan_tokens:
        return int(tokens.max())
    starts = np.linspace(0, n - block, num=sample_blocks).astype(np.int64)
    return int(max(int(tokens[s : s + block].max()) for s in starts))


def check_vocab(files: Iterable[PathLike], vocab_size: int, full_scan_tokens: int = 1 << 24) -> None:
    """Raise ``ValueError`` if a shard holds a token id ``>= vocab_size`` (see :func:`max_token_id`)."""
    for f in files:
        top = max_token_id(f, full_scan_tokens=full_scan_tokens)
        if top >= vocab_size:
            raise ValueError(
                f"token shard '{f}' contains token id {top}, which is >= vocab_size {vocab_size}; the shard "
                f"was made with a different tokenizer, or vocab_size is too small (GPT-2 needs 50257, "
                f"the byte-level corpus 256)"
            )
