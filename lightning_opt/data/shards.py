"""Token shards in the FineWeb / llm.c ``.bin`` format.

A shard is a header of 256 little-endian int32 (``[0]`` = magic 20240520, ``[1]`` = version 1,
``[2]`` = number of tokens) followed by the tokens as little-endian uint16. This is the format of
``kjj0/fineweb10B-gpt2`` and of the GPT-2 speedrun, so real FineWeb shards are read unchanged.
"""

from __future__ import annotations

import glob
import os
import tempfile
import warnings
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
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a shard gets a normal file's mode
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


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; set straight back
    os.umask(mask)
    return mask


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
    the patterns themselves is kept. ``~`` is expanded. A file named twice (by two patterns, or by an
    absolute and a relative path, or through a symlink) is read once, with a warning.

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
    seen: dict[Path, Path] = {}  # resolved path -> the spelling kept
    dropped: list[str] = []
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
            real = m.resolve()
            if real in seen:
                if m != seen[real]:
                    dropped.append(f"'{m}' (same file as '{seen[real]}')")
                elif not _GLOB_CHARS & set(text):
                    dropped.append(f"'{m}'")
                continue
            seen[real] = m
            out.append(m)
    if dropped:
        warnings.warn(
            f"token shards given more than once are read once: {', '.join(dropped[:5])}"
            f"{' ...' if len(dropped) > 5 else ''}; remove the repeated paths or patterns",
            stacklevel=2,
        )
    return out


def max_token_id(
    path: PathLike, full_scan_tokens: int = 1 << 24, sample_blocks: int = 16, block: int = 1 << 16
) -> int:
    """Largest token id in a shard: exact for shards up to ``full_scan_tokens``, sampled above.

    Shards up to 16M tokens (32 MB) are scanned fully. Above that, ``sample_blocks`` evenly spaced
    blocks of ``block`` tokens are read (first and last included; 2 MB a shard by default): quick, and
    enough to catch a shard made with another tokenizer, but not a single stray id (use
    :func:`first_token_at_least` for an exact answer).
    """
    tokens = read_shard(path)
    n = tokens.shape[0]
    if n == 0:
        return -1
    if n <= full_scan_tokens:
        return int(tokens.max())
    starts = np.linspace(0, n - block, num=sample_blocks).astype(np.int64)
    return int(max(int(tokens[s : s + block].max()) for s in starts))


def first_token_at_least(path: PathLike, limit: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """``(offset, id)`` of the first token id ``>= limit`` in a shard, or ``None``: an exact scan, read
    in chunks of ``chunk`` tokens (one vectorised pass over the memory map, 32 MB at a time)."""
    tokens = read_shard(path)
    for lo in range(0, tokens.shape[0], chunk):
        part = tokens[lo : lo + chunk]
        if int(part.max()) >= limit:
            i = int(np.argmax(part >= limit))
            return lo + i, int(part[i])
    return None


def vocab_error(path: PathLike, offset: int, token: int, vocab_size: int) -> ValueError:
    """The error for token id ``token >= vocab_size`` at token ``offset`` of shard ``path``."""
    return ValueError(
        f"token shard '{path}' contains token id {token} at token offset {offset}, which is >= vocab_size "
        f"{vocab_size}; the shard was made with a different tokenizer, is corrupt, or vocab_size is too "
        f"small (GPT-2 needs 50257, the byte-level corpus 256); re-create it with `lightning-opt-data "
        f"prepare` using the model's tokenizer"
    )


def check_vocab(files: Iterable[PathLike], vocab_size: int) -> None:
    """Raise ``ValueError`` naming the shard, the offset and the id if any shard holds a token id
    ``>= vocab_size``. Every token is checked (see :func:`first_token_at_least`)."""
    for f in files:
        found = first_token_at_least(f, vocab_size)
        if found is not None:
            raise vocab_error(f, found[0], found[1], vocab_size)
